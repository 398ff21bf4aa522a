"""Nothing is imported from row data: the worker only looks names up in its registries.

Rows whose target names something importable but not registered (``unittest.__main__.x``
would run unittest's command line and exit the worker; ``builtins.print``, ``sys.exit``
and ``os.system`` would be called) fail with a clear error on their normal failure path,
import nothing, call nothing, and the engine fires its other timers on.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured

import durable
from durable.checks import check_imports, check_settings
from durable.discovery import discover
from durable.dispatch.registry import handlers
from durable.exceptions import ScheduleError, UnknownHandler
from durable.models import CronSchedule, Timer, WorkflowRun
from durable.scheduling import schedules
from durable.scheduling.cron import functions
from durable.scheduling.operations import run_schedule_now
from testproject.demo import probes
from testproject.demo.models import FireRecord
from testproject.demo.workflows import no_steps

START_MS = 1_900_000_000_000
POISON = ["unittest.__main__.x", "builtins.print", "sys.exit", "os.system"]
RECORD = "testproject.demo.crons.record"
WHERE = "DURABLE['IMPORTS']"
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def engine(start_engine):
    settings = {"SHARDS": 4, "LEASE_TTL_S": 3600.0, "RESCAN_INTERVAL_S": 1.0}
    return start_engine(settings, node="registry-node", threads=2)


@pytest.fixture
def untouched(capfd, tmp_path):
    """Asserts, after the test, that nothing a poison target would do was done."""
    assert "unittest.__main__" not in sys.modules
    marker = tmp_path / "ran"
    yield {"args": [f"touch {marker}"], "marker": marker}
    assert "unittest.__main__" not in sys.modules, "a row's target was imported"
    assert not marker.exists(), "os.system was called with a row's arguments"
    assert f"touch {marker}" not in capfd.readouterr().out, "print was called"


def turns(engine, clock, count=6):
    """``count`` engine turns, one second apart, each waiting for its external handlers."""
    for _ in range(count):
        clock.advance(1_000)
        engine.tick()
        deadline = time.monotonic() + 10
        while engine.firer.in_flight and time.monotonic() < deadline:
            time.sleep(0.005)


def lives_on(engine, clock):
    """The engine still fires a registered handler."""
    timer = durable.schedule(probes.record, args=["alive"])
    turns(engine, clock, 2)
    assert Timer.objects.get(pk=timer.pk).state == "fired"


def poison_timer(kind, target, args):
    return Timer.objects.create(
        shard=0,
        bucket=START_MS >> 16,
        fire_at_ms=START_MS,
        kind=kind,
        target=target,
        args=args,
        max_attempts=2,
        backoff_base_s=0.1,
        backoff_max_s=0.1,
    )


@pytest.mark.parametrize("target", POISON)
def test_a_timer_naming_an_unregistered_function_dead_letters(engine, clock, untouched, target):
    timer = poison_timer("handler", target, untouched["args"])
    engine.runners[0].rescan(clock.now_ms())
    turns(engine, clock)
    timer.refresh_from_db()
    assert timer.state == "failed" and timer.attempts == 2
    assert f"unknown handler '{target}': it is not registered" in timer.last_error
    lives_on(engine, clock)


@pytest.mark.parametrize("target", POISON)
def test_a_task_row_naming_an_unregistered_task_dead_letters(engine, clock, untouched, target):
    timer = poison_timer("task", target, untouched["args"])
    engine.runners[0].rescan(clock.now_ms())
    turns(engine, clock)
    timer.refresh_from_db()
    assert timer.state == "failed"
    assert f"unknown task '{target}': it is not registered" in timer.last_error
    lives_on(engine, clock)


@pytest.mark.parametrize("target", POISON)
def test_a_run_naming_an_unregistered_workflow_fails(engine, clock, untouched, target):
    run = no_steps.start(untouched["args"][0])
    WorkflowRun.objects.filter(pk=run.pk).update(name=target)
    turns(engine, clock)
    run.refresh_from_db()
    assert run.state == "failed"
    assert f"unknown workflow '{target}': it is not registered" in run.error
    assert WHERE in run.error
    lives_on(engine, clock)


@pytest.mark.parametrize("atomic", [True, False])
@pytest.mark.parametrize("target", POISON)
def test_a_schedule_row_naming_an_unregistered_function_records_a_failed_run(
    engine, clock, untouched, target, atomic
):
    schedules.create("poison", RECORD, every=timedelta(seconds=1), atomic=atomic)
    CronSchedule.objects.filter(name="poison").update(handler=target)
    turns(engine, clock, 3)
    row = CronSchedule.objects.get(name="poison")
    assert row.last_status == "failed" and row.failed_count >= 1 and row.fired_count == 0
    assert f"unknown schedule function '{target}': it is not registered" in row.last_error
    assert not FireRecord.objects.filter(key__startswith="poison:").exists()
    # Run now takes the same lookup.
    row.failed_count = 0
    row.save(update_fields=["failed_count"])
    run_schedule_now("poison")
    turns(engine, clock, 2)
    row.refresh_from_db()
    assert row.failed_count >= 1 and "unknown schedule function" in row.last_error
    lives_on(engine, clock)


def test_changing_a_schedule_does_not_import_its_stored_function(engine, clock, untouched):
    schedules.create("stored", RECORD, every=timedelta(seconds=10))
    CronSchedule.objects.filter(name="stored").update(handler="unittest.__main__.x")
    schedules.update("stored", every=timedelta(seconds=20))
    assert CronSchedule.objects.get(name="stored").handler == "unittest.__main__.x"


@pytest.mark.parametrize("target", ["builtins.print", "sys.exit", "os.system", RECORD + "x"])
def test_the_api_refuses_what_is_not_registered(engine, target):
    with pytest.raises(UnknownHandler, match=r"unknown handler"):
        durable.schedule(target)
    with pytest.raises(ScheduleError, match=r"handler"):
        schedules.create("refused", target, every=timedelta(seconds=1))
    assert not Timer.objects.filter(kind="handler").exists()
    assert not CronSchedule.objects.exists()


def test_a_runtime_schedule_needs_a_registered_function(tmp_path, monkeypatch, engine):
    source = "def plain(occurrence):\n    pass\n"
    (tmp_path / "registry_plain_probe.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ScheduleError, match=r"unknown schedule function.*@durable\.handler"):
        schedules.create("plain", "registry_plain_probe.plain", every=timedelta(seconds=1))


# -- discovery ------------------------------------------------------------------------


def _write(tmp_path, monkeypatch, name, source):
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_discovery_imports_app_modules_settings_imports_and_cron_functions(
    tmp_path, monkeypatch, settings
):
    _write(
        tmp_path,
        monkeypatch,
        "registry_extra_probe",
        "import durable\n\n@durable.handler\ndef job():\n    pass\n\ndef tick(occurrence):\n"
        "    pass\n",
    )
    settings.DURABLE = {
        **settings.DURABLE,
        "IMPORTS": ["registry_extra_probe"],
        "CRONS": {"extra": {"task": "registry_extra_probe.tick", "every": 60}},
    }
    assert handlers.get("registry_extra_probe.job") is None
    imported = discover()
    assert "testproject.demo.handlers" in imported
    assert "testproject.demo.workflows" in imported and "testproject.demo.crons" in imported
    assert imported[-1] == "registry_extra_probe"
    assert handlers.get("registry_extra_probe.job") is not None
    assert functions.get("registry_extra_probe.tick") is not None


def test_discovery_refuses_a_missing_import(settings):
    settings.DURABLE = {**settings.DURABLE, "IMPORTS": ["registry_no_such_module"]}
    with pytest.raises(ImproperlyConfigured, match=r"DURABLE\['IMPORTS'\]\[\d\]: cannot import"):
        discover()
    settings.DURABLE = {**settings.DURABLE, "IMPORTS": "testproject.demo.probes"}
    with pytest.raises(ImproperlyConfigured, match=r"DURABLE\['IMPORTS'\]"):
        discover()


def test_check_reports_bad_imports(settings):
    settings.DURABLE = {**settings.DURABLE, "IMPORTS": ["testproject.demo.probes"]}
    assert check_imports() == []
    settings.DURABLE = {**settings.DURABLE, "IMPORTS": ["registry_no_such.module", "x.y"]}
    errors = check_imports()
    assert [e.id for e in errors] == ["durable.E007", "durable.E007"]
    assert "no module named 'registry_no_such.module'" in errors[0].msg
    # Its type is a settings rule's (E003), as for every key.
    settings.DURABLE = {**settings.DURABLE, "IMPORTS": "myapp.services"}
    assert check_imports() == []
    [error] = check_settings()
    assert error.id == "durable.E003" and "IMPORTS" in error.msg
