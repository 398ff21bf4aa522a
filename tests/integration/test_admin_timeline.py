"""A run's timeline in the admin (``durable.admin.timeline``), on SQLite and PostgreSQL.

Rendering tests build runs with chosen times (rows written directly, then their
timestamps set), so each bar's position can be checked against the times: the axis
goes from the run's creation to its end, and a bar's ``left``/``width`` are percentages
of it. One test runs a real workflow in the in-process worker on a manual clock and
checks the step times the checkpoints record (migration 0013). The screenshot is
``tests/acceptance/test_admin_browser.py``'s.
"""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.auth.models import Permission, User
from django.urls import reverse

import durable
from durable.admin import timeline
from durable.models import WorkflowRun, WorkflowSignal, WorkflowStep
from testproject.demo.models import Order
from tests.integration import workflow_support as support

T0 = datetime(2030, 3, 17, 12, 0, tzinfo=UTC)  # before the manual clock's start (START_MS)
SECOND = timedelta(seconds=1)
CLOCKS: list = []  # the test's manual clock, for steps that "take time"
driver = support.driver  # fixture (clock: tests/integration/conftest.py)


@pytest.fixture
def admin_client(client, db):
    """A superuser's client, logged in without a password (hashing one costs a second)."""
    client.force_login(User.objects.create_superuser("admin", "admin@example.com", None))
    return client


def make_run(
    pk: str, state: str = "completed", seconds: float | None = 100, **fields
) -> WorkflowRun:
    """A run created at T0 that finished ``seconds`` later (None: still active)."""
    WorkflowRun.objects.create(id=pk, name="shop.workflows.fulfil", shard=0, state=state, **fields)
    finished = None if seconds is None else T0 + seconds * SECOND
    WorkflowRun.objects.filter(pk=pk).update(
        created_at=T0, updated_at=finished or T0, finished_at=finished
    )
    return WorkflowRun.objects.get(pk=pk)


def add_step(run, seq, kind, name, *, created, updated=None, started=None, took=None, **fields):
    """A recorded call with its times given in seconds after T0."""
    WorkflowStep.objects.create(
        run=run, seq=seq, kind=kind, name=name, status=fields.pop("status", "done"),
        started_at=None if started is None else T0 + started * SECOND,
        duration_ms=None if took is None else int(took * 1000), **fields,
    )  # fmt: skip
    WorkflowStep.objects.filter(run=run, seq=seq).update(
        created_at=T0 + created * SECOND,
        updated_at=T0 + (created if updated is None else updated) * SECOND,
    )


def add_signal(run, name, *, sent, consumed=None, seq=None, payload=None):
    signal = WorkflowSignal.objects.create(run=run, name=name, payload=payload, consumed_seq=seq)
    WorkflowSignal.objects.filter(pk=signal.pk).update(
        created_at=T0 + sent * SECOND,
        consumed_at=None if consumed is None else T0 + consumed * SECOND,
    )


def page(client, run) -> str:
    response = client.get(reverse("admin:durable_workflowrun_change", args=[run.pk]))
    assert response.status_code == 200
    return response.content.decode()


def rows(html: str) -> dict[str, str]:
    """Each drawn row's label → its track's HTML."""
    found = re.findall(
        r'<div class="dt-label"><span class="dt-kind">(.*?)</span>.*?'
        r'<div class="dt-track">(.*?)</div>',
        html,
        re.S,
    )
    return {label: track for label, track in found}


def spans(track: str, css: str) -> list[tuple[float, float]]:
    """(left, width) of the track's bars of class ``dt-<css>``."""
    pattern = rf'class="dt-bar dt-{css}" style="left: ([\d.]+)%; width: ([\d.]+)%"'
    return [(float(a), float(b)) for a, b in re.findall(pattern, track)]


def marks(track: str, css: str) -> list[float]:
    return [
        float(a) for a in re.findall(rf'class="dt-mark dt-{css}" style="left: ([\d.]+)%"', track)
    ]


