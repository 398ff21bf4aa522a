"""The load generator: schedules real work and writes a JSONL history of what committed.

Run as ``python -m chaos.load --history FILE --seed N --seconds S`` with
``DATABASE_URL`` set (the orchestrator does this). Each line is one operation, written
only after its transaction's outcome is known:

- ``status`` ``committed`` (commit returned), ``rolled_back`` (rolled back on purpose) or
  ``unknown`` (an error: it may or may not have committed);
- ``t0`` / ``t1``: wall-clock epoch ms before the transaction began and after it ended.

Kinds: ``timer`` (atomic, external or flaky handler, maybe with a key, a parent or an
``on_complete``), ``dup`` (the same key scheduled again), ``cancel``, ``reschedule``,
``workflow``, ``signal``, ``poison``, ``cron`` and, with ``--celery-queue``, ``celery``
(:mod:`chaos.celery_dispatch`). The checker reads nothing else from this process.

Faster: ``--threads N`` runs N generators at once (own seeds, own operation ids, one
history; the schedules are made once), and ``--together K`` schedules plain timers K to
a transaction, each still a record of its own with the transaction's outcome and times.
``--rate`` counts transactions a second, over all threads.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import IO, Any

from chaos import celery_dispatch

POISONS = ("SystemExit", "hang")
#: Every this many poison operations, one exits its worker's process (``os._exit``), on
#: each of its 2 attempts: rarely enough that the crashes stay apart.
EXIT_EVERY = 8


def wall_ms() -> int:
    """Epoch ms by this machine's clock (the database runs on the same machine)."""
    return time.time_ns() // 1_000_000


class Rollback(Exception):
    """Raised inside a transaction to roll it back on purpose."""


