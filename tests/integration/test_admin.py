"""The Django admin of durable: pages render, actions use the public API, rows stay read-only.

Runs on SQLite and PostgreSQL with small data; ``test_admin_scale.py`` checks the query
plans with a million timers. Timers are scheduled with ``durable.schedule`` and moved by
the admin's actions; a worker ``Engine`` on a manual clock fires what the actions queue.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.auth.models import Permission, User
from django.contrib.messages import get_messages
from django.urls import reverse

import durable
from durable.admin import base
from durable.admin.paginator import EstimatedCountPaginator
from durable.core.timeutil import datetime_to_ms, ms_to_datetime
from durable.models import (
    CronSchedule,
    ShardLease,
    Timer,
    WorkerNode,
    WorkflowRun,
    WorkflowSignal,
    WorkflowStep,
)
from durable.worker.engine import Engine
from testproject.demo import probes
from testproject.demo.models import FireRecord
from testproject.demo.workflows import onboarding

pytestmark = pytest.mark.django_db
START_MS = 1_900_000_000_000
HOUR = timedelta(hours=1)


@pytest.fixture
def admin_client(client, db):
    """A superuser's client, logged in without a password (hashing one costs a second)."""
    client.force_login(User.objects.create_superuser("admin", "admin@example.com", None))
    return client


def changelist(model: str) -> str:
    return reverse(f"admin:durable_{model}_changelist")


def act(client, model: str, action: str, ids, **extra):
    """POST an action of ``model``'s changelist on ``ids``; follow the redirect."""
    data = {"action": action, "_selected_action": [str(i) for i in ids], "index": 0, **extra}
    return client.post(changelist(model), data, follow=True)


def said(response) -> str:
    return " | ".join(str(m) for m in get_messages(response.wsgi_request))


def later(n: int = 1, **kw) -> list[Timer]:
    return [durable.schedule(probes.record, args=[f"t{i}"], delay=HOUR, **kw) for i in range(n)]


def clock_dt() -> datetime:
    return ms_to_datetime(START_MS)


def staff(*codenames: str) -> User:
    user = User.objects.create_user("viewer", password="pw", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(codename__in=codenames))
    return user


# -- pages ------------------------------------------------------------------------------


def test_every_page_renders(admin_client, clock):
    timer = later()[0]
    run = onboarding.start("ada@example.com")
    durable.schedules.create("digest", "testproject.demo.crons.record", every=HOUR)
    ShardLease.objects.create(shard=0, owner="w1", token=3, cursor_ms=START_MS - 500)
    WorkerNode.objects.create(
        name="w1", host="h", pid=1, started_at=clock_dt(), heartbeat_at=clock_dt()
    )
    for model in ("timer", "cronschedule", "workflowrun", "workflowstep", "workflowsignal"):
        assert admin_client.get(changelist(model)).status_code == 200, model
    for model in ("shardlease", "workernode"):
        assert admin_client.get(changelist(model)).status_code == 200, model
    pages = [
        reverse("admin:durable_timer_change", args=[timer.pk]),
        reverse("admin:durable_workflowrun_change", args=[run.pk]),
        reverse("admin:durable_cronschedule_change", args=[CronSchedule.objects.get().pk]),
        reverse("admin:durable_shardlease_change", args=[0]),
        reverse("admin:app_list", args=["durable"]),
    ]
    for url in pages:
        response = admin_client.get(url)
        assert response.status_code == 200, url
    assert reverse("admin:durable_overview") in response.content.decode()  # the app index


def test_change_pages_are_view_only(admin_client, clock):
    timer = later()[0]
    url = reverse("admin:durable_timer_change", args=[timer.pk])
    page = admin_client.get(url).content.decode()
    assert 'name="_save"' not in page
    assert admin_client.post(url, {"state": "fired"}).status_code == 403
    timer.refresh_from_db()
    assert timer.state == "pending"
    assert admin_client.get(reverse("admin:durable_timer_add")).status_code == 403


# -- timer actions ----------------------------------------------------------------------


def test_cancel_action_uses_durable_cancel(admin_client, clock):
    parent, other = later(2)
    child = durable.schedule(probes.record, args=["c"], delay=HOUR, parent=parent)
    fired = later()[0]
    Timer.objects.filter(pk=fired.pk).update(state="fired")
    response = act(admin_client, "timer", "cancel_timers", [parent.pk, fired.pk])
    assert "Cancelled 1 timer." in said(response)
    assert f"left unchanged (not pending): {fired.pk}" in said(response)
    states = dict(Timer.objects.values_list("pk", "state"))
    assert states[parent.pk] == states[child.pk] == "canceled"  # the cascade of the API
    assert states[other.pk] == "pending" and states[fired.pk] == "fired"


