"""URLs of the test project: the Django admin, where durable's models are managed."""

from django.contrib import admin
from django.urls import path

urlpatterns = [path("admin/", admin.site.urls)]
