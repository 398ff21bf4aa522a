"""A run's timeline, drawn to scale from its recorded times (the admin's run pages).

The axis runs from the run's creation to its end (to now while it is active). Each
recorded call is a row: a step's attempts as bars from their start for their duration
(``WorkflowStep.started_at`` and ``duration_ms``, recorded with the step since migration
0013), sleeps and waits as bars from when they began to when the run was woken, and
marks for wake-ups, retries due, deadlines and signals consumed; each signal is a row
from when it was sent to when it was consumed. Positions are percentages of the axis:
plain positioned ``<span>`` elements and CSS, no script.

A run records up to ``MAX_STEPS_PER_RUN`` (10,000) calls. Value calls (``now``,
``random``, ``uuid4``, ``patched``) take no time and are not drawn. Past :data:`MAX_ROWS`
drawn calls, consecutive calls are grouped so that at most :data:`MAX_ROWS` rows are
drawn: a group's bar spans its first start to its last end and takes the colour of its
worst status. Only the latest :data:`MAX_SIGNAL_ROWS` signals are drawn.

Times are shown in the current time zone (``TIME_ZONE`` or the one activated for the
request), relative to the run's start, with durations in words ("2 min 5 s"). Every
name comes from user data and is escaped by the template.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.utils import timezone

from durable.admin.base import local_instant, ms_display
from durable.models import WorkflowRun
from durable.storage.run_times import EPOCH, SignalTimes, StepTimes
from durable.workflows.records import Kind, Status

#: Most rows drawn for a run's calls; past it, consecutive calls are grouped.
MAX_ROWS = 200
#: Most signals drawn (the latest).
MAX_SIGNAL_ROWS = 50
#: Calls that take no time: recorded for replay, not drawn.
VALUE_KINDS = frozenset({Kind.NOW, Kind.RANDOM, Kind.UUID, Kind.PATCHED})
_TICKS = 5
_ONE_MS = timedelta(milliseconds=1)
_WORST = {"failed": 4, "retried": 3, "wait": 2, "sleep": 1}  # a group's colour: its worst member's


@dataclass(frozen=True, slots=True)
class Bar:
    """A span on a row: ``left`` and ``width`` are percentages of the axis."""

    left: str
    width: str
    css: str
    title: str


@dataclass(frozen=True, slots=True)
class Mark:
    """An instant on a row (a wake-up, a deadline, a signal sent or consumed)."""

    left: str
    css: str
    title: str


@dataclass(slots=True)
class Row:
    """One drawn row: a label, its bars and marks, and its times in words."""

    label: str
    name: str
    title: str
    when: str
    bars: list[Bar] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Timeline:
    """Everything the template draws for one run."""

    run: WorkflowRun
    timezone: str
    start: str
    end: str
    span: str
    ticks: list[Mark]
    rows: list[Row]
    notes: list[str]
    link: str = ""
    """The run's admin page, when the page drawing it links there."""


def human_duration(ms: int | float) -> str:
    """A duration in words: ``"850 ms"``, ``"2.5 s"``, ``"3 min 4 s"``, ``"2 d 5 h"``."""
    ms = max(0, int(ms))
    if ms < 1000:
        return f"{ms} ms"
    if ms < 60_000:
        return f"{ms / 1000:.1f} s".replace(".0 s", " s")
    seconds = round(ms / 1000)
    for unit, size, sub, sub_size in (("d", 86_400, "h", 3600), ("h", 3600, "min", 60)):
        if seconds >= size:
            whole, rest = divmod(seconds, size)
            return f"{whole} {unit} {rest // sub_size} {sub}".replace(f" 0 {sub}", "")
    minutes, rest = divmod(seconds, 60)
    return f"{minutes} min {rest} s".replace(" 0 s", "")


