"""URLs of the test project: the Django admin, and the web side's Prometheus metrics."""

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("", include("django_prometheus.urls")),  # /metrics (django-prometheus)
]