def test_fire_now_replaces_the_timer_keeping_key_children_and_handler(admin_client, clock):
    parent = durable.schedule(probes.record, args=["p"], delay=HOUR, key="invoice:7")
    child = durable.schedule(probes.record, args=["c"], delay=HOUR, parent=parent)
    response = act(admin_client, "timer", "fire_now", [parent.pk])
    assert "Made due now 1 timer." in said(response)
    old = Timer.objects.get(pk=parent.pk)
    new = Timer.objects.get(key="invoice:7")
    assert old.state == "canceled" and old.key is None
    assert old.result == {"replaced_by": new.pk}
    assert (new.state, new.fire_at_ms, new.target, new.args) == (
        "pending",
        START_MS,
        parent.target,
        ["p"],
    )
    assert Timer.objects.get(pk=child.pk).parent_id == new.pk
    detail = admin_client.get(reverse("admin:durable_timer_change", args=[old.pk]))
    assert f"timer {new.pk}" in detail.content.decode()


def test_reschedule_asks_for_a_time_then_moves_the_timer(admin_client, clock):
    timer = later()[0]
    form = act(admin_client, "timer", "reschedule", [timer.pk])
    assert form.templates[0].name == "admin/durable/action_form.html"
    assert 'name="delay"' in form.content.decode()
    both = act(admin_client, "timer", "reschedule", [timer.pk], apply="1")
    assert "either a date and time or a delay" in both.content.decode()
    done = act(admin_client, "timer", "reschedule", [timer.pk], apply="1", delay="02:00:00")
    assert "Rescheduled 1 timer." in said(done)
    new = Timer.objects.get(state="pending")
    assert new.fire_at_ms == START_MS + 2 * 3_600_000
    at = act(
        admin_client,
        "timer",
        "reschedule",
        [new.pk],
        apply="1",
        at_0="2030-04-01",
        at_1="12:00:00",
    )
    assert "Rescheduled 1 timer." in said(at)
    expected = datetime_to_ms(datetime(2030, 4, 1, 12, tzinfo=UTC))  # the site's zone is UTC
    assert Timer.objects.get(state="pending").fire_at_ms == expected


def test_retry_gives_a_failed_timer_a_fresh_set_of_attempts(admin_client, clock):
    timer = later()[0]
    Timer.objects.filter(pk=timer.pk).update(state="failed", attempts=5, last_error="boom")
    act(admin_client, "timer", "retry_failed", [timer.pk])
    new = Timer.objects.get(state="pending")
    assert (new.attempts, new.fire_at_ms, new.last_error) == (0, START_MS, "boom")
    assert Timer.objects.get(pk=timer.pk).state == "canceled"


def test_cron_occurrence_timers_cannot_be_moved(admin_client, clock):
    durable.schedules.create("digest", "testproject.demo.crons.record", every=HOUR)
    occurrence = Timer.objects.get(kind="cron")
    response = act(admin_client, "timer", "fire_now", [occurrence.pk])
    assert "run its schedule now instead" in said(response)
    assert Timer.objects.get(pk=occurrence.pk).state == "pending"


def test_actions_refuse_huge_selections(admin_client, clock, monkeypatch):
    monkeypatch.setattr(base, "MAX_ACTION_ROWS", 2)
    timers = later(3)
    data = {"action": "cancel_timers", "select_across": "1", "index": 0}
    data["_selected_action"] = [str(timers[0].pk)]
    response = admin_client.post(changelist("timer"), data, follow=True)
    assert "Select at most 2 rows" in said(response)
    assert not Timer.objects.exclude(state="pending").exists()


# -- permissions ------------------------------------------------------------------------


def test_staff_without_change_permission_sees_no_actions_and_cannot_run_them(client, clock):
    timer = later()[0]
    client.force_login(staff("view_timer", "view_workflowrun", "view_cronschedule"))
    for model in ("timer", "workflowrun", "cronschedule"):
        page = client.get(changelist(model))
        assert page.status_code == 200
        assert 'name="action"' not in page.content.decode(), model
    act(client, "timer", "cancel_timers", [timer.pk])
    assert Timer.objects.get(pk=timer.pk).state == "pending"
    assert client.get(reverse("admin:durable_overview")).status_code == 403


