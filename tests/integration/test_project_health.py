"""The app's migrations are complete and its system checks pass."""

from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection
from django.test import override_settings

from durable.checks import check_settings
from durable.conf import get_settings


@pytest.mark.django_db
def test_makemigrations_check_finds_nothing_to_do():
    call_command("makemigrations", "--check", "--dry-run", stdout=StringIO())


def test_system_checks_pass():
    call_command("check", stdout=StringIO())


def test_unknown_setting_is_a_check_error():
    with override_settings(DURABLE={"SHARDZ": 3}):
        errors = check_settings()
        assert [e.id for e in errors] == ["durable.E001"]
        assert "SHARDZ" in errors[0].msg


def test_bad_values_are_check_errors():
    with override_settings(DURABLE={"SHARDS": 0, "DATABASE": "nope"}):
        ids = sorted(e.id for e in check_settings())
    assert ids == ["durable.E002", "durable.E003"]


def test_settings_are_reread_when_changed():
    with override_settings(DURABLE={"SHARDS": 7}):
        assert get_settings().SHARDS == 7
    assert get_settings().SHARDS != 7


@pytest.mark.postgres
@pytest.mark.django_db
def test_postgres_run_really_talks_to_postgresql():
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('server_version_num')::int")
        (version,) = cursor.fetchone()
    assert version >= 130000