@pytest.mark.django_db
def test_bars_are_placed_in_proportion_to_the_recorded_times(admin_client, settings):
    settings.TIME_ZONE = "Asia/Kolkata"  # UTC+05:30: times are shown in local time
    run = make_run("r-scale")
    add_step(run, 0, "step", "shop.charge", created=30, started=10, took=20, attempts=1)
    add_step(run, 1, "now", "now", created=30)  # a value call: not drawn
    add_step(run, 2, "sleep", "sleep", created=30, updated=81, wake_ms=_ms(80))
    add_step(run, 3, "signal", "shipped", created=81, updated=90, wake_ms=_ms(200))
    add_step(run, 4, "atomic", "shop.mark_done", created=95, started=95, took=5, attempts=1)
    add_signal(run, "shipped", sent=85, consumed=90, seq=3)

    html = page(admin_client, run)
    drawn = rows(html)
    assert spans(drawn["run"], "run-completed") == [(0.0, 100.0)]
    assert spans(drawn["#0 step"], "step") == [(10.0, 20.0)]
    assert "#1 now" not in drawn and "1 value calls (now, random, uuid4, patched)" in html
    assert spans(drawn["#2 sleep"], "sleep") == [(30.0, 50.0)]
    assert marks(drawn["#2 sleep"], "wake") == [81.0]
    assert spans(drawn["#3 signal"], "wait") == [(81.0, 9.0)]
    assert marks(drawn["#3 signal"], "consumed") == [90.0]
    assert spans(drawn["#4 atomic"], "atomic") == [(95.0, 5.0)]
    assert spans(drawn["signal"], "pending") == [(85.0, 5.0)]
    assert marks(drawn["signal"], "sent") == [85.0]
    # Human times: local time zone, relative offsets and durations in words.
    assert "2030-03-17 17:30:00 → 2030-03-17 17:31:40 (1 min 40 s), times in Asia/Kolkata" in html
    assert "+10 s · 20 s" in html and "+30 s · 51 s" in html
    assert str(_ms(0)) not in html  # never epoch milliseconds


@pytest.mark.django_db
def test_a_failed_step_with_retries_shows_each_kept_attempt_and_the_backoff(admin_client):
    run = make_run("r-fail", state="failed", seconds=10, error="StepFailed")
    # Attempt 1 ran 0-1 s, attempt 2 is not kept, attempt 3 ran 8-10 s and failed for good.
    add_step(run, 0, "step", "shop.charge", created=1, updated=10, started=0, took=2,
             status="failed", attempts=3, error="ConnectionError: card <declined>")  # fmt: skip
    drawn = rows(page(admin_client, run))
    track = drawn["#0 step"]
    assert spans(track, "failed") == [(0.0, 10.0), (80.0, 20.0)]
    assert spans(track, "backoff") == [(10.0, 70.0)]
    assert marks(track, "wake") == [80.0]
    assert spans(drawn["run"], "run-failed") == [(0.0, 100.0)]
    assert "attempt 3: started" in track and "failed for good" in track
    assert "attempts 2-2 failed" in track


@pytest.mark.django_db
def test_a_retry_due_and_a_wait_still_open_are_drawn_up_to_now(admin_client, clock):
    run = make_run("r-open", state="waiting", seconds=None)
    add_step(run, 0, "step", "shop.charge", created=5, started=0, took=5, status="retrying",
             attempts=1, wake_ms=_ms(7))  # fmt: skip
    add_step(run, 1, "signal", "shipped", created=10, status="waiting", wake_ms=_ms(99_000))
    now_ms = clock.now_ms()
    end = (now_ms - _ms(0)) / 1000
    drawn = rows(page(admin_client, run))
    assert spans(drawn["#0 step"], "failed") == [(0.0, pytest.approx(500 / end, abs=0.001))]
    assert marks(drawn["#0 step"], "due") == [pytest.approx(700 / end, abs=0.001)]
    left, width = spans(drawn["#1 signal"], "wait")[0]
    assert left == pytest.approx(1000 / end, abs=0.001)
    assert left + width == pytest.approx(100.0, abs=0.002)
    assert marks(drawn["#1 signal"], "due") == [100.0]  # a future deadline, clipped


@pytest.mark.django_db
def test_names_and_errors_are_escaped(admin_client):
    run = make_run("r-<b>x</b>")
    evil = '<script>alert("step")</script>'
    add_step(
        run,
        0,
        "step",
        evil,
        created=2,
        started=1,
        took=1,
        attempts=1,
        error="<img src=x onerror=alert(1)>",
    )
    add_step(run, 1, "signal", '"><svg onload=alert(2)>', created=3, updated=4)
    add_signal(run, '"><svg onload=alert(2)>', sent=3, consumed=4, seq=1, payload={"<i>": "</div>"})
    html = page(admin_client, run)
    for raw in ("<script>alert", "<img src=x", "<svg onload", "<b>x</b>", '</div>"}'):
        assert raw not in html
    assert "&lt;script&gt;alert(&quot;step&quot;)&lt;/script&gt;" in html
    assert "&quot;&gt;&lt;svg onload=alert(2)&gt;" in html


@pytest.mark.django_db
def test_a_run_with_no_steps_shows_its_own_bar_and_says_so(admin_client, clock):
    run = make_run("r-empty", state="pending", seconds=None)
    html = page(admin_client, run)
    assert spans(rows(html)["run"], "run-pending") == [(0.0, 100.0)]
    assert "No calls recorded yet." in html


