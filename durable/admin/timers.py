"""The ``Timer`` admin: find timers among millions, and cancel, fire, move or retry them.

Every filter and search here is served by an index of ``durable_timer``:

- *state* by ``durable_timer_unfired_idx`` (state, fire_at_ms) for every state but
  fired; fired rows, most of the table and left out of that index (each entry there
  would cost every fire a write), by ``durable_timer_done_idx``: latest finished first;
- *due* (overdue, next hour...) by the unfired index: pending rows in a fire-time range;
- search by id (primary key), by key (the key's unique index) or key prefix (on
  PostgreSQL ``durable_timer_key_prefix_idx``, ``varchar_pattern_ops``, which serves
  ``LIKE 'prefix%'``): cron occurrences are ``cron:<schedule>:``, a run's wake-ups
  ``wf:<run id>:``;
- ``target:<dotted.name>`` has no index of its own, so it looks only at the newest
  :data:`TARGET_SEARCH_ROWS` timers (a bounded walk of the primary key).

Sorting is by id, or by fire time once the list is narrowed to a state but fired (the
unfired index then yields rows in fire-time order). Lists default to the newest first,
to the soonest due with the *due* filter, and to the latest finished with *fired*.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import Max, Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils.html import format_html
from django.utils.translation import ngettext

import durable
from durable.admin import base
from durable.admin.forms import RescheduleForm
from durable.choices import UNFIRED_STATES
from durable.core.clock import current_clock
from durable.exceptions import DurableError
from durable.models import Timer, TimerKind, TimerState
from durable.scheduling import operations

#: How many of the newest timers a ``target:`` search looks at (see the module doc).
TARGET_SEARCH_ROWS = 100_000

#: Kinds whose timers are never retried, so an attempt count means nothing for them: a
#: cron occurrence whose handler raises records the error on its schedule and is done
#: (durable.scheduling.occurrences); the schedule's next occurrence is a new timer.
NO_RETRY_KINDS = frozenset({TimerKind.CRON})

_MAX_ID = 2**63 - 1  # the largest value of a bigint primary key


def is_number(term: str) -> bool:
    """Whether a search term is a timer id: ASCII digits within the bigint range.

    ``str.isdigit()`` also accepts "²" or "٣", which ``int()`` then refuses or reads as
    another number; those terms are searched as keys instead.
    """
    return term.isascii() and term.isdecimal() and int(term) <= _MAX_ID


class DueFilter(admin.SimpleListFilter):
    """Pending timers by when they are due: a range scan of ``durable_timer_unfired_idx``."""

    title = "due (pending)"
    parameter_name = "due"
    RANGES = {
        "overdue": ("overdue", None, 0),
        "hour": ("within an hour", 0, 3_600_000),
        "day": ("within a day", 3_600_000, 86_400_000),
        "later": ("later", 86_400_000, None),
    }

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(key, label) for key, (label, _, _) in self.RANGES.items()]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Timer]) -> QuerySet[Timer]:
        if self.value() not in self.RANGES:
            return queryset
        _, start, end = self.RANGES[str(self.value())]
        now_ms = current_clock().now_ms()
        queryset = queryset.filter(state=TimerState.PENDING)
        if start is not None:
            queryset = queryset.filter(fire_at_ms__gt=now_ms + start)
        if end is not None:
            queryset = queryset.filter(fire_at_ms__lte=now_ms + end)
        return queryset


@admin.register(Timer)
class TimerAdmin(base.ObjectActions, base.ReadOnlyRows, base.BigTable, admin.ModelAdmin):
    """Timers: read-only rows; cancel, fire now, reschedule and retry as actions."""

    list_display = ("id", "target", "kind", "state", "fire_at", "attempts_of", "key", "shard")
    list_display_links = ("id", "target")
    list_filter = ("state", DueFilter)
    ordering = ("-id",)
    search_fields = ("key",)  # the search box; get_search_results decides what it means
    search_help_text = (
        "An id, a key or key prefix (cron:<schedule>:, wf:<run id>:), "
        f"or target:<dotted.name> (among the newest {TARGET_SEARCH_ROWS:,} timers)."
    )
    raw_id_fields = ("parent",)
    actions = ("cancel_timers", "fire_now", "reschedule", "retry_failed")
    object_actions = {
        "cancel_timers": "Cancel",
        "fire_now": "Fire now",
        "reschedule": "Reschedule…",
        "retry_failed": "Retry (if failed)",
    }
    fieldsets = (
        (None, {"fields": ("id", "state", "kind", "target", "key", "shard", "bucket")}),
        (
            "When",
            {
                "fields": (
                    "fire_at_full",
                    "created_at",
                    "updated_at",
                    "fired_at",
                    "claim",
                    "debounced_since",
                )
            },
        ),
        ("Payload", {"fields": ("args_json", "kwargs_json", "context_json", "result_json")}),
        (
            "Attempts",
            {"fields": ("attempts", "max_attempts_of", "backoff", "last_error", "fired_token")},
        ),
        ("Related", {"fields": ("parent_link", "children_link", "on_complete")}),
    )

    def get_readonly_fields(self, request: HttpRequest, obj: Timer | None = None) -> list[str]:
        return [name for _, group in self.fieldsets for name in group["fields"]]

    def get_ordering(self, request: HttpRequest) -> tuple[str, ...]:
        # Due timers soonest first. Also the only fast order for them: overdue timers
        # tend to have old ids, so walking the primary key from the newest would pass
        # most of the table before finding a page of them. Fired timers (old ids too,
        # under the pending ones) latest finished first, from the done index.
        if request.GET.get("due"):
            return ("fire_at_ms",)
        if request.GET.get("state__exact") == TimerState.FIRED:
            return ("-updated_at",)
        return ("-id",)

    def get_sortable_by(self, request: HttpRequest) -> tuple[str, ...]:
        # Fire-time order needs the unfired index: a due filter or a state but fired.
        if request.GET.get("state__exact") in UNFIRED_STATES or request.GET.get("due"):
            return ("id", "fire_at")
        return ("id",)

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Timer], search_term: str
    ) -> tuple[QuerySet[Timer], bool]:
        term = search_term.strip()
        if not term:
            return queryset, False
        if term.startswith("target:"):
            newest = Timer.objects.using(queryset.db).aggregate(top=Max("pk"))["top"] or 0
            window = Q(pk__gt=newest - TARGET_SEARCH_ROWS)
            return queryset.filter(window, target=term.removeprefix("target:").strip()), False
        if is_number(term):
            return queryset.filter(Q(pk=int(term)) | Q(key=term)), False
        return queryset.filter(key__startswith=term), False

    # -- columns ------------------------------------------------------------------------

    @admin.display(description="fire at", ordering="fire_at_ms")
    def fire_at(self, obj: Timer) -> str:
        now_ms = current_clock().now_ms()
        when = base.ms_display(obj.fire_at_ms)
        if obj.state != TimerState.PENDING:
            return when
        return format_html("{}<br><small>{}</small>", when, base.relative(obj.fire_at_ms, now_ms))

    @admin.display(description="attempts")
    def attempts_of(self, obj: Timer) -> str:
        if obj.kind in NO_RETRY_KINDS:
            return "—"  # fired once, never retried: "0/100" would promise retries
        return f"{obj.attempts}/{obj.max_attempts}"

    @admin.display(description="max attempts")
    def max_attempts_of(self, obj: Timer) -> str:
        if obj.kind in NO_RETRY_KINDS:
            return "— (fires once; a failed run is recorded on its schedule, not retried)"
        return str(obj.max_attempts)

    @admin.display(description="fire at")
    def fire_at_full(self, obj: Timer) -> str:
        now_ms = current_clock().now_ms()
        rel = base.relative(obj.fire_at_ms, now_ms)
        if not rel:  # out of datetime's range: ms_display already gives the raw value
            return base.ms_display(obj.fire_at_ms)
        return f"{base.ms_display(obj.fire_at_ms)} ({rel}; {obj.fire_at_ms} ms since epoch)"

    @admin.display(description="claim expires")
    def claim(self, obj: Timer) -> str:
        return base.ms_display(obj.claim_expires_ms)

    @admin.display(description="debounced since")
    def debounced_since(self, obj: Timer) -> str:
        # The first call of a debounced burst (max_wait counts from it); "-" otherwise.
        return base.ms_display(obj.debounce_since_ms)

    @admin.display(description="backoff")
    def backoff(self, obj: Timer) -> str:
        if obj.kind in NO_RETRY_KINDS:
            return "—"
        return f"{obj.backoff_base_s:g} s doubling, at most {obj.backoff_max_s:g} s"

    @admin.display(description="args")
    def args_json(self, obj: Timer) -> str:
        return base.pretty_json(obj.args)

    @admin.display(description="kwargs")
    def kwargs_json(self, obj: Timer) -> str:
        return base.pretty_json(obj.kwargs)

    @admin.display(description="context")
    def context_json(self, obj: Timer) -> str:
        return base.pretty_json(obj.context)

    @admin.display(description="result")
    def result_json(self, obj: Timer) -> str:
        replaced_by = (
            (obj.result or {}).get("replaced_by") if isinstance(obj.result, dict) else None
        )
        if replaced_by is not None:
            url = reverse("admin:durable_timer_change", args=[replaced_by])
            return format_html('replaced by <a href="{}">timer {}</a>', url, replaced_by)
        return base.pretty_json(obj.result)

    @admin.display(description="parent")
    def parent_link(self, obj: Timer) -> str:
        if obj.parent_id is None:
            return "-"
        url = reverse("admin:durable_timer_change", args=[obj.parent_id])
        return format_html('<a href="{}">timer {}</a>', url, obj.parent_id)

    @admin.display(description="children")
    def children_link(self, obj: Timer) -> str:
        count = Timer.objects.using(obj._state.db).filter(parent_id=obj.pk).count()
        if not count:
            return "none"
        url = reverse("admin:durable_timer_changelist") + f"?parent__id__exact={obj.pk}"
        return format_html('<a href="{}">{} {}</a>', url, count, ngettext("timer", "timers", count))

    # -- actions ------------------------------------------------------------------------

    @admin.action(
        description="Cancel selected timers (and their pending children)", permissions=["change"]
    )
    def cancel_timers(self, request: HttpRequest, queryset: QuerySet[Timer]) -> None:
        ids = base.bounded_ids(self, request, queryset)
        if ids is None:
            return
        done, skipped = base.each(ids, durable.cancel, lambda cancelled: cancelled is True)
        base.report(self, request, done, skipped, "cancelled", "not pending")

    @admin.action(description="Fire selected timers now", permissions=["change"])
    def fire_now(self, request: HttpRequest, queryset: QuerySet[Timer]) -> None:
        self._move(request, queryset, operations.fire_now, "made due now")

    @admin.action(description="Reschedule selected timers…", permissions=["change"])
    def reschedule(self, request: HttpRequest, queryset: QuerySet[Timer]) -> HttpResponse | None:
        def apply(ids: list[Any], data: dict[str, Any]) -> None:
            at, delay = data.get("at"), data.get("delay")
            move = lambda pk: operations.reschedule(pk, at=at, delay=delay)  # noqa: E731
            self._move(request, queryset.filter(pk__in=ids), move, "rescheduled")

        return base.form_action(self, request, queryset, RescheduleForm, "Reschedule timers", apply)

    @admin.action(description="Retry selected failed timers now", permissions=["change"])
    def retry_failed(self, request: HttpRequest, queryset: QuerySet[Timer]) -> None:
        self._move(request, queryset, operations.retry, "retried", why="not failed")

    def _move(
        self,
        request: HttpRequest,
        queryset: QuerySet[Timer],
        move: Any,
        verb: str,
        why: str = "not pending",
    ) -> None:
        ids = base.bounded_ids(self, request, queryset)
        if ids is None:
            return
        done, skipped, refused, moved = [], [], [], []
        for pk in sorted(ids):
            new = base.attempt(lambda pk=pk: move(pk))
            if isinstance(new, DurableError):
                refused.append(f"{pk}: {new}")
            elif new is None:
                skipped.append(pk)
            else:
                done.append(pk)
                moved.append(f"{pk} → {new.pk}")
        base.report(self, request, done, skipped, verb, why)
        if moved:
            ids_label = ngettext("New timer id", "New timer ids", len(moved))
            self.message_user(request, f"{ids_label}: " + ", ".join(moved[:20]) + ".")
        for line in refused[:5]:
            self.message_user(request, line, messages.ERROR)
