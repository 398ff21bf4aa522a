"""``python manage.py durable_check_runs``: would the code installed now break running workflows?

Run it with the new code, against the production database, before the deploy switches
workers over (a CI/CD step): it replays every unfinished run's recorded history dry
(:mod:`durable.workflows.checkruns`: no step runs, no row is written) and lists the runs
that would fail, with the seq and the call that differs. Exit status 0 when none would,
1 when some would, 2 when the database is unreachable.
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError

from durable.discovery import discover
from durable.workflows.checkruns import check_runs

#: Exit status: nothing would diverge, some runs would, the database is unreachable.
OK, DIVERGING, UNREACHABLE = 0, 1, 2


class Command(BaseCommand):
    help = (
        "Replay every unfinished workflow run against the code installed now, without side "
        "effects; list the runs that would fail (exit 1) or none (exit 0)."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--json", action="store_true", help="print JSON instead of text")
        parser.add_argument(
            "--workflow",
            action="append",
            default=[],
            metavar="NAME",
            help="check only the runs of this workflow (registered name; repeatable)",
        )
        parser.add_argument(
            "--page-size",
            type=int,
            default=1000,
            help="runs read (with their histories) per query (default 1000)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        page = options["page_size"]
        if page < 1:
            raise CommandError(f"--page-size must be at least 1, got {page}")
        discover()  # register the workflows, as the worker does at start-up
        try:
            report = check_runs(names=options["workflow"], page=page)
        except DatabaseError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CommandError(f"database unreachable: {first}", returncode=UNREACHABLE) from None
        if options["json"]:
            self.stdout.write(json.dumps(report.to_json(), indent=2))
        else:
            for divergence in report.divergences:
                self.stdout.write(str(divergence))
            rate = report.checked / report.seconds if report.seconds else 0.0
            self.stdout.write(
                f"checked {report.checked} unfinished run(s) in {report.seconds:.2f} s "
                f"({rate:,.0f}/s): {len(report.divergences)} would fail with the code "
                "installed now"
            )
        if not report.ok:
            raise CommandError(
                f"{len(report.divergences)} unfinished run(s) would fail with this code",
                returncode=DIVERGING,
            )
