"""``durable.schedule(..., key=..., debounce=..., max_wait=...)`` against a real database.

Runs on SQLite and PostgreSQL; the races between writers are in test_debounce_races.py.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.db import transaction
from django.urls import reverse

import durable
from durable.admin import base
from durable.exceptions import TimerError
from durable.models import Timer
from durable.scheduling.validation import MAX_INSTANT_MS
from durable.testing import ManualClock, override_clock
from testproject.demo import handlers as h

NOW = 1_700_000_000_000
S = 1_000
pytestmark = pytest.mark.django_db


@pytest.fixture
def clock():
    with override_clock(ManualClock(start_ms=NOW)) as manual:
        yield manual


def debounced(*args, key="doc:1", debounce=timedelta(seconds=5), **options):
    return durable.schedule(h.record, args=list(args), key=key, debounce=debounce, **options)


def holder(key="doc:1") -> Timer:
    return Timer.objects.get(key=key)


# -- the window moves ---------------------------------------------------------------------


def test_the_first_call_schedules_at_now_plus_debounce(clock):
    timer = debounced("a")
    assert (timer.fire_at_ms, timer.debounce_since_ms, timer.state) == (NOW + 5 * S, NOW, "pending")
    assert timer.args == ["a"] and holder().pk == timer.pk


def test_a_second_call_moves_the_timer_later_and_its_arguments_win(clock):
    first = debounced("a", context={"n": 1})
    clock.advance(3 * S)
    second = debounced("b", context={"n": 2})
    assert second.pk != first.pk  # a new row: the worker's wheel may hold the old id
    assert not Timer.objects.filter(pk=first.pk).exists()  # deleted, not left cancelled
    row = holder()
    assert row.pk == second.pk and row.state == "pending"
    assert (row.fire_at_ms, row.debounce_since_ms) == (NOW + 8 * S, NOW)
    assert (row.args, row.context) == (["b"], {"n": 2})
    assert Timer.objects.count() == 1


def test_max_wait_bounds_the_moves_from_the_first_call(clock):
    for step in range(3):  # a call every 4 s, each asking for 5 s of quiet
        timer = debounced(f"call{step}", max_wait=timedelta(seconds=10))
        assert timer.fire_at_ms == min(NOW + step * 4 * S + 5 * S, NOW + 10 * S)
        clock.advance(4 * S)
    row = holder()
    assert (row.fire_at_ms, row.args, row.debounce_since_ms) == (NOW + 10 * S, ["call2"], NOW)
    assert Timer.objects.count() == 1


def test_at_the_bound_a_call_still_gives_its_arguments_in_place(clock):
    debounced("a", max_wait=timedelta(seconds=6))
    clock.advance(4 * S)
    at_bound = debounced("b", max_wait=timedelta(seconds=6))
    assert at_bound.fire_at_ms == NOW + 6 * S
    clock.advance(1 * S)
    same = debounced("c", max_wait=timedelta(seconds=6))
    assert same.pk == at_bound.pk  # its time stays, so the row is updated in place
    assert (holder().args, holder().fire_at_ms) == (["c"], NOW + 6 * S)


def test_a_call_never_moves_the_timer_earlier(clock):
    debounced("a", debounce=timedelta(minutes=10))
    clock.advance(S)
    timer = debounced("b", debounce=timedelta(seconds=1))
    assert timer.fire_at_ms == NOW + 10 * 60 * S and timer.args == ["b"]


def test_the_last_call_wins_on_every_option(clock):
    debounced("a", max_attempts=2, on_complete=h.on_done, context={"v": 1})
    clock.advance(S)
    timer = debounced("b", max_attempts=7, backoff=timedelta(seconds=3))
    assert (timer.max_attempts, timer.backoff_base_s) == (7, 3.0)
    assert (timer.on_complete, timer.context) == ("", None)


def test_a_pending_timer_waiting_for_a_retry_keeps_its_attempts(clock):
    first = debounced("a")
    Timer.objects.filter(pk=first.pk).update(attempts=2, last_error="RuntimeError: boom")
    clock.advance(S)
    timer = debounced("b")
    assert (timer.attempts, timer.last_error, timer.args) == (2, "RuntimeError: boom", ["b"])


def test_children_follow_the_moved_timer(clock):
    first = debounced("a")
    child = durable.schedule(h.noop, parent=first, delay=timedelta(hours=1))
    clock.advance(S)
    moved = debounced("b")
    assert Timer.objects.get(pk=child.pk).parent_id == moved.pk
    assert durable.cancel(moved) and Timer.objects.get(pk=child.pk).state == "canceled"


def test_a_pending_timer_scheduled_without_debounce_joins_the_burst_now(clock):
    plain = durable.schedule(h.record, args=["plain"], key="doc:1", delay=timedelta(seconds=2))
    clock.advance(S)
    timer = debounced("b", max_wait=timedelta(seconds=5))
    assert timer.pk != plain.pk
    assert (timer.fire_at_ms, timer.debounce_since_ms) == (NOW + 6 * S, NOW + S)


# -- the caller's transaction ---------------------------------------------------------------


class Boom(Exception):
    pass


def test_a_rolled_back_second_call_leaves_the_first_timer_as_it_was(clock):
    first = debounced("a")
    before = Timer.objects.values().get(pk=first.pk)
    clock.advance(3 * S)
    with pytest.raises(Boom), transaction.atomic():
        moved = debounced("b")
        assert moved.pk != first.pk and not Timer.objects.filter(pk=first.pk).exists()
        raise Boom
    assert list(Timer.objects.values()) == [before]


def test_a_rolled_back_first_call_leaves_nothing(clock):
    with pytest.raises(Boom), transaction.atomic():
        debounced("a")
        raise Boom
    assert not Timer.objects.exists()


# -- when the key's timer is no longer pending ------------------------------------------------


@pytest.mark.parametrize("state", ["firing", "fired", "failed", "canceled"])
def test_a_finished_burst_lets_go_of_the_key_and_a_new_timer_starts(clock, state):
    first = debounced("a")
    Timer.objects.filter(pk=first.pk).update(state=state)
    clock.advance(10 * S)
    timer = debounced("b", max_wait=timedelta(seconds=6))
    old = Timer.objects.get(pk=first.pk)
    assert (old.state, old.key, old.args) == (state, None, ["a"])  # otherwise untouched
    assert holder().pk == timer.pk != first.pk
    assert (timer.fire_at_ms, timer.debounce_since_ms) == (NOW + 15 * S, NOW + 10 * S)


def test_a_pending_timer_with_an_attempt_under_way_is_not_moved(clock):
    first = debounced("a")  # a worker counted an attempt and is about to run it
    Timer.objects.filter(pk=first.pk).update(attempts=1, claim_token=7)
    clock.advance(S)
    timer = debounced("b")
    old = Timer.objects.get(pk=first.pk)
    assert (old.state, old.key, old.attempts, old.args) == ("pending", None, 1, ["a"])
    assert (timer.attempts, timer.args, timer.fire_at_ms) == (0, ["b"], NOW + 6 * S)


# -- refused calls ----------------------------------------------------------------------------


def test_a_key_held_by_another_handler_is_refused_and_nothing_written(clock):
    other = durable.schedule(h.noop, key="doc:1", delay=timedelta(hours=1))
    before = list(Timer.objects.values())
    with transaction.atomic():
        with pytest.raises(TimerError, match=r"key: 'doc:1' holds timer \d+ .*noop"):
            debounced("a")
        # The caller's transaction is not doomed: it can go on.
        durable.schedule(h.noop, key="after")
    assert list(Timer.objects.exclude(key="after").values()) == before
    assert Timer.objects.get(pk=other.pk).fire_at_ms == NOW + 3_600 * S


BAD = [
    ({"key": None}, ValueError, "key: debounce= needs a key"),
    ({"debounce": timedelta(0)}, ValueError, "debounce: must be positive"),
    ({"debounce": timedelta(seconds=-1)}, ValueError, "debounce: must be positive"),
    ({"debounce": 5}, TypeError, "debounce: expected a timedelta, got int"),
    ({"debounce": "5s"}, TypeError, "debounce: expected a timedelta, got str"),
    ({"debounce": timedelta.max}, ValueError, "debounce: .* is after 9999-12-30"),
    ({"max_wait": 10}, TypeError, "max_wait: expected a timedelta, got int"),
    ({"max_wait": timedelta(seconds=4)}, ValueError, "max_wait: .* is shorter than debounce"),
    ({"max_wait": timedelta(0)}, ValueError, "max_wait: must be positive"),
    ({"max_wait": timedelta.max}, ValueError, "max_wait: .* is after 9999-12-30"),
    ({"debounce": None, "max_wait": timedelta(1)}, ValueError, "max_wait: only means something"),
    ({"delay": timedelta(seconds=1)}, ValueError, "at/delay: a debounced timer is due at"),
    ({"at": datetime(2030, 1, 1, tzinfo=UTC)}, ValueError, "at/delay: a debounced timer"),
    ({"parent": 1}, ValueError, "parent: not supported with debounce="),
    ({"key": 5}, TypeError, "key: expected a str, got int"),
    ({"key": "a\x00b"}, ValueError, "key: str contains NUL"),
    ({"args": ["a", "b", "c"]}, TypeError, "args/kwargs: do not fit handler"),
    ({"args": [object()]}, ValueError, r"args\[0\]: object is not JSON"),
]


@pytest.mark.parametrize(("change", "error", "message"), BAD)
def test_bad_input_names_the_argument_and_writes_nothing(clock, change, error, message):
    first = debounced("a")
    before = list(Timer.objects.values())
    clock.advance(S)
    call = {"args": ["b"], "key": "doc:1", "debounce": timedelta(seconds=5), **change}
    with pytest.raises(error, match=message):
        durable.schedule(h.record, **call)
    assert list(Timer.objects.values()) == before and holder().pk == first.pk


def test_debounce_near_the_latest_instant(clock):
    clock.set(MAX_INSTANT_MS - 10 * S)
    timer = debounced("a", debounce=timedelta(seconds=10), max_wait=timedelta(seconds=10))
    assert timer.fire_at_ms == MAX_INSTANT_MS
    with pytest.raises(ValueError, match=r"debounce: .* is after 9999-12-30"):
        debounced("b", debounce=timedelta(seconds=11))


def test_schedule_many_does_not_debounce(clock):
    spec = {"fn": h.record, "args": ["a"], "key": "k", "debounce": timedelta(seconds=1)}
    with pytest.raises(TypeError, match=r"specs\[0\]: schedule_many\(\) does not debounce"):
        durable.schedule_many([spec])
    assert not Timer.objects.exists()


def test_the_admin_page_shows_when_the_burst_began(admin_client, clock):
    debounced("a")
    clock.advance(S)
    timer = debounced("b")
    page = admin_client.get(reverse("admin:durable_timer_change", args=[timer.pk]))
    assert page.status_code == 200
    html = page.content.decode()
    assert "Debounced since" in html and base.ms_display(NOW) in html