@pytest.mark.django_db
def test_ten_thousand_steps_are_drawn_as_at_most_max_rows_groups(
    admin_client, django_assert_max_num_queries
):
    run = make_run("r-big", seconds=10_000)
    WorkflowStep.objects.bulk_create(
        WorkflowStep(run=run, seq=n, kind="step", name="app.work", status="done",
                     attempts=2 if n == 4321 else 1, started_at=T0 + n * SECOND, duration_ms=500)
        for n in range(10_000)
    )  # fmt: skip
    WorkflowStep.objects.filter(run=run).update(created_at=T0, updated_at=T0)
    started = time.perf_counter()
    with django_assert_max_num_queries(20):
        html = page(admin_client, run)
    took = time.perf_counter() - started
    drawn = rows(html)
    assert len(drawn) == timeline.MAX_ROWS + 1  # the run's row and 200 groups of 50
    assert "#0-#49" in drawn and "#9950-#9999" in drawn
    assert spans(drawn["#4300-#4349"], "retried")  # its worst status shows
    assert spans(drawn["#0-#49"], "step") == [(0.0, 0.495)]
    assert "10,000 calls drawn as 200 groups of 50" in html
    print(f"\nrun page with 10,000 steps: {took * 1000:.0f} ms")


@pytest.mark.django_db
def test_the_bound_objects_page_shows_its_runs_to_those_who_may_view_runs(client, admin_client):
    order = Order.objects.create(customer="<ada>", total_cents=100)
    for n in range(4):
        make_run(f"order-{n}", model_label=order._meta.label_lower, object_pk=str(order.pk))
    make_run("other", model_label=order._meta.label_lower, object_pk="999")
    url = reverse("admin:demo_order_change", args=[order.pk])

    html = admin_client.get(url).content.decode()
    assert html.count('class="durable-timeline"') == 3  # OrderAdmin.timeline_runs
    assert 'id="timeline-order-3"' in html and 'id="timeline-other"' not in html
    assert "The latest 3 of 4 runs are drawn." in html
    assert f'<a href="{reverse("admin:durable_workflowrun_change", args=["order-3"])}">' in html

    staff = User.objects.create_user("clerk", is_staff=True)
    staff.user_permissions.add(Permission.objects.get(codename="view_order"))
    client.force_login(staff)
    assert "durable-timeline" not in client.get(url).content.decode()
    assert (
        client.get(reverse("admin:durable_workflowrun_change", args=["order-0"])).status_code == 403
    )
    staff.user_permissions.add(Permission.objects.get(codename="view_workflowrun"))
    staff = User.objects.get(pk=staff.pk)  # permissions are cached on the instance
    client.force_login(staff)
    assert client.get(url).content.decode().count('class="durable-timeline"') == 3


@durable.workflow(max_attempts=3)
def timed(ctx):
    ctx.step(takes, 2_000)
    ctx.step(fails_once, 500, 300)
    ctx.atomic(takes, 1_000)
    return "done"


def takes(ms: int) -> int:
    CLOCKS[0].advance(ms)
    return ms


def fails_once(first_ms: int, then_ms: int) -> str:
    if not WorkflowStep.objects.filter(name__endswith="fails_once").exists():
        CLOCKS[0].advance(first_ms)
        raise ConnectionError("first attempt fails")
    CLOCKS[0].advance(then_ms)
    return "ok"


@pytest.mark.django_db(transaction=True)
def test_checkpoints_record_each_steps_start_and_duration(clock, driver):
    CLOCKS[:] = [clock]
    run = timed.start()
    driver.settle(run, "completed")
    slow, flaky, atomic = WorkflowStep.objects.filter(run_id=run.pk).order_by("seq")
    assert slow.duration_ms == 2_000
    # A retried step keeps its first attempt's start (right after the slow step's end);
    # its duration is the latest attempt's.
    assert _gap(slow.started_at, flaky.started_at) == 2_000
    assert (flaky.attempts, flaky.duration_ms) == (2, 300)
    # Attempt 1 (500 ms), a backoff of at least half a second, attempt 2 (300 ms).
    assert _gap(flaky.started_at, atomic.started_at) >= 500 + 500 + 300
    assert atomic.duration_ms == 1_000
    # created_at/updated_at are not compared: on SQLite they are the wall clock's (the
    # ORM's auto_now_add overrides the checkpoint's time in bulk_create).


def _gap(a: datetime, b: datetime) -> int:
    return round((b - a).total_seconds() * 1000)


def _ms(seconds: float) -> int:
    return int((T0 + seconds * SECOND).timestamp() * 1000)


@pytest.mark.parametrize(
    ("ms", "words"),
    [(0, "0 ms"), (850, "850 ms"), (2_000, "2 s"), (2_540, "2.5 s"), (184_000, "3 min 4 s"),
     (120_000, "2 min"), (7_500_000, "2 h 5 min"), (3_600_000, "1 h"),
     (14 * 86_400_000 + 7_200_000, "14 d 2 h")],
)  # fmt: skip
def test_durations_read_as_words(ms, words):
    assert timeline.human_duration(ms) == words