class Scale:
    """Maps instants (epoch ms) to percentages of the axis, clamped to it."""

    def __init__(self, start_ms: int, end_ms: int) -> None:
        self.start = start_ms
        self.end = max(end_ms, start_ms + 1)
        self.span = self.end - self.start

    def pct(self, ms: int) -> float:
        return min(100.0, max(0.0, (ms - self.start) * 100.0 / self.span))

    def bar(self, begin: int, end: int, css: str, title: str) -> Bar:
        left = self.pct(begin)
        return Bar(f"{left:.3f}", f"{max(0.0, self.pct(end) - left):.3f}", css, title)

    def mark(self, ms: int, css: str, title: str) -> Mark:
        return Mark(f"{self.pct(ms):.3f}", css, title)

    def after(self, ms: int) -> str:
        """``ms`` relative to the axis' start, in words."""
        sign = "-" if ms < self.start else "+"
        return sign + human_duration(abs(ms - self.start))


def build(
    run: WorkflowRun,
    steps: list[StepTimes],
    signals: tuple[list[SignalTimes], int],
    now_ms: int,
) -> Timeline:
    """Lay out ``run``'s timeline from its recorded calls and (latest) signals."""
    drawn = [step for step in steps if step.kind not in VALUE_KINDS]
    shown_signals, signal_total = signals
    scale = _scale(run, drawn, shown_signals, now_ms)
    rows = [_run_row(run, scale)]
    notes: list[str] = []
    if len(drawn) > MAX_ROWS:
        size = math.ceil(len(drawn) / MAX_ROWS)
        rows += [_group_row(drawn[i : i + size], scale, now_ms) for i in range(0, len(drawn), size)]
        notes.append(
            f"{len(drawn):,} calls drawn as {math.ceil(len(drawn) / size)} groups of {size} "
            "consecutive calls (a group's colour is its worst status); the run's steps list "
            "has each one."
        )
    else:
        consumed = {s.consumed_seq: s for s in shown_signals if s.consumed_seq is not None}
        rows += [_step_row(step, scale, now_ms, consumed.get(step.seq)) for step in drawn]
    rows += [_signal_row(signal, scale, now_ms) for signal in shown_signals]
    values = len(steps) - len(drawn)
    if values:
        notes.append(
            f"{values:,} value calls (now, random, uuid4, patched) take no time: not drawn."
        )
    if signal_total > len(shown_signals):
        notes.append(f"The latest {len(shown_signals)} of {signal_total:,} signals are drawn.")
    if not steps:
        notes.append("No calls recorded yet.")
    return Timeline(
        run=run,
        timezone=timezone.get_current_timezone_name(),
        start=_clock(scale.start, full=True),
        end=_clock(scale.end, full=True),
        span=human_duration(scale.span),
        ticks=_ticks(scale),
        rows=rows,
        notes=notes,
    )


def _ms(when: datetime) -> int:
    return (when - EPOCH) // _ONE_MS  # as run_times reads steps' times: rounded down


def _scale(
    run: WorkflowRun, steps: list[StepTimes], signals: list[SignalTimes], now_ms: int
) -> Scale:
    """From the run's creation (or an earlier record) to its end, or to now if active."""
    start = _ms(run.created_at)
    ends = [_ms(run.updated_at)]
    for step in steps:
        begin, end = _extent(step, now_ms)
        start = min(start, begin)
        ends.append(end)
    for signal in signals:
        start = min(start, _ms(signal.created_at))
        ends.append(_ms(signal.consumed_at or signal.created_at))
    if run.finished_at is not None:
        ends.append(_ms(run.finished_at))
    else:
        ends.append(now_ms)  # a future deadline is clipped, not stretched to
    return Scale(start, max(ends))


def _extent(step: StepTimes, now_ms: int) -> tuple[int, int]:
    """When a call began and ended (or now, if it still waits)."""
    created, updated = step.created_ms, step.updated_ms
    begin = step.started_ms if step.started_ms is not None else created
    if step.kind in (Kind.STEP, Kind.ATOMIC):
        return begin, max(updated, begin + (step.duration_ms or 0))
    if step.status == Status.WAITING:
        return created, max(created, now_ms)
    return created, updated


