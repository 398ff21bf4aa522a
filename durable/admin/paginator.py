"""A paginator for tables of millions of rows: no unbounded ``COUNT(*)``, no deep OFFSET.

Django's admin counts the whole (filtered) queryset to number its pages. On a table of a
million timers that is a scan of the table (or of a big part of an index) on every page
view. :class:`EstimatedCountPaginator` instead:

- on PostgreSQL, for an unfiltered list, reads the planner's estimate of the table's
  rows (``pg_class.reltuples``, kept fresh by autovacuum's ANALYZE);
- otherwise counts at most :attr:`~EstimatedCountPaginator.count_limit` + 1 rows
  (``SELECT COUNT(*) FROM (... LIMIT n)``): exact for small results, "more than n" for
  big ones;
- and offers only the first ``count_limit / per_page`` pages when the count is estimated
  or capped, so no page asks the database to skip more than ``count_limit`` rows. Past
  that, people narrow the list with a filter or a search, which the indexes serve.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from django.core.paginator import Paginator
from django.db import connections
from django.db.models import QuerySet


def estimated_rows(db: str, table: str) -> int | None:
    """The planner's row estimate for ``table`` on PostgreSQL; None if unknown there.

    ``reltuples`` is -1 (PostgreSQL 14+) or 0 for a table never analyzed.
    """
    connection = connections[db]
    if connection.vendor != "postgresql":
        return None
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT reltuples::bigint FROM pg_class WHERE oid = to_regclass(%s)",
            [connection.ops.quote_name(table)],
        )
        row = cursor.fetchone()
    if row is None or row[0] is None or row[0] <= 0:
        return None
    return int(row[0])


class EstimatedCountPaginator(Paginator):
    """A paginator whose count never costs more than ``count_limit`` rows (see module doc).

    ``estimated`` and ``capped`` tell the template how to word the count ("about",
    "more than").
    """

    #: Count exactly up to this many rows; beyond it the count is capped or estimated.
    count_limit = 10_000

    def __init__(self, object_list: Any, per_page: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(object_list, per_page, *args, **kwargs)
        self.estimated = False
        self.capped = False

    @cached_property
    def count(self) -> int:
        """Rows in the list: exact, capped at ``count_limit + 1``, or estimated."""
        qs = self.object_list
        if not isinstance(qs, QuerySet):
            return super().count
        if not qs.query.where:
            estimate = estimated_rows(qs.db, qs.model._meta.db_table)
            if estimate is not None and estimate > self.count_limit:
                self.estimated = True
                return estimate
        # A sliced count is "SELECT COUNT(*) FROM (SELECT ... LIMIT n)": it stops early.
        counted = qs[: self.count_limit + 1].count()
        if counted > self.count_limit:
            self.capped = True
        return counted

    @cached_property
    def num_pages(self) -> int:
        """Pages offered: all of them, or the first ``count_limit`` rows' worth."""
        pages = super().num_pages
        if self.estimated or self.capped:
            return min(pages, max(1, self.count_limit // self.per_page))
        return pages