def test_staff_with_change_permission_gets_the_actions(client, clock):
    later()
    client.force_login(staff("view_timer", "change_timer"))
    page = client.get(changelist("timer")).content.decode()
    for action in ("cancel_timers", "fire_now", "reschedule", "retry_failed"):
        assert f'value="{action}"' in page


# -- finding timers ---------------------------------------------------------------------


def test_search_by_id_key_prefix_and_target(admin_client, clock):
    plain = later()[0]
    keyed = durable.schedule(probes.record, args=["k"], delay=HOUR, key="invoice:42")
    other = durable.schedule(probes.fail_until, args=["f", 2], delay=HOUR)

    def found(q: str) -> set[int]:
        response = admin_client.get(changelist("timer"), {"q": q})
        return {t.pk for t in response.context["cl"].result_list}

    assert found(str(plain.pk)) == {plain.pk}
    assert found("invoice:") == {keyed.pk}
    assert found(f"target:{other.target}") == {other.pk}


def test_due_filter_and_fire_time_sorting_need_the_state_index(admin_client, clock):
    soon = durable.schedule(probes.record, args=["s"], delay=timedelta(minutes=5))
    late = durable.schedule(probes.record, args=["l"], delay=timedelta(days=3))
    clock.advance(timedelta(minutes=10))
    overdue = admin_client.get(changelist("timer"), {"due": "overdue"}).context["cl"]
    assert [t.pk for t in overdue.result_list] == [soon.pk]
    fire_col = str(list(overdue.list_display).index("fire_at"))
    by_time = admin_client.get(changelist("timer"), {"state__exact": "pending", "o": fire_col})
    assert [t.pk for t in by_time.context["cl"].result_list] == [soon.pk, late.pk]
    # Unfiltered, a hand-written ?o= on fire time is ignored: newest first.
    ignored = admin_client.get(changelist("timer"), {"o": fire_col}).context["cl"]
    assert [t.pk for t in ignored.result_list] == [late.pk, soon.pk]


def test_counts_are_capped_and_pages_limited(admin_client, clock, monkeypatch):
    monkeypatch.setattr(EstimatedCountPaginator, "count_limit", 4)
    later(7)
    response = admin_client.get(changelist("timer"), {"state__exact": "pending"})
    cl = response.context["cl"]
    assert cl.paginator.capped and cl.result_count == 5
    assert "more than 4 timers" in response.content.decode()
    assert admin_client.get(changelist("timer")).context["cl"].result_count in (5, 7)


# -- workflows --------------------------------------------------------------------------


def test_run_page_shows_the_latest_steps_and_links_to_all(admin_client, clock):
    run = onboarding.start("ada@example.com")
    WorkflowStep.objects.bulk_create(
        WorkflowStep(run=run, seq=i, kind="step", name=f"s{i}", status="done") for i in range(60)
    )
    page = admin_client.get(reverse("admin:durable_workflowrun_change", args=[run.pk]))
    formset = page.context["inline_admin_formsets"][0].formset
    assert [f.instance.seq for f in formset.forms][:2] == [59, 58]
    assert len(formset.forms) == 50
    body = page.content.decode()
    assert f"?run__id__exact={run.pk}" in body and "60 steps" in body
    steps = admin_client.get(changelist("workflowstep"), {"run__id__exact": run.pk})
    assert [s.seq for s in steps.context["cl"].result_list][:3] == [0, 1, 2]


def test_run_actions_cancel_retry_and_signal(admin_client, clock):
    active = onboarding.start("ada@example.com")
    failed = onboarding.start("bob@example.com")
    WorkflowRun.objects.filter(pk=failed.pk).update(state="failed", error="boom")
    signal = act(admin_client, "workflowrun", "send_signal", [active.pk])
    assert 'name="payload"' in signal.content.decode()
    sent = act(
        admin_client,
        "workflowrun",
        "send_signal",
        [active.pk],
        apply="1",
        name="first-order",
        payload='{"order": 42}',
    )
    assert "Sent 'first-order' to 1 workflow run." in said(sent)
    assert WorkflowSignal.objects.get(run=active).payload == {"order": 42}
    act(admin_client, "workflowrun", "retry_runs", [failed.pk, active.pk])
    assert WorkflowRun.objects.get(pk=failed.pk).state == "pending"
    act(admin_client, "workflowrun", "cancel_runs", [active.pk])
    assert WorkflowRun.objects.get(pk=active.pk).state == "canceled"


