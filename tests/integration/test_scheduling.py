"""durable.schedule() and durable.schedule_many() against a real database."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection, connections, transaction
from django.db.models.signals import post_init
from django.test.utils import CaptureQueriesContext, override_settings

import durable
from durable.conf import get_settings
from durable.core.sharding import bucket_of, shard_for
from durable.exceptions import PayloadError, TimerError, UnknownHandler
from durable.models import Timer
from durable.storage import timers as store
from durable.testing import ManualClock, override_clock
from testproject.demo import handlers as h

NOW = 1_700_000_000_000
pytestmark = pytest.mark.django_db


@pytest.fixture
def clock():
    with override_clock(ManualClock(start_ms=NOW)) as manual:
        yield manual


# -- schedule -----------------------------------------------------------------------------


def test_schedule_writes_a_pending_handler_timer(clock):
    timer = durable.schedule(h.record, args=["a"], kwargs={"due_at_ms": 5}, delay=timedelta(1))
    row = Timer.objects.get(pk=timer.pk)
    conf = get_settings()
    assert row.target == "testproject.demo.handlers.record"
    assert (row.kind, row.state, row.attempts) == ("handler", "pending", 0)
    assert row.args == ["a"] and row.kwargs == {"due_at_ms": 5}
    assert row.fire_at_ms == NOW + 86_400_000
    assert row.bucket == bucket_of(row.fire_at_ms, conf.BUCKET_SHIFT)
    assert 0 <= row.shard < conf.SHARDS
    assert row.key is None and row.parent_id is None and row.on_complete == ""
    assert row.context is None


def test_without_at_or_delay_it_is_due_now(clock):
    assert durable.schedule(h.noop).fire_at_ms == NOW


def test_at_is_stored_as_epoch_ms_and_past_is_allowed(clock):
    at = datetime(2030, 5, 17, 8, 30, tzinfo=UTC)
    assert durable.schedule(h.noop, at=at).fire_at_ms == int(at.timestamp() * 1000)
    past = durable.schedule(h.noop, at=datetime(2001, 1, 1, tzinfo=UTC))
    assert past.fire_at_ms == 978_307_200_000


def test_dotted_name_resolves_to_the_same_handler(clock):
    timer = durable.schedule("testproject.demo.handlers.record", args=["b"])
    assert timer.target == "testproject.demo.handlers.record"


def test_a_keyed_timer_lives_on_the_keys_shard(clock):
    timer = durable.schedule(h.noop, key="order:42")
    assert timer.shard == shard_for("order:42", get_settings().SHARDS)


def test_shard_and_bucket_follow_the_settings(clock):
    with override_settings(DURABLE={"SHARDS": 8, "BUCKET_SHIFT": 10}):
        timer = durable.schedule(h.noop, key="invoice:9", delay=timedelta(seconds=3))
        many = durable.schedule_many([{"fn": h.noop, "key": "invoice:10", "delay": timedelta(1)}])
    assert (timer.shard, timer.bucket) == (shard_for("invoice:9", 8), (NOW + 3_000) >> 10)
    assert (many[0].shard, many[0].bucket) == (shard_for("invoice:10", 8), (NOW + 86_400_000) >> 10)


def test_unkeyed_timers_spread_over_the_shards(clock):
    with override_settings(DURABLE={"SHARDS": 4}):
        shards = {durable.schedule(h.noop).shard for _ in range(200)}
    assert shards == {0, 1, 2, 3}


def test_policy_comes_from_the_call_then_the_handler_then_settings(clock):
    plain = durable.schedule(h.noop)
    conf = get_settings()
    assert (plain.max_attempts, plain.backoff_base_s, plain.backoff_max_s) == (
        conf.MAX_ATTEMPTS,
        conf.BACKOFF_BASE_S,
        conf.BACKOFF_MAX_S,
    )
    declared = durable.schedule(h.flaky, args=["k"])  # max_attempts=3, backoff=10 s
    assert (declared.max_attempts, declared.backoff_base_s) == (3, 10.0)
    assert declared.backoff_max_s == conf.BACKOFF_MAX_S
    call = durable.schedule(h.flaky, args=["k"], max_attempts=9, backoff=durable.Backoff(base_s=4))
    assert (call.max_attempts, call.backoff_base_s, call.backoff_max_s) == (9, 4.0, 3600.0)
    with override_settings(DURABLE={"MAX_ATTEMPTS": 2, "BACKOFF_MAX_S": 60.0}):
        timer = durable.schedule(h.noop, backoff=timedelta(seconds=5))
    assert (timer.max_attempts, timer.backoff_base_s, timer.backoff_max_s) == (2, 5.0, 60.0)


def test_on_complete_and_context_are_stored(clock):
    timer = durable.schedule(h.noop, on_complete=h.on_done, context={"order": 7})
    row = Timer.objects.get(pk=timer.pk)
    assert row.on_complete == "testproject.demo.handlers.on_done"
    assert row.context == {"order": 7}
    by_name = durable.schedule(h.noop, on_complete="testproject.demo.handlers.on_done")
    assert by_name.on_complete == row.on_complete


def test_parent_by_instance_or_id(clock):
    parent = durable.schedule(h.noop)
    assert durable.schedule(h.noop, parent=parent).parent_id == parent.pk
    assert durable.schedule(h.noop, parent=parent.pk).parent_id == parent.pk


# -- bad input: a clear error, and nothing written ------------------------------------------


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: durable.schedule(h.noop, at=datetime(2030, 1, 1)), ValueError, "^at: naive"),
        (lambda: durable.schedule(h.noop, delay=timedelta(-1)), ValueError, "^delay: must not"),
        (lambda: durable.schedule(h.noop, delay=30), TypeError, "^delay: expected a timedelta"),
        (
            lambda: durable.schedule(h.noop, args=[datetime(2030, 1, 1, tzinfo=UTC)]),
            PayloadError,
            r"^args\[0\]: datetime is not JSON-serializable",
        ),
        (
            lambda: durable.schedule(h.noop, kwargs={"x": float("nan")}),
            PayloadError,
            r"^kwargs\['x'\]: float nan is not JSON",
        ),
        (
            lambda: durable.schedule(h.noop, context={"when": {1, 2}}),
            PayloadError,
            r"^context\['when'\]: set is not",
        ),
        (
            lambda: durable.schedule(h.noop, args=["x" * 70_000]),
            PayloadError,
            r"payload .* is 70006 bytes of JSON; the limit is DURABLE\['MAX_PAYLOAD_BYTES'\]",
        ),
        (lambda: durable.schedule(h.noop, key=""), ValueError, "^key: must be 1 to 255"),
        (lambda: durable.schedule(h.noop, key=5), TypeError, "^key: expected a str"),
        (lambda: durable.schedule(h.noop, max_attempts=0), ValueError, "^max_attempts: must"),
        (lambda: durable.schedule(h.noop, backoff="1s"), TypeError, "^backoff: expected"),
        (
            lambda: durable.schedule(h.not_a_handler, args=["k"]),
            UnknownHandler,
            r"testproject\.demo\.handlers\.not_a_handler is not a durable handler; "
            r"decorate it with @durable\.handler",
        ),
        (
            lambda: durable.schedule("testproject.demo.handlers.nope"),
            UnknownHandler,
            r"unknown handler 'testproject\.demo\.handlers\.nope'",
        ),
        (
            lambda: durable.schedule("no_such_module.fn"),
            UnknownHandler,
            r"unknown handler 'no_such_module\.fn'",
        ),
        (lambda: durable.schedule(lambda: None), TypeError, "define handlers at module level"),
        (lambda: durable.schedule(42), TypeError, "^fn_or_dotted_name: expected a @durable"),
        (
            lambda: durable.schedule(h.noop, on_complete="testproject.demo.handlers.gone"),
            UnknownHandler,
            r"^on_complete: unknown handler 'testproject\.demo\.handlers\.gone'",
        ),
        (lambda: durable.schedule(h.noop, parent=10**9), TimerError, r"^parent: no timer .*10+"),
        (
            lambda: durable.schedule(h.noop, parent=Timer()),
            TimerError,
            "^parent: this Timer is not",
        ),
        (lambda: durable.schedule(h.noop, parent="7"), TypeError, "^parent: expected a Timer"),
    ],
)
def test_bad_input_is_refused_and_nothing_is_written(clock, call, error, message):
    with pytest.raises(error, match=message):
        call()
    assert Timer.objects.count() == 0


def test_at_and_delay_together_are_refused(clock):
    with pytest.raises(ValueError, match="at most one of at= and delay="):
        durable.schedule(h.noop, at=datetime(2030, 1, 1, tzinfo=UTC), delay=timedelta(1))
    assert not Timer.objects.exists()


def test_payload_limit_comes_from_settings(clock):
    limit = override_settings(DURABLE={"MAX_PAYLOAD_BYTES": 100})
    with limit, pytest.raises(PayloadError, match=r"= 100$") as info:
        durable.schedule(h.noop, args=["y" * 100])
    assert (info.value.size, info.value.limit) == (106, 100)
    assert not Timer.objects.exists()


# -- idempotency keys -----------------------------------------------------------------------


def test_same_key_returns_the_existing_timer_and_writes_nothing(clock):
    first = durable.schedule(h.record, args=["a"], key="welcome:1", delay=timedelta(hours=1))
    clock.advance(timedelta(minutes=5))
    with CaptureQueriesContext(connection) as queries:
        again = durable.schedule(h.record, args=["b"], key="welcome:1")
    assert again.pk == first.pk
    assert again.args == ["a"] and again.fire_at_ms == first.fire_at_ms
    # At most an insert that yields to the existing key (one statement where a look-up,
    # a savepoint, an insert and a release would be needed for a new key): no write.
    writes = [
        q["sql"] for q in queries.captured_queries if q["sql"].startswith(("INSERT", "UPDATE"))
    ]
    assert all("OR IGNORE" in sql or "ON CONFLICT DO NOTHING" in sql for sql in writes), writes
    assert Timer.objects.count() == 1


def test_a_key_with_another_target_still_returns_the_existing_timer(clock):
    first = durable.schedule(h.record, args=["a"], key="k")
    other = durable.schedule(h.noop, key="k")
    assert other.pk == first.pk and other.target == "testproject.demo.handlers.record"


# -- transactions ---------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_transaction_leaves_nothing(clock):
    with pytest.raises(RuntimeError), transaction.atomic():
        durable.schedule(h.noop, key="rolled-back")
        durable.schedule_many([{"fn": h.noop} for _ in range(5)])
        assert Timer.objects.count() == 6
        raise RuntimeError("the caller's transaction fails")
    assert Timer.objects.count() == 0
    # The key is free again: nothing of the rolled-back schedule survives.
    assert durable.schedule(h.noop, key="rolled-back").pk is not None


@pytest.mark.django_db(transaction=True)
def test_schedule_commits_with_the_callers_transaction(clock):
    with transaction.atomic():
        timer = durable.schedule(h.noop)
        assert connection.in_atomic_block
    assert Timer.objects.filter(pk=timer.pk).exists()


# -- schedule_many ----------------------------------------------------------------------------


def test_schedule_many_returns_saved_timers_in_input_order(clock):
    specs = [
        {"fn": h.record, "args": [f"k{i}"], "delay": timedelta(seconds=100 - i)} for i in range(60)
    ]
    timers = durable.schedule_many(specs)
    assert [t.args for t in timers] == [[f"k{i}"] for i in range(60)]
    assert all(t.pk is not None for t in timers)
    rows = {t.pk: t for t in Timer.objects.all()}
    assert len(rows) == 60
    for i, timer in enumerate(timers):
        row = rows[timer.pk]
        assert row.args == [f"k{i}"]
        assert row.fire_at_ms == NOW + (100 - i) * 1000
        assert row.bucket == bucket_of(row.fire_at_ms, get_settings().BUCKET_SHIFT)


def test_schedule_many_stores_every_column_like_schedule(clock):
    """Rows vary in every column the API sets; each must read back exactly."""
    parent = durable.schedule(h.noop)
    specs = [
        {"fn": h.noop, "args": [1, "two", 3.5, None, {"x": [True]}]},
        {"fn": "testproject.demo.handlers.record", "kwargs": {"key": "é\"\\'"}, "key": "m:1"},
        {"fn": h.flaky, "args": ["f"], "context": {"c": 1}, "on_complete": h.on_done},
        {"fn": h.noop, "parent": parent, "max_attempts": 2, "backoff": timedelta(seconds=3)},
        {"fn": h.noop, "context": [None], "at": datetime(2031, 1, 1, tzinfo=UTC)},
    ]
    timers = durable.schedule_many(specs)
    expected = [durable.schedule(spec.pop("fn"), **spec) for spec in _unkeyed(specs)]
    fields = ["target", "args", "kwargs", "max_attempts", "backoff_base_s", "backoff_max_s"]
    fields += ["parent_id", "on_complete", "context", "state", "kind", "attempts", "fire_at_ms"]
    for timer, twin in zip(timers, expected, strict=True):
        row = Timer.objects.get(pk=timer.pk)
        single = Timer.objects.get(pk=twin.pk)
        assert [getattr(row, f) for f in fields] == [getattr(single, f) for f in fields]
    assert Timer.objects.get(pk=timers[1].pk).key == "m:1"
    assert Timer.objects.filter(pk=timers[0].pk, context__isnull=True).exists()
    assert Timer.objects.get(pk=timers[4].pk).context == [None]


def _unkeyed(specs):
    return [{k: v for k, v in spec.items() if k != "key"} for spec in specs]


def test_schedule_many_returns_existing_timers_for_known_keys(clock):
    old = durable.schedule(h.record, args=["old"], key="k2")
    timers = durable.schedule_many(
        [
            {"fn": h.record, "args": ["a"], "key": "k1"},
            {"fn": h.record, "args": ["b"], "key": "k2"},
            {"fn": h.record, "args": ["c"]},
        ]
    )
    assert timers[1].pk == old.pk and timers[1].args == ["old"]
    assert [t.args for t in timers] == [["a"], ["old"], ["c"]]
    assert Timer.objects.count() == 3


def test_schedule_many_refuses_a_key_twice_in_one_call(clock):
    with pytest.raises(ValueError, match=r"^specs\[2\]\.key: 'dup' repeats specs\[0\]\.key"):
        durable.schedule_many(
            [{"fn": h.noop, "key": "dup"}, {"fn": h.noop}, {"fn": h.noop, "key": "dup"}]
        )
    assert not Timer.objects.exists()


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        ({"fn": h.noop, "args": [object()]}, PayloadError, r"^specs\[12\]\.args\[0\]: object is"),
        ({"fn": h.noop, "at": datetime(2030, 1, 1)}, ValueError, r"^specs\[12\]\.at: naive"),
        (
            {"fn": h.noop, "dealy": timedelta(1)},
            TypeError,
            r"^specs\[12\]: unknown key\(s\) 'dealy'",
        ),
        ({"args": [1]}, TypeError, r"^specs\[12\]: missing 'fn'"),
        ({"fn": "nope.nope"}, UnknownHandler, r"^specs\[12\]\.fn: unknown handler 'nope\.nope'"),
        ({"fn": h.noop, "parent": 10**9}, TimerError, r"^specs\[12\]\.parent: no timer"),
        ((h.noop,), TypeError, r"^specs\[12\]: expected a dict"),
    ],
)
def test_schedule_many_validates_everything_before_writing(clock, bad, error, message):
    specs = [{"fn": h.noop, "args": [i]} for i in range(12)] + [bad]
    with pytest.raises(error, match=message):
        durable.schedule_many(specs)
    assert not Timer.objects.exists()


def test_schedule_many_accepts_any_iterable_and_empty(clock):
    assert durable.schedule_many([]) == []
    timers = durable.schedule_many({"fn": h.noop, "args": [i]} for i in range(3))
    assert [t.args for t in timers] == [[0], [1], [2]]


@pytest.mark.postgres
def test_schedule_many_is_one_insert_statement_on_postgresql(clock):
    specs = [{"fn": h.noop, "args": [i], "delay": timedelta(seconds=i)} for i in range(2_000)]
    with CaptureQueriesContext(connection) as queries:
        timers = durable.schedule_many(specs)
    inserts = [q for q in queries.captured_queries if q["sql"].startswith("INSERT")]
    assert len(inserts) == 1
    assert len({t.pk for t in timers}) == 2_000
    ids = [t.pk for t in timers]
    assert ids == sorted(ids)  # one statement inserts, and returns ids, in input order
    assert Timer.objects.filter(context__isnull=True, kwargs={}, key__isnull=True).count() == 2_000
    assert list(Timer.objects.order_by("pk").values_list("args", flat=True)) == [
        [i] for i in range(2_000)
    ]


# -- concurrency on PostgreSQL ----------------------------------------------------------------


def _in_thread(fn, results, name):
    def run():
        try:
            results[name] = fn()
        except BaseException as exc:  # reported by the test, not lost in the thread
            results[name] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, name=name)
    thread.start()
    return thread


def _wait_for_lock_waiter(timeout_s: float = 10.0) -> None:
    """Block until some backend of the test database waits on a lock (the 2nd inserter)."""
    with connections["default"].cursor() as cursor:
        for _ in range(int(timeout_s * 100)):
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            if cursor.fetchone()[0]:
                return
            threading.Event().wait(0.01)
    raise AssertionError("the second inserter never waited on the first one's row")


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("first_commits", [True, False])
def test_concurrent_same_key_ends_with_one_row(clock, first_commits):
    release = threading.Event()
    inserted = threading.Event()
    results: dict = {}

    def first():
        with transaction.atomic():
            timer = durable.schedule(h.record, args=["first"], key="race")
            inserted.set()
            release.wait(10)
            if not first_commits:
                transaction.set_rollback(True)
            return timer.pk

    def second():
        with transaction.atomic():
            return durable.schedule(h.record, args=["second"], key="race").pk

    t1 = _in_thread(first, results, "first")
    assert inserted.wait(10)
    t2 = _in_thread(second, results, "second")
    _wait_for_lock_waiter()  # the second INSERT is blocked on the unique index
    release.set()
    t1.join(10)
    t2.join(10)
    assert not isinstance(results["first"], BaseException), results["first"]
    assert not isinstance(results["second"], BaseException), results["second"]
    row = Timer.objects.get(key="race")
    if first_commits:
        assert results["second"] == results["first"] == row.pk
        assert row.args == ["first"]
    else:
        assert results["second"] == row.pk and row.args == ["second"]
    assert Timer.objects.count() == 1


# -- storage paths behind schedule_many ---------------------------------------------------------


def _row(**fields):
    base = {"shard": 0, "bucket": 0, "fire_at_ms": NOW, "target": "testproject.demo.handlers.noop"}
    return store.new_timer(**{**base, **fields})


def test_insert_many_falls_back_per_row_when_a_key_appeared_meanwhile(clock):
    existing = durable.schedule(h.noop, key="taken")
    rows = store.insert_many("default", [_row(args=[1]), _row(key="taken"), _row(key="free")])
    assert rows[1].pk == existing.pk
    assert rows[0].pk and rows[2].pk and rows[0].pk != rows[2].pk
    assert Timer.objects.count() == 3


def test_insert_many_handles_columns_json_cannot_carry(clock):
    stamps = [datetime(2030, 1, d, tzinfo=UTC) for d in (1, 2)]
    rows = store.insert_many("default", [_row(fired_at=s, args=[i]) for i, s in enumerate(stamps)])
    assert [Timer.objects.get(pk=r.pk).fired_at for r in rows] == stamps


def test_new_timer_gives_each_timer_its_own_mutable_defaults():
    a, b = store.new_timer(), store.new_timer()
    a.args.append(1)
    a.kwargs["x"] = 1
    assert b.args == [] and b.kwargs == {}
    assert a._state.adding and a.pk is None


def test_new_timer_runs_the_real_constructor_when_someone_listens():
    seen = []

    def listener(sender, instance, **kwargs):
        seen.append(instance)

    post_init.connect(listener, sender=Timer)
    try:
        timer = store.new_timer(target="x", parent_id=None, args=[1])
    finally:
        post_init.disconnect(listener, sender=Timer)
    assert seen == [timer]
    assert (timer.target, timer.args, timer.kwargs, timer.state) == ("x", [1], {}, "pending")
