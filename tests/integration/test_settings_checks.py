"""Every DURABLE setting is checked for type and range, and every problem is reported.

``manage.py check`` shows one message per bad key (naming the key, the value and what
is allowed), ``get_settings()`` refuses values it cannot use with ``ImproperlyConfigured``,
and a key added to ``DurableSettings`` without a rule fails here.
"""

from __future__ import annotations

import dataclasses
from io import StringIO
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import override_settings

from durable.checks import check_crons, check_settings
from durable.conf import RELATIONS, RULES, DurableSettings, find_problems, get_settings

DOCS = Path(__file__).resolve().parents[2] / "docs" / "reference" / "settings.md"

# (key, bad value, check id): the values of issue 18 first, then one bad value per key
# of every kind a rule can refuse (wrong type, bool for a number, out of range, empty).
BAD = [
    ("ASYNC_COMMIT", 1, "durable.E003"),
    ("ATOMIC_TIMEOUT_S", 0, "durable.E003"),
    ("HANDLER_TIMEOUT_S", float("nan"), "durable.E003"),
    ("SHUTDOWN_GRACE_S", -1, "durable.E003"),
    ("IMPORTS", "myapp.tasks", "durable.E003"),
    ("RAFT", "on", "durable.E020"),
    ("LEASE_TTL_S", -1, "durable.E003"),
    ("LEASE_TTL_S", "10", "durable.E003"),
    ("RESCAN_INTERVAL_S", 0, "durable.E003"),
    ("CLAIM_TIMEOUT_S", 0, "durable.E003"),
    ("MAX_ATTEMPTS", 0, "durable.E003"),
    ("RETENTION_DAYS", -3, "durable.E003"),
    ("BATCH_TIME_BUDGET_S", -5, "durable.E003"),
    ("BROKER_URL", 5, "durable.E003"),
    ("DATABASE", "nope", "durable.E002"),
    ("DATABASE", 0, "durable.E002"),
    ("LISTEN_DATABASE", "nope", "durable.E002"),
    ("LISTEN_DATABASE", 0, "durable.E002"),
    ("PREPARE_STATEMENTS", "yes", "durable.E003"),
    ("PREPARE_STATEMENTS", 1, "durable.E003"),
    ("SHARDS", 0, "durable.E003"),
    ("SHARDS", 40_000, "durable.E003"),
    ("SHARDS", True, "durable.E003"),
    ("SHARDS", 64.0, "durable.E003"),
    ("BUCKET_SHIFT", 7, "durable.E003"),
    ("BUCKET_SHIFT", 25, "durable.E003"),
    ("HORIZON_BUCKETS", 0, "durable.E003"),
    ("HORIZON_BUCKETS", "64", "durable.E003"),
    ("LEASE_TTL_S", 0.5, "durable.E003"),
    ("LEASE_TTL_S", 2_000_000, "durable.E003"),
    ("LEASE_TTL_S", float("nan"), "durable.E003"),
    ("LEASE_TTL_S", True, "durable.E003"),
    ("RESCAN_INTERVAL_S", None, "durable.E003"),
    ("BATCH_SIZE", 0, "durable.E003"),
    ("BATCH_SIZE", 1.5, "durable.E003"),
    ("BATCH_TIME_BUDGET_S", 0, "durable.E003"),
    ("CLAIM_TIMEOUT_S", float("inf"), "durable.E003"),
    ("MAX_ATTEMPTS", 2**40, "durable.E003"),
    ("MAX_ATTEMPTS", "5", "durable.E003"),
    ("BACKOFF_BASE_S", 0, "durable.E003"),
    ("BACKOFF_MAX_S", -1.0, "durable.E003"),
    ("BACKOFF_MAX_S", 1e17, "durable.E003"),
    ("RETENTION_DAYS", 1e9, "durable.E003"),
    ("RETENTION_DAYS", "7", "durable.E003"),
    ("FAILED_RETENTION_DAYS", -1, "durable.E003"),
    ("FAILED_RETENTION_DAYS", "30", "durable.E003"),
    ("RUN_RETENTION_DAYS", 1e9, "durable.E003"),
    ("RUN_RETENTION_DAYS", False, "durable.E003"),
    ("MAX_PAYLOAD_BYTES", 0, "durable.E003"),
    ("MAX_PAYLOAD_BYTES", 1024.0, "durable.E003"),
    ("MAX_RESULT_BYTES", 0, "durable.E003"),
    ("MAX_RESULT_BYTES", "1MB", "durable.E003"),
    ("MAX_STEPS_PER_RUN", 0, "durable.E003"),
    ("MAX_STEPS_PER_RUN", 1_000_001, "durable.E003"),
    ("NOTIFY", 1, "durable.E003"),
    ("NOTIFY", "yes", "durable.E003"),
    ("DISPATCH", "celery", "durable.E004"),
    ("DISPATCH", None, "durable.E004"),
    ("BROKER_URL", "", "durable.E003"),
]


