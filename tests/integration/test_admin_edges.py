"""The admin with unusual input and unusual rows (issue 18).

- searches for terms that look like numbers to ``str.isdigit()`` but are not ("²");
- instants a bigint column holds but a ``datetime`` cannot (past 9999-12-31, before
  year 1), written with raw SQL as old rows or hand edits would be: every page and
  action still answers, and shows the raw value;
- strict JSON in the signal form (no NaN / Infinity);
- counted messages in the singular and the plural;
- cron occurrences, which never retry, show no attempt count;
- schedule times to the second.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.urls import reverse

import durable
from durable.admin import base
from durable.models import CronSchedule, ShardLease, Timer, WorkflowSignal, WorkflowStep
from testproject.demo import probes
from testproject.demo.workflows import onboarding

from .test_admin import HOUR, act, changelist, later, said

pytestmark = pytest.mark.django_db

#: 10000-01-01T00:00:00Z in epoch ms: the first instant past datetime's range.
YEAR_10000_MS = 253_402_300_800_000
BIGINT_MAX = 2**63 - 1


@pytest.fixture
def admin_client(client, db):
    """A superuser's client (as in test_admin.py)."""
    client.force_login(User.objects.create_superuser("admin", "admin@example.com", None))
    return client


def raw_update(table: str, column: str, value: int, pk_column: str, pk: object) -> None:
    """Write ``value`` with plain SQL, as an old row or a hand edit would hold it."""
    q = connection.ops.quote_name
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {q(table)} SET {q(column)} = %s WHERE {q(pk_column)} = %s", [value, pk]
        )


# -- searches ---------------------------------------------------------------------------


@pytest.mark.parametrize("term", ["²", "12²", "99999999999999999999999"])
def test_timer_search_copes_with_digits_int_refuses_or_misreads(admin_client, clock, term):
    keyed = durable.schedule(probes.record, args=["k"], delay=HOUR, key=term)
    response = admin_client.get(changelist("timer"), {"q": term})
    assert response.status_code == 200
    # Searched as a key (prefix): "١٢" is not timer 12, "²" not timer 2.
    assert [t.pk for t in response.context["cl"].result_list] == [keyed.pk]


def test_timer_search_does_not_read_other_scripts_digits_as_an_id(admin_client, clock):
    timer = later()[0]
    arabic_indic = str(timer.pk).translate(str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩"))
    response = admin_client.get(changelist("timer"), {"q": arabic_indic})
    assert response.status_code == 200
    assert list(response.context["cl"].result_list) == []  # a key prefix, not the id


def test_timer_search_by_id_still_works(admin_client, clock):
    _first, second = later(2)
    response = admin_client.get(changelist("timer"), {"q": f" {second.pk} "})
    assert [t.pk for t in response.context["cl"].result_list] == [second.pk]


@pytest.mark.parametrize("term", ["²", "99999999999999999999999", "x" * 150])
def test_other_searches_cope_with_odd_terms(admin_client, clock, term):
    later()
    onboarding.start("ada@example.com")
    for model in ("workflowrun", "workflowstep", "workflowsignal", "cronschedule"):
        assert admin_client.get(changelist(model), {"q": term}).status_code == 200, model
    for model in ("shardlease", "workernode"):
        assert admin_client.get(changelist(model), {"q": term}).status_code == 200, model


# -- instants past datetime's range -----------------------------------------------------


@pytest.mark.parametrize("fire_at_ms", [YEAR_10000_MS, BIGINT_MAX, -(2**62)])
def test_timer_pages_and_cancel_cope_with_an_instant_past_datetime(admin_client, clock, fire_at_ms):
    timer = later()[0]
    raw_update("durable_timer", "fire_at_ms", fire_at_ms, "id", timer.pk)
    side = "beyond 9999-12-31" if fire_at_ms > 0 else "before 0001-01-01"
    shown = f"{side} ({fire_at_ms} ms since epoch)"
    pages = [
        {},
        {"state__exact": "pending"},
        {"due": "later"},
        {"due": "overdue"},
        {"q": str(timer.pk)},
        {"state__exact": "pending", "o": "5"},
    ]
    for params in pages:
        response = admin_client.get(changelist("timer"), params)
        assert response.status_code == 200, params
    page = admin_client.get(changelist("timer"), {"state__exact": "pending"}).content.decode()
    assert shown in page
    detail = admin_client.get(reverse("admin:durable_timer_change", args=[timer.pk]))
    assert detail.status_code == 200 and shown in detail.content.decode()
    response = act(admin_client, "timer", "cancel_timers", [timer.pk])
    assert response.status_code == 200 and "Cancelled 1 timer." in said(response)
    assert Timer.objects.get(pk=timer.pk).state == "canceled"
    assert shown in response.content.decode()  # the list it lands on shows the row


def test_moving_a_timer_with_an_instant_past_datetime_works(admin_client, clock):
    timer = later()[0]
    raw_update("durable_timer", "fire_at_ms", YEAR_10000_MS, "id", timer.pk)
    for action in ("retry_failed", "fire_now"):
        assert act(admin_client, "timer", action, [timer.pk]).status_code == 200, action
    assert Timer.objects.get(pk=timer.pk).state == "canceled"  # replaced: due now
    other = later()[0]
    raw_update("durable_timer", "fire_at_ms", -(2**62), "id", other.pk)
    form = act(admin_client, "timer", "reschedule", [other.pk])
    assert form.status_code == 200 and 'name="delay"' in form.content.decode()
    moved = act(admin_client, "timer", "reschedule", [other.pk], apply="1", delay="00:05:00")
    assert "Rescheduled 1 timer." in said(moved)


def test_run_schedule_lease_and_overview_pages_cope_with_instants_past_datetime(
    admin_client, clock
):
    run = onboarding.start("ada@example.com")
    WorkflowStep.objects.create(run=run, seq=9, kind="sleep", name="nap", status="waiting")
    raw_update("durable_workflowstep", "wake_ms", YEAR_10000_MS, "run_id", run.pk)
    durable.schedules.create("digest", "testproject.demo.crons.record", every=HOUR)
    schedule = CronSchedule.objects.get()
    raw_update("durable_cronschedule", "next_ms", YEAR_10000_MS, "id", schedule.pk)
    ShardLease.objects.create(shard=0, owner="w1", token=3)
    raw_update("durable_shardlease", "cursor_ms", YEAR_10000_MS, "shard", 0)
    failed = later()[0]
    Timer.objects.filter(pk=failed.pk).update(state="failed", fire_at_ms=-(2**62))
    shown = f"beyond 9999-12-31 ({YEAR_10000_MS} ms since epoch)"
    urls = {
        reverse("admin:durable_workflowrun_change", args=[run.pk]): True,
        changelist("workflowstep"): False,
        changelist("cronschedule"): True,
        reverse("admin:durable_cronschedule_change", args=[schedule.pk]): True,
        changelist("shardlease"): True,
        reverse("admin:durable_shardlease_change", args=[0]): False,
        reverse("admin:durable_overview"): False,
    }
    for url, shows in urls.items():
        response = admin_client.get(url)
        assert response.status_code == 200, url
        assert not shows or shown in response.content.decode(), url
    data = {"action": "delete_selected", "_selected_action": [schedule.pk], "post": "yes"}
    admin_client.post(changelist("cronschedule"), data)
    assert not CronSchedule.objects.exists()


# -- the signal form --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        ("NaN", "NaN is not a JSON value"),
        ('{"x": Infinity}', "Infinity is not a JSON value"),
        ("[-Infinity]", "-Infinity is not a JSON value"),
        ('{"x": 1e999}', "1e999 is too large for a JSON number"),
    ],
)
def test_signal_form_refuses_what_strict_json_does_not_allow(admin_client, clock, payload, error):
    run = onboarding.start("ada@example.com")
    response = act(
        admin_client, "workflowrun", "send_signal", [run.pk], apply="1", name="go", payload=payload
    )
    assert error in response.content.decode()
    assert "errorlist" in response.content.decode()
    assert not WorkflowSignal.objects.exists()


