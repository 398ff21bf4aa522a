"""Orphaned shards are a check error, and the worker commands refuse to start on any error.

Lowering ``SHARDS`` while timers exist leaves the shards at or above it with no owner;
the rows here are written the way an application writes them (scheduled and started
under the larger ``SHARDS``), then ``SHARDS`` is lowered. The commands are run in-process
with ``call_command``; tests/acceptance/test_worker_refuses_to_start.py runs them as real
processes.
"""

from __future__ import annotations

import gc
import signal
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError, SystemCheckError
from django.test import override_settings

import durable
from durable.checks import check_orphaned_shards
from durable.core.sharding import shard_for
from durable.models import ShardLease, Timer, TimerState
from durable.storage import leases
from durable.storage.status import OrphanedShard, orphaned_shards
from testproject.demo import handlers as h
from testproject.demo.workflows import onboarding

pytestmark = pytest.mark.django_db
NOW = 1_900_000_000_000


@pytest.fixture(autouse=True)
def _restore_signal_handlers():
    """run_timer_shards installs SIGTERM/SIGINT handlers and freezes the GC: undo both."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)
    gc.unfreeze()


def _keys_on(shard: int, shards: int, count: int, prefix: str = "k") -> list[str]:
    found = (f"{prefix}-{i}" for i in range(100_000) if shard_for(f"{prefix}-{i}", shards) == shard)
    return [next(found) for _ in range(count)]


@pytest.fixture
def orphans(clock):
    """Under SHARDS = 8: 2 pending timers and 1 firing on shard 5, a run on shard 6, a timer
    on shard 1; then SHARDS = 4."""
    with override_settings(DURABLE={"SHARDS": 8}):
        five = [durable.schedule(h.noop, key=k) for k in _keys_on(5, 8, 3)]
        durable.schedule(h.noop, key=_keys_on(1, 8, 1)[0])
        run = onboarding.start("a@example.com", run_id=_keys_on(6, 8, 1, prefix="run")[0])
    Timer.objects.filter(pk=five[0].pk).update(state=TimerState.FIRING, claim_expires_ms=NOW)
    assert run.shard == 6
    with override_settings(DURABLE={"SHARDS": 4}):
        yield


def test_orphaned_shards_counts_the_work_beyond_shards(orphans):
    found = orphaned_shards("default", 4)
    # The run's start timer is a pending timer of shard 6 too.
    assert found == [OrphanedShard(5, pending=2, firing=1), OrphanedShard(6, pending=1, runs=1)]
    assert orphaned_shards("default", 8) == []


def test_orphaned_shards_are_an_error_naming_shards_and_counts(orphans):
    errors = check_orphaned_shards(databases=["default"])
    assert [e.id for e in errors] == ["durable.E006"]
    message = errors[0].msg
    assert "2 shards at or above DURABLE['SHARDS'] = 4" in message
    assert "3 pending timers, 1 firing timer, 1 unfinished workflow run" in message
    assert "shard 5: 2 pending timers, 1 firing timer" in message
    assert "shard 6: 1 pending timer, 1 unfinished workflow run" in message
    assert "back to 7 or more" in errors[0].hint


def test_the_database_check_runs_only_when_asked_for_durables_database(orphans):
    assert check_orphaned_shards() == []
    assert check_orphaned_shards(databases=["other"]) == []


def test_no_work_beyond_shards_gives_no_message(clock):
    with override_settings(DURABLE={"SHARDS": 8}):
        durable.schedule(h.noop, key=_keys_on(3, 8, 1)[0])
    with override_settings(DURABLE={"SHARDS": 4}):
        assert check_orphaned_shards(databases=["default"]) == []
    # Fired and cancelled timers and finished runs hold no work.
    Timer.objects.update(shard=7, state=TimerState.FIRED)
    with override_settings(DURABLE={"SHARDS": 4}):
        assert check_orphaned_shards(databases=["default"]) == []


def test_manage_py_check_with_the_database_reports_orphans(orphans):
    call_command("check", stdout=StringIO())  # without --database: not looked at
    with pytest.raises(SystemCheckError, match=r"durable\.E006"):
        call_command("check", databases=["default"], stdout=StringIO(), stderr=StringIO())
    # migrate runs Django's database checks before migrating (a no-op here).
    with pytest.raises(SystemCheckError, match=r"durable\.E006"):
        call_command("migrate", skip_checks=False, stdout=StringIO(), stderr=StringIO())


def test_lease_rows_beyond_shards_are_a_warning_naming_live_holders(clock):
    leases.ensure_shards("default", 8)
    assert leases.acquire("default", 6, "old-worker", NOW, 10.0) is not None
    with override_settings(DURABLE={"SHARDS": 4}):
        messages = check_orphaned_shards(databases=["default"])
    assert [m.id for m in messages] == ["durable.W001"]
    assert "shards 4, 5, 6, 7" in messages[0].msg
    assert "shard 6 by 'old-worker'" in messages[0].msg
    assert "shard__gte=4" in messages[0].hint


def test_the_worker_refuses_to_start_on_orphaned_shards(orphans):
    with pytest.raises(SystemCheckError) as exc:
        call_command("run_timer_shards", "--duration", "0", stdout=StringIO())
    assert "durable.E006" in str(exc.value) and "shard 5" in str(exc.value)
    assert not ShardLease.objects.exists()  # refused before touching anything


def test_the_worker_refuses_to_start_listing_every_bad_setting(settings):
    settings.DURABLE = {"LEASE_TTL_S": -1, "RESCAN_INTERVAL_S": 0, "BROKER_URL": 5, "X": 1}
    for command in ("run_timer_shards", "run_durable_executor"):
        with pytest.raises(SystemCheckError) as exc:
            call_command(command, "--duration", "0", stdout=StringIO())
        text = str(exc.value)
        assert text.count("durable.E003") == 3 and text.count("durable.E001") == 1, text
        for key in ("LEASE_TTL_S", "RESCAN_INTERVAL_S", "BROKER_URL", "'X'"):
            assert key in text


def test_the_worker_refuses_settings_that_disagree(settings):
    settings.DURABLE = {"LEASE_TTL_S": 2.0, "BATCH_TIME_BUDGET_S": 2.0}
    with pytest.raises(SystemCheckError, match=r"durable\.E005"):
        call_command("run_timer_shards", "--duration", "0", stdout=StringIO())


def test_skip_checks_skips_only_the_projects_other_checks(orphans):
    with pytest.raises(SystemCheckError, match=r"durable\.E006"):
        call_command("run_timer_shards", "--duration", "0", skip_checks=True, stdout=StringIO())


def test_silencing_e006_lets_the_worker_start(orphans, settings):
    settings.SILENCED_SYSTEM_CHECKS = ["durable.E006"]
    call_command("run_timer_shards", "--duration", "0", stdout=StringIO())


def test_the_executor_owns_no_shards_so_orphans_do_not_stop_it(orphans):
    # It passes the checks and stops at its own broker check, after them.
    with pytest.raises(CommandError, match="memory:// broker") as exc:
        call_command("run_durable_executor", "--duration", "0", stdout=StringIO())
    assert not isinstance(exc.value, SystemCheckError)


def test_the_worker_starts_on_good_settings_and_prints_warnings(clock, settings):
    leases.ensure_shards("default", 8)
    settings.DURABLE = {"SHARDS": 4}
    err = StringIO()
    call_command("run_timer_shards", "--duration", "0", stdout=StringIO(), stderr=err)
    assert "durable.W001" in err.getvalue()


def test_the_worker_says_when_it_started_and_stopped(clock):
    out = StringIO()
    call_command("run_timer_shards", "--duration", "0", "--node", "n1", stdout=out)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("durable worker n1 started: shards 0-"), lines
    assert "handler threads" in lines[0] and "database 'default'" in lines[0]
    assert lines[-1] == "durable worker n1 stopped"
