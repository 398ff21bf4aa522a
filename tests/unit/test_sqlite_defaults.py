"""durable's SQLite options: set where the project says nothing, never overriding it."""

from __future__ import annotations

from durable.storage.sqlite import apply_defaults


def test_startprojects_sqlite_gets_immediate_transactions_a_timeout_and_wal():
    database = {"ENGINE": "django.db.backends.sqlite3", "NAME": "db.sqlite3"}
    assert apply_defaults(database)
    assert database["OPTIONS"] == {
        "transaction_mode": "IMMEDIATE",
        "timeout": 20,
        "init_command": "PRAGMA journal_mode=WAL;",
    }


def test_the_projects_own_options_win():
    options = {
        "transaction_mode": "EXCLUSIVE",
        "timeout": 3,
        "init_command": "PRAGMA journal_mode=DELETE; PRAGMA foreign_keys=ON;",
    }
    database = {"ENGINE": "django.db.backends.sqlite3", "OPTIONS": dict(options)}
    apply_defaults(database)
    assert database["OPTIONS"] == options


def test_another_init_command_keeps_its_pragmas_after_wal():
    database = {"ENGINE": "django.db.backends.sqlite3", "OPTIONS": {"init_command": "PRAGMA x=1;"}}
    apply_defaults(database)
    assert database["OPTIONS"]["init_command"] == "PRAGMA journal_mode=WAL; PRAGMA x=1;"


def test_other_databases_are_left_alone():
    database = {"ENGINE": "django.db.backends.postgresql", "OPTIONS": {}}
    assert not apply_defaults(database)
    assert database["OPTIONS"] == {}