class Generator:
    """Picks operations at random (seeded) and runs each in its own transaction."""

    def __init__(self, out: IO[str], seed: int, rate: float, lock: Any = None) -> None:
        self.out = out
        self.rng = random.Random(seed)
        self.rate = rate
        self.lock = lock or threading.Lock()  # generators in threads share the history
        self.count = 0  # a generator in a thread starts at its own offset: ids never collide
        self.make_crons = True
        self.together = 1  # plain timers per transaction
        self.later: list[tuple[float, int, Callable[[], None]]] = []
        self.n_later = 0
        self.poisons = 0
        self.celery_queue = ""  # the run's Celery queue; empty: no dispatch timers

    # -- plumbing -----------------------------------------------------------------------

    def op_id(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self.lock:
            self.out.write(line)
            self.out.flush()

    def run_txn(
        self,
        record: dict[str, Any],
        body: Callable[[], dict[str, Any] | None],
        also: list[dict[str, Any]] | None = None,
    ) -> bool:
        """Run ``body`` in a transaction (rolled back when ``record['rollback']``).

        ``also``: more operations of the same transaction (``body`` fills them in): each
        is written as a record of its own, with the transaction's outcome and times."""
        from django.db import close_old_connections, connection, transaction

        record["t0"] = wall_ms()
        try:
            with transaction.atomic():
                record.update(body() or {})
                if record.get("rollback"):
                    raise Rollback
            record["status"] = "committed"
        except Rollback:
            record["status"] = "rolled_back"
        except Exception as exc:  # the database went away, or a durable error: log it
            record["status"] = "unknown"
            record["error"] = f"{type(exc).__name__}: {exc}"[:300]
            connection.close()
            close_old_connections()
        record["t1"] = wall_ms()
        for other in [record, *(also or [])]:
            keep = ("status", "t0", "t1", "error", "rollback")
            self.write({**other, **{k: record[k] for k in keep if k in record}})
        return record["status"] == "committed"

    def defer(self, seconds: float, action: Callable[[], None]) -> None:
        self.n_later += 1
        heapq.heappush(self.later, (time.monotonic() + seconds, self.n_later, action))

    def run_due_actions(self) -> None:
        while self.later and self.later[0][0] <= time.monotonic():
            _, _, action = heapq.heappop(self.later)
            action()

    # -- operations -----------------------------------------------------------------------

    def timer(self, handler: str = "", **extra: Any) -> tuple[str, bool, int | None]:
        import durable
        from testproject.demo import chaos

        rng = self.rng
        handler = handler or rng.choice(["atomic", "atomic", "external", "flaky"])
        op = self.op_id("t")
        delay_ms = extra.pop("delay_ms", rng.randint(0, 3000))
        rollback = extra.pop("rollback", rng.random() < 0.1)
        keyed = extra.pop("keyed", False)
        record: dict[str, Any] = {"kind": "timer", "op": op, "handler": handler, **extra}
        record["rollback"] = rollback
        if keyed or rng.random() < 0.3:
            record["key"] = f"k-{op}"
        if rng.random() < 0.2:
            record["on_complete"] = True
        args: list[Any] = [op]
        if handler == "flaky":
            record["fail_times"] = rng.randint(0, 2)
            args.append(record["fail_times"])

        def body() -> dict[str, Any]:
            timer = durable.schedule(
                getattr(chaos, handler),
                args=args,
                delay=timedelta(milliseconds=delay_ms),
                key=record.get("key"),
                on_complete=chaos.after if record.get("on_complete") else None,
                context=op if record.get("on_complete") else None,
                parent=record.get("parent_id"),
            )
            return {"timer_id": timer.pk, "due_ms": timer.fire_at_ms}

        ok = self.run_txn(record, body)
        return op, ok, record.get("timer_id")

    def plain_timer(self) -> None:
        op, ok, timer_id = self.timer()
        if not ok or timer_id is None:
            return
        roll = self.rng.random()
        if roll < 0.15:
            self.defer(self.rng.uniform(0, 2.0), lambda: self.cancel(op, timer_id))
        elif roll < 0.25:
            self.defer(self.rng.uniform(0, 1.5), lambda: self.reschedule(op, timer_id))

    def timers_together(self) -> None:
        """``together`` timers scheduled in one transaction (a record each)."""
        import durable
        from testproject.demo import chaos

        rng = self.rng
        rollback = rng.random() < 0.1
        records: list[dict[str, Any]] = []
        calls: list[tuple[Any, list[Any], int]] = []
        for _ in range(self.together):
            handler = rng.choice(["atomic", "atomic", "external", "flaky"])
            op = self.op_id("t")
            record: dict[str, Any] = {"kind": "timer", "op": op, "handler": handler}
            args: list[Any] = [op]
            if handler == "flaky":
                record["fail_times"] = rng.randint(0, 2)
                args.append(record["fail_times"])
            records.append({**record, "rollback": rollback})
            calls.append((getattr(chaos, handler), args, rng.randint(0, 3000)))

        def body() -> None:
            for record, (fn, args, delay_ms) in zip(records, calls, strict=True):
                timer = durable.schedule(fn, args=args, delay=timedelta(milliseconds=delay_ms))
                record.update(timer_id=timer.pk, due_ms=timer.fire_at_ms)

        self.run_txn(records[0], body, also=records[1:])

    def keyed_twice(self) -> None:
        """A keyed timer, then the same key again in a later transaction: one fire."""
        op, ok, timer_id = self.timer("atomic", delay_ms=self.rng.randint(0, 2000), keyed=True)
        if ok and timer_id is not None:
            self.defer(self.rng.uniform(0, 1.5), lambda: self.again(op, timer_id))

    def again(self, op: str, timer_id: int) -> None:
        import durable
        from testproject.demo import chaos

        dup = f"{op}-dup"

        def body() -> dict[str, Any]:
            again = durable.schedule(chaos.atomic, args=[dup], key=f"k-{op}")
            return {"again_id": again.pk}

        self.run_txn({"kind": "dup", "op": dup, "of": op, "timer_id": timer_id}, body)

    def cancel(self, op: str, timer_id: int) -> None:
        import durable

        self.run_txn(
            {"kind": "cancel", "op": op, "timer_id": timer_id},
            lambda: {"result": durable.cancel(timer_id)},
        )

    def reschedule(self, op: str, timer_id: int) -> None:
        from durable.scheduling.operations import reschedule

        delay = timedelta(milliseconds=self.rng.randint(0, 3000))

        def body() -> dict[str, Any]:
            new = reschedule(timer_id, delay=delay)
            if new is None:
                return {"result": False}
            return {"result": True, "new_timer_id": new.pk, "due_ms": new.fire_at_ms}

        self.run_txn({"kind": "reschedule", "op": op, "timer_id": timer_id}, body)

    def family(self) -> None:
        """A parent with children; half the time the parent is cancelled (cascade)."""
        rng = self.rng
        parent, ok, parent_id = self.timer("atomic", delay_ms=rng.randint(3000, 6000))
        if not ok or parent_id is None:
            return
        for _ in range(rng.randint(1, 3)):
            self.timer(
                rng.choice(["atomic", "external"]),
                delay_ms=rng.randint(1500, 5000),
                parent_id=parent_id,
                parent_op=parent,
                rollback=False,
            )
        if rng.random() < 0.5:
            self.defer(rng.uniform(0, 1.5), lambda: self.cancel(parent, parent_id))

    def workflow(self) -> None:
        import durable
        from testproject.demo import chaos

        rng = self.rng
        op = self.op_id("w")
        record: dict[str, Any] = {
            "kind": "workflow",
            "op": op,
            "steps": rng.randint(0, 3),
            "sleep_ms": rng.choice([0, rng.randint(100, 3000)]),
            "signal": rng.random() < 0.5,
            "child": rng.random() < 0.3,
            "rollback": rng.random() < 0.1,
        }
        payload = f"p-{op}"
        early = record["signal"] and rng.random() < 0.5

        def body() -> dict[str, Any]:
            args = (op, record["steps"], record["sleep_ms"], record["signal"], record["child"])
            chaos.flow.start(*args, run_id=op)
            if early:  # sent before the run reaches its wait: kept until then
                durable.send_signal(op, "go", payload)
            return {"early_signal": early}

        ok = self.run_txn(record, body)
        if ok and record["signal"] and not early:
            self.defer(rng.uniform(0, 3.0), lambda: self.signal(op, payload))

    def signal(self, op: str, payload: str, tries: int = 60) -> None:
        import durable

        ok = self.run_txn(
            {"kind": "signal", "op": op, "payload": payload},
            lambda: {"id": durable.send_signal(op, "go", payload).pk},
        )
        if not ok and tries > 1:  # the database may be restarting: the run waits for it
            self.defer(1.0, lambda: self.signal(op, payload, tries - 1))

    def poison(self) -> None:
        import durable
        from testproject.demo import poison

        rng = self.rng
        op = self.op_id("p")
        handler = rng.choice(["atomic_poison", "external_poison"])
        self.poisons += 1
        kind = "exit" if self.poisons % EXIT_EVERY == 0 else rng.choice(POISONS)
        record: dict[str, Any] = {"kind": "poison", "op": op, "handler": handler, "poison": kind}

        def body() -> dict[str, Any]:
            timer = durable.schedule(getattr(poison, handler), args=[kind], key=f"poison-{op}")
            return {"timer_id": timer.pk, "due_ms": timer.fire_at_ms}

        self.run_txn(record, body)

    def crons(self, count: int) -> list[str]:
        """Interval schedules every 1 or 2 s, run by :func:`testproject.demo.chaos.tick`."""
        from durable.scheduling import schedules

        names = []
        for i in range(count):
            name = f"chaos-every-{i}"
            interval_ms = 1000 if i % 2 == 0 else 2000

            def body(name: str = name, interval_ms: int = interval_ms) -> dict[str, Any]:
                row = schedules.create(
                    name, "testproject.demo.chaos.tick", every=timedelta(milliseconds=interval_ms)
                )
                return {"first_ms": row.next_ms, "interval_ms": interval_ms}

            if self.run_txn({"kind": "cron", "name": name}, body):
                names.append(name)
        return names

    def pause_crons(self, names: list[str]) -> None:
        for name in names:
            self.run_txn({"kind": "cron_pause", "name": name}, lambda n=name: _paused(n))

    # -- the loop -------------------------------------------------------------------------

    def run(self, seconds: float, poison_share: float) -> None:
        names = self.crons(2) if self.make_crons else []
        kinds: list[tuple[float, Callable[[], None]]] = [
            (0.55, self.plain_timer if self.together <= 1 else self.timers_together),
            (0.08, self.keyed_twice),
            (0.07, self.family),
            (0.30 - poison_share, self.workflow),
            (poison_share, self.poison),
            # Last, weighing 0 without a queue: other picks stay as they were for a seed.
            (celery_dispatch.share(self), lambda: celery_dispatch.schedule(self)),
        ]
        weights = [w for w, _ in kinds]
        end = time.monotonic() + seconds
        interval = 1.0 / self.rate
        next_at = time.monotonic()
        while time.monotonic() < end:
            self.run_due_actions()
            now = time.monotonic()
            if now < next_at:
                time.sleep(min(next_at - now, 0.05))
                continue
            next_at += interval
            next_at = max(next_at, now - 1.0)  # behind: do not burst to catch up
            self.rng.choices([k for _, k in kinds], weights)[0]()
        while self.later:  # cancels, reschedules and signals still owed
            time.sleep(0.05)
            self.run_due_actions()
        self.pause_crons(names)


def _paused(name: str) -> dict[str, Any]:
    from durable.scheduling import schedules

    row = schedules.pause(name)
    return {"next_ms": row.next_ms}


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m chaos.load``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--history", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--rate", type=float, default=25.0, help="operations per second")
    parser.add_argument("--poison-share", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=1, help="generators at once")
    parser.add_argument("--together", type=int, default=1, help="plain timers per transaction")
    parser.add_argument("--celery-queue", default="", help="schedule Celery dispatch timers")
    args = parser.parse_args(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    import django

    django.setup()
    lock = threading.Lock()
    with open(args.history, "a") as out:
        threads = []
        for i in range(args.threads):  # own seeds and ids; one makes the schedules
            gen = Generator(out, args.seed + i, args.rate / args.threads, lock=lock)
            gen.count, gen.make_crons, gen.together = i * 100_000_000, i == 0, args.together
            gen.celery_queue = args.celery_queue
            threads.append(threading.Thread(target=gen.run, args=(args.seconds, args.poison_share)))
            threads[-1].start()
        for thread in threads:
            thread.join()


if __name__ == "__main__":
    main()
