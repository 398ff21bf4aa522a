"""What every durable admin shares: read-only rows, big-table lists, bounded actions.

Two rules run through the whole admin:

- **Rows change only through the public API.** Saving a form would write every column
  from a read that may be stale by then: a timer the worker fired a moment ago would be
  written back as pending and fire twice. So change pages are view-only
  (:class:`ReadOnlyRows`) and every change is an action calling ``durable.cancel``,
  ``durable.schedules.pause``, ``durable.cancel_workflow``... Actions need the model's
  *change* permission; a user with only *view* sees the lists and no actions.
- **Lists stay fast on millions of rows** (:class:`BigTable`): estimated or capped counts,
  no facet counts, no joins, and sorting only by columns an index can serve.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.admin.utils import quote
from django.contrib.admin.views.main import ORDER_VAR, ChangeList
from django.db import transaction
from django.db.models import Model, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.translation import ngettext

from durable.admin.paginator import EstimatedCountPaginator
from durable.conf import get_settings
from durable.core.timeutil import ms_to_datetime
from durable.exceptions import DurableError

T = TypeVar("T")

#: An action refuses selections larger than this: "select all 1,000,000 timers" followed
#: by "cancel" would otherwise run a million transactions inside one web request.
MAX_ACTION_ROWS = 1_000


class ReadOnlyRows:
    """Mixin: no add, no delete, and view-only change pages (see the module docstring).

    ``has_change_permission(request)`` (no object) still answers with the user's real
    permission: that is what the changelist asks before offering actions.
    """

    def has_add_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        if obj is not None:
            return False
        return bool(super().has_change_permission(request))  # type: ignore[misc]


class ObjectActions:
    """Mixin: the model's actions as buttons on each object's (view-only) page.

    Each button posts the one object to the changelist's action, exactly as ticking its
    box there would (so permissions and confirmations are the same); the user is then
    brought back to the object's page. ``object_actions`` maps the actions offered to
    their button labels.
    """

    object_actions: dict[str, str] = {}
    change_form_template = "admin/durable/change_form.html"

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        allowed = self.get_actions(request)  # type: ignore[attr-defined]
        buttons = [(name, label) for name, label in self.object_actions.items() if name in allowed]
        context = {**(extra_context or {}), "object_actions": buttons}
        return super().change_view(request, object_id, form_url, context)  # type: ignore[misc]

    def response_action(self, request: HttpRequest, queryset: QuerySet[Any]) -> Any:
        response = super().response_action(request, queryset)  # type: ignore[misc]
        back = request.POST.get("_from_object")
        if back and isinstance(response, HttpResponseRedirect):
            opts = self.model._meta  # type: ignore[attr-defined]
            url = reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[quote(back)])
            return HttpResponseRedirect(url)
        return response


class IndexedChangeList(ChangeList):
    """A changelist that ignores ``?o=`` sorting by columns outside ``sortable_by``.

    Django hides the sort links of such columns but still obeys a hand-written
    ``?o=3``; on a big table that sort could mean scanning and sorting every row.
    """

    def get_ordering(self, request: HttpRequest, queryset: QuerySet[Any]) -> list[Any]:
        order = self.params.get(ORDER_VAR)
        if order and self.sortable_by is not None:
            allowed = {
                str(i) for i, name in enumerate(self.list_display) if name in self.sortable_by
            }
            kept = [part for part in order.split(".") if part.lstrip("-") in allowed]
            if kept:
                self.params[ORDER_VAR] = ".".join(kept)
            else:
                del self.params[ORDER_VAR]
        return super().get_ordering(request, queryset)


class BigTable:
    """Mixin for changelists of tables that grow to millions of rows."""

    paginator = EstimatedCountPaginator
    show_full_result_count = False  # a second, unfiltered COUNT(*) per page otherwise
    show_facets = admin.ShowFacets.NEVER  # facets count every filter choice
    list_select_related: Sequence[str] = ()  # no joins: FKs are shown as raw ids
    list_per_page = 100
    list_max_show_all = 200

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return IndexedChangeList


# -- actions --------------------------------------------------------------------------


def bounded_ids(
    modeladmin: admin.ModelAdmin[Any], request: HttpRequest, queryset: QuerySet[Any]
) -> list[Any] | None:
    """The selected primary keys, or None (with an error message) if there are too many."""
    ids = list(queryset.order_by().values_list("pk", flat=True)[: MAX_ACTION_ROWS + 1])
    if len(ids) > MAX_ACTION_ROWS:
        rows = ngettext("row", "rows", MAX_ACTION_ROWS)
        modeladmin.message_user(
            request,
            f"Select at most {MAX_ACTION_ROWS:,} {rows} for this action (narrow the list "
            "with a filter or a search first); nothing was changed.",
            messages.ERROR,
        )
        return None
    return ids


def each(
    ids: Sequence[Any], call: Callable[[Any], Any], ok: Callable[[Any], bool]
) -> tuple[list[Any], list[Any]]:
    """``call(pk)`` for each id, each in its own savepoint; split the ids by ``ok(result)``.

    A :class:`DurableError` (a finished run, a timer that cannot move) counts as not ok.
    """
    done, skipped = [], []
    for pk in sorted(ids):
        result = attempt(lambda pk=pk: call(pk))
        ok_ = not isinstance(result, DurableError) and ok(result)
        (done if ok_ else skipped).append(pk)
    return done, skipped


def report(
    modeladmin: admin.ModelAdmin[Any],
    request: HttpRequest,
    done: Sequence[Any],
    skipped: Sequence[Any],
    verb: str,
    why: str,
) -> None:
    """Tell the user what ``verb`` applied to and what was left alone (and why).

    The rows ``done`` (primary keys) also get an entry in their admin history, so their
    pages tell who cancelled, moved or paused them, and when.
    """
    opts = modeladmin.model._meta
    if done:
        name = ngettext(str(opts.verbose_name), str(opts.verbose_name_plural), len(done))
        modeladmin.message_user(
            request, f"{verb.capitalize()} {len(done)} {name}.", messages.SUCCESS
        )
        rows = modeladmin.model._default_manager.using(get_settings().DATABASE)
        LogEntry.objects.log_actions(
            user_id=request.user.pk,
            queryset=rows.filter(pk__in=list(done)),
            action_flag=CHANGE,
            change_message=f"{verb.capitalize()} (admin action).",
        )
    if skipped:
        listed = ", ".join(map(str, skipped[:20])) + (", ..." if len(skipped) > 20 else "")
        modeladmin.message_user(
            request, f"{len(skipped)} left unchanged ({why}): {listed}.", messages.WARNING
        )


def form_action(
    modeladmin: admin.ModelAdmin[Any],
    request: HttpRequest,
    queryset: QuerySet[Any],
    form_class: type[forms.Form],
    title: str,
    apply: Callable[[list[Any], dict[str, Any]], None],
) -> HttpResponse | None:
    """Run an action that needs input: show ``form_class``, then ``apply(ids, data)``.

    The intermediate page posts back to the changelist with the selected ids (never
    "select across"), the action's name and ``apply``; Django routes that POST to the
    same action again, which then validates the form and applies it.
    """
    ids = bounded_ids(modeladmin, request, queryset)
    if ids is None:
        return None
    submitted = "apply" in request.POST
    form = form_class(request.POST if submitted else None)
    if submitted and form.is_valid():
        apply(ids, form.cleaned_data)
        return None
    opts = modeladmin.model._meta
    context = {
        **modeladmin.admin_site.each_context(request),
        "title": title,
        "opts": opts,
        "form": form,
        "media": modeladmin.media + form.media,
        "action": request.POST.get("action", ""),
        "ids": ids,
        "preview": list(queryset.filter(pk__in=ids[:20])),
        "count": len(ids),
        "from_object": request.POST.get("_from_object", ""),
    }
    return TemplateResponse(request, "admin/durable/action_form.html", context)


def attempt(call: Callable[[], T]) -> T | DurableError:
    """Run one API call in its own savepoint; return its result or the error it raised.

    The API's calls are savepoint-less atomic blocks, so an error raised in one dooms
    the enclosing transaction (``ATOMIC_REQUESTS``): the savepoint confines it to the
    one row, and the action goes on with the others.
    """
    try:
        with transaction.atomic(using=get_settings().DATABASE):
            return call()
    except DurableError as exc:
        return exc


# -- display helpers ------------------------------------------------------------------


def ms_display(ms: int | None) -> str:
    """Epoch milliseconds as a local date-time with milliseconds ('-' for None).

    A bigint column can hold instants a ``datetime`` cannot (past 9999-12-31 or before
    year 1: old rows, raw SQL); those read "beyond 9999-12-31 (<ms> ms since epoch)"
    instead of failing the whole page.
    """
    if ms is None:
        return "-"
    when = local_instant(ms)
    if when is None:
        return out_of_range(ms)
    return when.strftime("%Y-%m-%d %H:%M:%S.") + f"{when.microsecond // 1000:03d}"


def local_instant(ms: int) -> datetime | None:
    """Epoch milliseconds as a datetime in the current time zone; None if out of range."""
    try:
        return timezone.localtime(ms_to_datetime(ms))
    except (OverflowError, ValueError):  # timedelta or datetime past their range
        return None


def out_of_range(ms: int) -> str:
    """The text shown for an instant ``datetime`` cannot hold."""
    side = "beyond 9999-12-31" if ms > 0 else "before 0001-01-01"
    return f"{side} ({ms} ms since epoch)"


def relative(ms: int | None, now_ms: int) -> str:
    """'in 5 min' / '3 s ago' for an instant in epoch milliseconds ('' if out of range)."""
    if ms is None or local_instant(ms) is None:
        return ""
    delta = (ms - now_ms) / 1000
    text = duration(abs(delta))
    return f"in {text}" if delta > 0 else f"{text} ago"


def duration(seconds: float) -> str:
    """A short human duration: '850 ms', '42 s', '5 min', '3 h', '2 d'."""
    if seconds < 1:
        return f"{int(seconds * 1000)} ms"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        value = round(seconds / size, 1)  # 3599.4 s reads "1 h", not "60 min"
        if value >= 1:
            return f"{value:g} {unit}"
    return f"{seconds:.0f} s"


def pretty_json(value: Any) -> str:
    """JSON in a <pre> block, for read-only payload fields."""
    if value is None:
        return "-"
    text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)
    return format_html('<pre class="durable-json">{}</pre>', text)


def short_json(value: Any, limit: int = 80) -> str:
    """JSON on one line, cut at ``limit`` characters, for list columns."""
    if value is None:
        return ""
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def local(dt: datetime | None) -> str:
    """An aware datetime in the current time zone, to the second ('-' for None).

    Near the ends of ``datetime``'s range the shift to local time can overflow; the
    UTC value is shown then.
    """
    if dt is None:
        return "-"
    try:
        dt = timezone.localtime(dt)
    except (OverflowError, ValueError):
        return dt.strftime("%Y-%m-%d %H:%M:%S %Z")
    return dt.strftime("%Y-%m-%d %H:%M:%S")
