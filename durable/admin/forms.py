"""Forms of the admin actions that need input: reschedule a timer, send a signal."""

from __future__ import annotations

import json
import math
from datetime import timedelta
from typing import Any

from django import forms
from django.contrib.admin import widgets

from durable.workflows.calls import check_signal


class RescheduleForm(forms.Form):
    """When a timer should fire instead: at a date and time, or after a delay from now."""

    at = forms.SplitDateTimeField(
        required=False,
        label="Fire at",
        widget=widgets.AdminSplitDateTime,
        help_text="In the site's time zone.",
    )
    delay = forms.DurationField(
        required=False,
        label="or fire in",
        help_text='A delay from now: "00:05:00" is five minutes, "1 00:00:00" one day.',
    )

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        at, delay = data.get("at"), data.get("delay")
        if (at is None) == (delay is None):
            raise forms.ValidationError("Give either a date and time or a delay, not both.")
        if delay is not None and delay < timedelta(0):
            raise forms.ValidationError("The delay must not be negative.")
        return data


class SignalForm(forms.Form):
    """A signal for ``durable.send_signal``: its name and a JSON payload."""

    name = forms.CharField(max_length=200, help_text="The name the run waits for.")
    payload = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 4, "cols": 60}),
        help_text='JSON, e.g. {"order": 42}. Empty means null.',
    )

    def clean_name(self) -> str:
        name: str = self.cleaned_data["name"]
        try:
            check_signal(name)
        except (TypeError, ValueError) as exc:
            raise forms.ValidationError(str(exc)) from None
        return name

    def clean_payload(self) -> Any:
        text = self.cleaned_data.get("payload") or ""
        if not text.strip():
            return None
        try:
            return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
        except json.JSONDecodeError as exc:
            raise forms.ValidationError(f"Not valid JSON: {exc}") from None
        except _NotStrictJSON as exc:
            raise forms.ValidationError(f"Not strict JSON: {exc}") from None


class _NotStrictJSON(ValueError):
    """A payload uses what Python's ``json`` accepts but JSON does not (NaN, Infinity)."""


def _no_constant(name: str) -> Any:
    # Python's json reads NaN, Infinity and -Infinity; JSON has no such values, and a
    # payload holding them could not be stored in a JSON column or read by other tools.
    raise _NotStrictJSON(f"{name} is not a JSON value (payloads are strict JSON)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 reads as inf
        raise _NotStrictJSON(f"{text} is too large for a JSON number (it would read as infinity)")
    return value