def _clock(ms: int, *, full: bool = False, span: int = 0) -> str:
    """An instant in the current time zone, as precise as the axis needs."""
    when = local_instant(ms)
    if when is None:
        return ms_display(ms)
    if full:
        return when.strftime("%Y-%m-%d %H:%M:%S")
    if span < 60_000:
        return when.strftime("%H:%M:%S.") + f"{when.microsecond // 1000:03d}"
    return when.strftime("%H:%M:%S" if span < 86_400_000 else "%b %d %H:%M")


def _ticks(scale: Scale) -> list[Mark]:
    ticks = []
    for n in range(_TICKS):
        ms = scale.start + scale.span * n // (_TICKS - 1)
        css = "first" if n == 0 else "last" if n == _TICKS - 1 else ""
        ticks.append(scale.mark(ms, css, _clock(ms, span=scale.span)))
    return ticks


def _run_row(run: WorkflowRun, scale: Scale) -> Row:
    end = scale.end if run.finished_at is None else _ms(run.finished_at)
    title = f"{run.state}: created {_clock(_ms(run.created_at), full=True)}"
    if run.finished_at is not None:
        title += f", finished {_clock(end, full=True)}"
    row = Row("run", run.state, title, human_duration(end - _ms(run.created_at)))
    row.bars.append(scale.bar(_ms(run.created_at), end, f"run-{run.state}", title))
    return row


def _step_row(step: StepTimes, scale: Scale, now_ms: int, signal: SignalTimes | None) -> Row:
    begin, end = _extent(step, now_ms)
    short = step.name.rsplit(".", 1)[-1] if step.kind in (Kind.STEP, Kind.ATOMIC) else step.name
    title = f"#{step.seq} {step.kind} {step.name} ({step.status})"
    if step.error:
        title += f": {step.error}"
    row = Row(f"#{step.seq} {step.kind}", short, title, f"{scale.after(begin)} · ")
    if step.kind in (Kind.STEP, Kind.ATOMIC):
        _attempts(row, step, scale)
    elif step.kind == Kind.SLEEP:
        _sleep(row, step, scale, begin, end)
    elif step.kind == Kind.CHILD:
        row.marks.append(
            scale.mark(begin, "child", f"child run started {_clock(begin, full=True)}")
        )
    else:  # a signal wait or a child wait
        _wait(row, step, scale, begin, end, signal)
    row.when += human_duration(end - begin)
    return row


def _attempts(row: Row, step: StepTimes, scale: Scale) -> None:
    """A step's attempts: the first, the latest, and the backoff between them."""
    created, updated = step.created_ms, step.updated_ms
    css = step.kind if step.status == Status.DONE else "failed"
    outcome = {Status.DONE: "succeeded", Status.FAILED: "failed for good"}.get(
        step.status, "failed"
    )
    if step.started_ms is None:  # recorded before the step's times were
        row.marks.append(scale.mark(created, css, f"{outcome} {_clock(created, full=True)}"))
        return
    start, took = step.started_ms, step.duration_ms or 0
    n = max(1, step.attempts)
    if n == 1:
        row.bars.append(scale.bar(start, start + took, css, _attempt(1, start, took, outcome)))
    else:
        latest = max(created, updated - took)
        row.bars.append(
            scale.bar(start, created, "failed", _attempt(1, start, created - start, "failed"))
        )
        middle = f", attempts 2-{n - 1} failed" if n > 2 else ""
        row.bars.append(
            scale.bar(created, latest, "backoff", f"backoff{middle} (their own times are not kept)")
        )
        row.bars.append(scale.bar(latest, latest + took, css, _attempt(n, latest, took, outcome)))
        row.marks.append(
            scale.mark(latest, "wake", f"woken for attempt {n} {_clock(latest, full=True)}")
        )
    if step.status == Status.RETRYING and step.wake_ms is not None:
        row.marks.append(
            scale.mark(step.wake_ms, "due", f"attempt {n + 1} due {ms_display(step.wake_ms)}")
        )
    row.name += f" x{n}" if n > 1 else ""


def _attempt(n: int, start: int, took: int, outcome: str) -> str:
    return f"attempt {n}: started {_clock(start, full=True)}, ran {human_duration(took)}, {outcome}"