def _ids(messages):
    return [m.id for m in messages]


def test_the_bad_values_cover_every_key():
    """A new key needs its bad values here too (its rule: tests/unit/test_settings_rules.py)."""
    assert {key for key, _, _ in BAD} | {"CRONS"} == set(RULES)


@pytest.mark.parametrize(("key", "value", "check_id"), BAD, ids=lambda v: repr(v)[:30])
def test_a_bad_value_is_one_check_error_naming_key_value_and_range(key, value, check_id):
    with override_settings(DURABLE={key: value}):
        errors = check_settings()
    assert _ids(errors) == [check_id], errors
    message = errors[0].msg
    assert f"DURABLE[{key!r}]" in message
    assert repr(value)[:20] in message
    assert f"must be {RULES[key].requirement}" in message


@pytest.mark.parametrize(("key", "value", "check_id"), BAD, ids=lambda v: repr(v)[:30])
def test_get_settings_refuses_the_value_naming_the_key(key, value, check_id):
    with override_settings(DURABLE={key: value}), pytest.raises(ImproperlyConfigured) as exc:
        get_settings()
    assert f"DURABLE[{key!r}]" in str(exc.value)


def test_valid_values_of_the_other_type_are_accepted():
    ok = {"LEASE_TTL_S": 10, "RESCAN_INTERVAL_S": 1, "RETENTION_DAYS": 0, "CLAIM_TIMEOUT_S": 60}
    with override_settings(DURABLE=ok):
        assert check_settings() == []
        assert get_settings().LEASE_TTL_S == 10


def test_default_settings_give_no_message():
    with override_settings(DURABLE={}):
        assert check_settings() == []
        assert get_settings() == DurableSettings()
    with override_settings(DURABLE=None):  # absent or None reads as {}
        assert check_settings() == []
    assert find_problems(dataclasses.asdict(DurableSettings())) == []


def test_several_bad_keys_give_one_message_each():
    bad = {"LEASE_TTL_S": -1, "MAX_ATTEMPTS": 0, "BROKER_URL": 5, "DISPATCH": "x", "SHARDZ": 1}
    with override_settings(DURABLE=bad):
        errors = check_settings()
        with pytest.raises(ImproperlyConfigured) as exc:
            get_settings()
    assert sorted(_ids(errors)) == [
        "durable.E001",
        "durable.E003",
        "durable.E003",
        "durable.E003",
        "durable.E004",
    ]
    for key in bad:
        assert sum(repr(key) in e.msg for e in errors) == 1, key
        assert repr(key) in str(exc.value)


@pytest.mark.parametrize("value", [["SHARDS", 64], [("SHARDS", 64)], "SHARDS=64", 64])
def test_durable_not_a_dict_is_one_clear_error(value):
    with override_settings(DURABLE=value):
        errors = check_settings()
        with pytest.raises(ImproperlyConfigured, match="must be a dict"):
            get_settings()
    assert _ids(errors) == ["durable.E001"]
    assert "settings.DURABLE must be a dict" in errors[0].msg
    assert repr(value) in errors[0].msg


def test_unknown_keys_are_each_a_check_error_and_refused_by_get_settings():
    with override_settings(DURABLE={"SHARDZ": 3, "LEASE_TTL": 5}):
        errors = check_settings()
        with pytest.raises(ImproperlyConfigured, match="SHARDZ"):
            get_settings()
    assert _ids(errors) == ["durable.E001", "durable.E001"]
    assert ["LEASE_TTL" in errors[0].msg, "SHARDZ" in errors[1].msg] == [True, True]


@pytest.mark.parametrize(
    ("values", "keys"),
    [
        ({"RESCAN_INTERVAL_S": 10.0, "LEASE_TTL_S": 10.0}, ("RESCAN_INTERVAL_S", "LEASE_TTL_S")),
        ({"BATCH_TIME_BUDGET_S": 12, "LEASE_TTL_S": 10}, ("BATCH_TIME_BUDGET_S", "LEASE_TTL_S")),
        (
            {"BATCH_TIME_BUDGET_S": 5, "CLAIM_TIMEOUT_S": 5},
            ("BATCH_TIME_BUDGET_S", "CLAIM_TIMEOUT_S"),
        ),
        ({"BACKOFF_BASE_S": 60, "BACKOFF_MAX_S": 30}, ("BACKOFF_BASE_S", "BACKOFF_MAX_S")),
    ],
)
def test_settings_that_disagree_are_an_e005_naming_both(values, keys):
    with override_settings(DURABLE=values):
        errors = check_settings()
        get_settings()  # each value is usable on its own: only the worker refuses them
    assert _ids(errors) == ["durable.E005"]
    assert all(f"DURABLE[{key!r}]" in errors[0].msg for key in keys)
    assert errors[0].hint