# -- schedules --------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_schedule_pause_resume_and_run_now_through_a_worker(admin_client, clock, settings):
    settings.DURABLE = {"SHARDS": 2, "RESCAN_INTERVAL_S": 1.0}
    durable.schedules.create("digest", "testproject.demo.crons.record", every=HOUR)
    pk = CronSchedule.objects.get().pk
    act(admin_client, "cronschedule", "pause", [pk])
    assert not CronSchedule.objects.get().enabled
    assert not Timer.objects.filter(kind="cron", state="pending").exists()
    act(admin_client, "cronschedule", "resume", [pk])
    row = CronSchedule.objects.get()
    assert row.enabled and Timer.objects.filter(kind="cron", state="pending").count() == 1
    response = act(admin_client, "cronschedule", "run_now", [pk])
    assert "Queued a run of 1 cron schedule." in said(response)
    assert "digest → timer" in said(response)
    engine = Engine(node="admin-node", clock=clock, threads=1)
    engine.start()
    try:
        clock.advance(1_000)
        engine.tick()
    finally:
        engine.executor.shutdown(wait=True)
    after = CronSchedule.objects.get()
    assert FireRecord.objects.filter(key__startswith="digest:").count() == 1
    assert (after.last_status, after.fired_count, after.next_ms) == ("succeeded", 1, row.next_ms)


def test_deleting_a_schedule_goes_through_the_api(admin_client, clock):
    durable.schedules.create("digest", "testproject.demo.crons.record", every=HOUR)
    pk = CronSchedule.objects.get().pk
    data = {"action": "delete_selected", "_selected_action": [pk], "post": "yes"}
    admin_client.post(changelist("cronschedule"), data)
    assert not CronSchedule.objects.exists()
    assert not Timer.objects.filter(kind="cron").exists()  # its occurrence went with it


# -- overview ---------------------------------------------------------------------------


def test_overview_shows_shards_workers_and_failures(admin_client, clock):
    ShardLease.objects.create(shard=0, owner="w1", token=3, cursor_ms=START_MS - 1500)
    ShardLease.objects.create(shard=1)
    from django.utils import timezone

    now = timezone.now()
    WorkerNode.objects.create(name="w1", host="h1", pid=42, started_at=now, heartbeat_at=now)
    failed = later()[0]
    Timer.objects.filter(pk=failed.pk).update(state="failed", last_error="handler exploded")
    run = onboarding.start("ada@example.com")
    WorkflowRun.objects.filter(pk=run.pk).update(state="failed", error="step broke")
    response = admin_client.get(reverse("admin:durable_overview"))
    assert response.status_code == 200
    body = response.content.decode()
    for text in ("w1", "(free)", "handler exploded", "step broke", run.pk, "failed timers"):
        assert text in body, text
    shards = {s["shard"]: s for s in response.context["shards"]}
    assert shards[0]["token"] == 3 and shards[1]["owner"] is None


def test_object_pages_offer_the_actions_as_buttons_and_come_back(admin_client, clock):
    run = onboarding.start("ada@example.com")
    url = reverse("admin:durable_workflowrun_change", args=[run.pk])
    page = admin_client.get(url).content.decode()
    assert 'value="cancel_runs"' in page and 'value="send_signal"' in page
    data = {"action": "cancel_runs", "_selected_action": run.pk, "index": 0}
    response = admin_client.post(changelist("workflowrun"), {**data, "_from_object": run.pk})
    assert response.status_code == 302 and response["Location"] == url
    assert WorkflowRun.objects.get(pk=run.pk).state == "canceled"


def test_view_only_users_get_no_buttons(client, clock):
    timer = later()[0]
    client.force_login(staff("view_timer"))
    page = client.get(reverse("admin:durable_timer_change", args=[timer.pk])).content.decode()
    assert "submit-row durable-actions" not in page


def test_actions_leave_an_entry_in_the_rows_history(admin_client, clock):
    from django.contrib.admin.models import LogEntry

    timer = later()[0]
    act(admin_client, "timer", "cancel_timers", [timer.pk])
    entry = LogEntry.objects.get(object_id=str(timer.pk))
    assert entry.user.username == "admin" and entry.change_message == "Cancelled (admin action)."
