"""Prints the checker's verdict: faults, operations, invariants, lateness; replay details."""

from __future__ import annotations

from typing import Any

from chaos.checker import INVARIANTS, Verdict

EXAMPLES = 10


def table(verdict: Verdict) -> str:
    """The summary table of a run (plain text, fixed width)."""
    lines = ["", "faults applied", "--------------"]
    for kind, count in sorted(verdict.faults.items()):
        lines.append(f"  {kind:<28} {count:>10,}")
    lines.append(f"  {'total':<28} {sum(verdict.faults.values()):>10,}")
    lines += ["", "operations", "----------"]
    for kind, count in sorted(verdict.ops.items()):
        lines.append(f"  {kind:<28} {count:>10,}")
    lines.append(f"  {'total':<28} {sum(verdict.ops.values()):>10,}")
    lines += ["", "invariants                      checked  violations", "----------"]
    for name in INVARIANTS:
        bad = len(verdict.violations.get(name, []))
        mark = "" if bad == 0 else "   <-- FAILED"
        if bad and name in verdict.reported:
            mark = "   <-- reported (not failing the run)"
        lines.append(f"  {name:<28} {verdict.checked.get(name, 0):>8,} {bad:>10,}{mark}")
    lines += ["", "worst lateness after each kind of fault, from its end (ms)", "----------"]
    for kind, worst in sorted(verdict.lateness.items()):
        lines.append(f"  {kind:<28} {worst:>10,}   {verdict.worst.get(kind, '')}")
    lines.append(f"  fires within bounds only through a chain of faults: {verdict.chained:,}")
    lines += ["", celery_line(verdict.celery)]
    return "\n".join(lines)


def celery_line(celery: dict[str, Any] | None) -> str:
    """What the run's Celery dispatch part did: off, or messages from which queue."""
    if celery is None:
        return "celery dispatch: off (--no-celery)"
    line = (
        f"celery dispatch: {celery['delivered']:,} tasks run by the Celery worker on queue "
        f"{celery['queue']} of {celery['broker']}"
    )
    if celery.get("error"):
        line += f"; ERROR: {celery['error']}"
    return line


def failure_details(
    verdict: Verdict, *, seed: int, faults: list[dict[str, Any]], t0_ms: int, replay: str
) -> str:
    """What a failed run needs to be replayed: seed, fault schedule, ids per violation."""
    state = "FAILED" if not verdict.ok else "PASSED, WITH REPORTED VIOLATIONS"
    lines = ["", f"CHAOS RUN {state}  seed={seed}", f"replay: {replay}", "", "fault schedule:"]
    for fault in faults:
        at = (fault["start_ms"] - t0_ms) / 1000
        rest = {k: v for k, v in fault.items() if k not in ("kind", "start_ms")}
        lines.append(f"  +{at:8.2f}s  {fault['kind']:<12} {rest}")
    lines += ["", "violations:"]
    for name in INVARIANTS:
        found = verdict.violations.get(name, [])
        if found:
            lines.append(f"  {name} ({len(found)}):")
            lines += [f"    {message}" for message in found[:EXAMPLES]]
            if len(found) > EXAMPLES:
                lines.append(f"    ... and {len(found) - EXAMPLES} more (see verdict.json)")
    return "\n".join(lines)