def _sleep(row: Row, step: StepTimes, scale: Scale, begin: int, end: int) -> None:
    until = step.wake_ms if step.wake_ms is not None else end
    if step.status == Status.WAITING:
        title = f"sleeping since {_clock(begin, full=True)} until {ms_display(until)}"
        row.bars.append(scale.bar(begin, until, "sleep", title))
        row.marks.append(scale.mark(until, "due", f"wake-up due {ms_display(until)}"))
        return
    row.bars.append(scale.bar(begin, until, "sleep", f"slept {human_duration(until - begin)}"))
    row.marks.append(scale.mark(end, "wake", f"woken {_clock(end, full=True)}"))


def _wait(
    row: Row, step: StepTimes, scale: Scale, begin: int, end: int, signal: SignalTimes | None
) -> None:
    what = f"signal {step.name!r}" if step.kind == Kind.SIGNAL else f"child run {step.name}"
    if step.status == Status.WAITING:
        row.bars.append(
            scale.bar(begin, end, "wait", f"waiting for {what} since {_clock(begin, full=True)}")
        )
        if step.wake_ms is not None:
            row.marks.append(
                scale.mark(step.wake_ms, "due", f"deadline {ms_display(step.wake_ms)}")
            )
        return
    row.bars.append(
        scale.bar(begin, end, "wait", f"waited {human_duration(end - begin)} for {what}")
    )
    if step.kind != Kind.SIGNAL:
        row.marks.append(scale.mark(end, "wake", f"child finished, woken {_clock(end, full=True)}"))
    elif signal is not None and signal.consumed_at is not None:
        row.marks.append(
            scale.mark(
                _ms(signal.consumed_at), "consumed", f"signal consumed {_clock(end, full=True)}"
            )
        )
    else:
        row.marks.append(scale.mark(end, "due", f"timed out {_clock(end, full=True)}"))


def _signal_row(signal: SignalTimes, scale: Scale, now_ms: int) -> Row:
    sent = _ms(signal.created_at)
    row = Row("signal", signal.name, f"signal {signal.name!r}", scale.after(sent))
    if signal.consumed_at is None:
        row.bars.append(scale.bar(sent, max(sent, now_ms), "pending", "sent, not consumed yet"))
    else:
        used = _ms(signal.consumed_at)
        taken = f"consumed by #{signal.consumed_seq} {_clock(used, full=True)}"
        row.bars.append(scale.bar(sent, used, "pending", f"kept {human_duration(used - sent)}"))
        row.marks.append(scale.mark(used, "consumed", taken))
        row.when += f" · {human_duration(used - sent)}"
    row.marks.append(scale.mark(sent, "sent", f"sent {_clock(sent, full=True)}"))
    return row


def _group_row(steps: list[StepTimes], scale: Scale, now_ms: int) -> Row:
    """Consecutive calls drawn as one bar, coloured by their worst status."""
    extents = [_extent(step, now_ms) for step in steps]
    begin, end = min(b for b, _ in extents), max(e for _, e in extents)
    counts: dict[str, int] = {}
    for step in steps:
        counts[_group_css(step)] = counts.get(_group_css(step), 0) + 1
    css = max(counts, key=lambda c: _WORST.get(c, 0))
    detail = ", ".join(f"{count} {name}" for name, count in sorted(counts.items()))
    label = f"#{steps[0].seq}-#{steps[-1].seq}"
    row = Row(
        label,
        f"{len(steps)} calls",
        f"{label}: {detail}",
        f"{scale.after(begin)} · {human_duration(end - begin)}",
    )
    row.bars.append(scale.bar(begin, end, css, f"{label}: {detail}"))
    return row


def _group_css(step: StepTimes) -> str:
    if step.status in (Status.FAILED, Status.RETRYING):
        return "failed"
    if step.attempts > 1:
        return "retried"
    if step.status == Status.WAITING or step.kind in (Kind.SIGNAL, Kind.WAIT_CHILD):
        return "wait"
    return "sleep" if step.kind == Kind.SLEEP else "step"