def test_every_relation_is_tested():
    tested = {
        ("RESCAN_INTERVAL_S", "LEASE_TTL_S"),
        ("BATCH_TIME_BUDGET_S", "LEASE_TTL_S"),
        ("BATCH_TIME_BUDGET_S", "CLAIM_TIMEOUT_S"),
        ("BACKOFF_BASE_S", "BACKOFF_MAX_S"),
    }
    assert {(r.first, r.second) for r in RELATIONS} == tested


def test_a_relation_is_not_reported_when_one_of_its_values_is_bad():
    with override_settings(DURABLE={"RESCAN_INTERVAL_S": "20", "LEASE_TTL_S": 10}):
        assert _ids(check_settings()) == ["durable.E003"]


def test_crons_not_a_dict_is_reported_once_by_the_cron_checks():
    with override_settings(DURABLE={"CRONS": ["nightly"]}):
        assert check_settings() == []
        assert _ids(check_crons()) == ["durable.E015"]
        with pytest.raises(ImproperlyConfigured, match=r"DURABLE\['CRONS'\] must be a dict"):
            get_settings()


def test_manage_py_check_fails_listing_every_problem():
    bad = override_settings(DURABLE={"LEASE_TTL_S": -1, "CLAIM_TIMEOUT_S": 0})
    with bad, pytest.raises(SystemCheckError) as exc:
        call_command("check", stdout=StringIO(), stderr=StringIO())
    text = str(exc.value)
    assert "durable.E003" in text and "LEASE_TTL_S" in text and "CLAIM_TIMEOUT_S" in text


def test_the_reference_documents_each_rule_as_checked():
    """docs/reference/settings.md states each key's allowed values in the checks' words."""
    text = DOCS.read_text()
    for key, rule in RULES.items():
        row = next((line for line in text.splitlines() if line.startswith(f"| `{key}`")), None)
        assert row is not None, f"{key} has no row in {DOCS.name}"
        allowed = rule.requirement.split(" (")[0] if key.endswith("DATABASE") else rule.requirement
        assert allowed in row, f"{key}: the docs must say {allowed!r}"
    for rel in RELATIONS:
        assert f"`{rel.first}` {rel.requirement} `{rel.second}`" in text
    for check_id in (
        "E001",
        "E002",
        "E003",
        "E004",
        "E005",
        "E006",
        "W001",
        "W002",
        "W003",
        "W004",
    ):
        assert f"`durable.{check_id}`" in text


def _pooled(monkeypatch, prepare_threshold, listen_name):
    """DATABASES as behind a pooler: ``default`` pooled, ``listen`` direct."""
    from django.conf import settings

    main = {**settings.DATABASES["default"], "ENGINE": "django.db.backends.postgresql"}
    main["OPTIONS"] = {} if prepare_threshold is None else {"prepare_threshold": 5}
    listen = {**main, "NAME": listen_name or main["NAME"], "OPTIONS": {}}
    # Not override_settings(DATABASES=...), which warns; the live connection is left alone.
    monkeypatch.setitem(settings.DATABASES, "default", main)
    monkeypatch.setitem(settings.DATABASES, "listen", listen)


def test_listen_database_checks_preparing_and_the_database_name(monkeypatch):
    from durable.checks import check_listen_database

    durable = {"LISTEN_DATABASE": "listen"}
    _pooled(monkeypatch, None, None)
    with override_settings(DURABLE=durable):
        assert check_listen_database() == []
    _pooled(monkeypatch, 5, None)
    with override_settings(DURABLE=durable):
        messages = check_listen_database()
    assert _ids(messages) == ["durable.W003"]
    assert "prepare_threshold" in messages[0].msg and "'listen'" in messages[0].msg
    _pooled(monkeypatch, None, "elsewhere")
    with override_settings(DURABLE=durable):
        messages = check_listen_database()
    assert _ids(messages) == ["durable.W004"]
    assert "'elsewhere'" in messages[0].msg
    # Unset (the default), or the same alias: nothing to compare.
    _pooled(monkeypatch, 5, "elsewhere")
    with override_settings(DURABLE={}):
        assert check_listen_database() == []
    with override_settings(DURABLE={"LISTEN_DATABASE": "default"}):
        assert check_listen_database() == []


def test_preparing_forced_on_through_a_pooler_is_a_warning(monkeypatch):
    from durable.checks import check_listen_database

    _pooled(monkeypatch, None, None)
    with override_settings(DURABLE={"LISTEN_DATABASE": "listen", "PREPARE_STATEMENTS": True}):
        messages = check_listen_database()
    assert _ids(messages) == ["durable.W003"]
    assert "PREPARE_STATEMENTS" in messages[0].msg