def test_signal_form_still_takes_plain_json_numbers(admin_client, clock):
    run = onboarding.start("ada@example.com")
    act(admin_client, "workflowrun", "send_signal", [run.pk], apply="1", name="go", payload="1.5e3")
    assert WorkflowSignal.objects.get().payload == 1500.0


# -- messages ---------------------------------------------------------------------------


def test_messages_use_the_singular_and_the_plural(admin_client, clock):
    one, two, three = later(3)
    assert "Cancelled 1 timer." in said(act(admin_client, "timer", "cancel_timers", [one.pk]))
    both = said(act(admin_client, "timer", "fire_now", [two.pk, three.pk]))
    assert "Made due now 2 timers." in both and "New timer ids: " in both
    new = Timer.objects.filter(state="pending").order_by("pk").first()
    single = said(act(admin_client, "timer", "fire_now", [new.pk]))
    assert "Made due now 1 timer." in single and "New timer id: " in single
    runs = [onboarding.start(f"{n}@example.com") for n in "ab"]
    cancelled = said(act(admin_client, "workflowrun", "cancel_runs", [r.pk for r in runs]))
    assert "Cancelled 2 workflow runs." in cancelled
    durable.schedules.create("digest", "testproject.demo.crons.record", every=HOUR)
    pk = CronSchedule.objects.get().pk
    assert "Paused 1 cron schedule." in said(act(admin_client, "cronschedule", "pause", [pk]))
    queued = said(act(admin_client, "cronschedule", "run_now", [pk]))
    assert "A worker runs it shortly" in queued


# -- attempts of kinds that never retry -------------------------------------------------


def test_cron_occurrences_show_no_attempt_count(admin_client, clock):
    durable.schedules.create("digest", "testproject.demo.crons.record", every=HOUR)
    occurrence = Timer.objects.get(kind="cron")
    plain = later()[0]
    response = admin_client.get(changelist("timer"))
    shown = {
        t.pk: response.context["cl"].model_admin.attempts_of(t)
        for t in response.context["cl"].result_list
    }
    assert shown[occurrence.pk] == "—"
    assert shown[plain.pk] == f"0/{plain.max_attempts}"
    assert f"0/{occurrence.max_attempts}" not in response.content.decode()
    page = admin_client.get(reverse("admin:durable_timer_change", args=[occurrence.pk]))
    assert "fires once" in page.content.decode()


# -- schedule times to the second -------------------------------------------------------


def test_schedule_times_show_seconds(admin_client, clock):
    durable.schedules.create("tick", "testproject.demo.crons.record", every=timedelta(seconds=7))
    row = CronSchedule.objects.get()
    next_text = base.ms_display(row.next_ms)
    assert next_text.count(":") == 2  # hours, minutes and seconds
    CronSchedule.objects.filter(pk=row.pk).update(last_run_at=row.next_at)
    listing = admin_client.get(changelist("cronschedule")).content.decode()
    assert next_text in listing
    assert row.next_at.strftime("%Y-%m-%d %H:%M:%S") in listing  # last run, to the second
    page = admin_client.get(reverse("admin:durable_cronschedule_change", args=[row.pk]))
    body = page.content.decode()
    assert next_text in body and row.next_at.strftime("%Y-%m-%d %H:%M:%S") in body
