"""Steps of the wheel smoke test that run inside the new project, one process each.

``driver.py`` copies this file into the project made by ``django-admin startproject`` and
runs ``python inproject.py <step>`` there, with the fresh virtualenv's Python, while the
worker runs in another process: the writes below are a web process's, beside a worker.
Each step prints one JSON line for the driver.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from typing import Any

RUN_ID = "smoke-run"
BURST = 200
LOAD_RUNS, LOAD_EXTERNAL = 100, 300


def schedule() -> dict[str, Any]:
    """Timers of each handler kind and a workflow run, in one transaction."""
    from datetime import timedelta

    from django.db import transaction
    from smokeapp import handlers, workflows

    import durable

    with transaction.atomic():
        ids = [
            durable.schedule(handlers.record, args=["atomic"], key="smoke:atomic").pk,
            durable.schedule(handlers.record_outside, args=["external"], key="smoke:ext").pk,
            durable.schedule(handlers.explode, args=["poison"], key="smoke:poison").pk,
            durable.schedule(
                handlers.record, args=["later"], delay=timedelta(days=30), key="smoke:later"
            ).pk,
        ]
        run = workflows.greet.start("durable", run_id=RUN_ID)
    return {"timers": ids, "run": run.pk}


def burst() -> dict[str, Any]:
    """BURST timers due now, each scheduled in its own transaction, as web requests do."""
    from smokeapp import handlers

    import durable

    for number in range(BURST):
        durable.schedule(handlers.record, args=["burst"], key=f"smoke:burst:{number}")
    return {"burst": BURST}


def load() -> dict[str, Any]:
    """LOAD_RUNS workflow runs and LOAD_EXTERNAL external timers, due at once."""
    from django.db import transaction
    from smokeapp import handlers, workflows

    import durable

    with transaction.atomic():
        workflows.greet.start_many(
            {"args": ["load"], "run_id": f"load-{number}"} for number in range(LOAD_RUNS)
        )
        for number in range(LOAD_EXTERNAL):
            durable.schedule(handlers.record_outside, args=["load"], key=f"smoke:load:{number}")
    return {"runs": LOAD_RUNS, "external": LOAD_EXTERNAL}


def state() -> dict[str, Any]:
    """What has run so far: rows the handlers wrote, timer states, the run's state."""
    from smokeapp.models import Fired

    from durable.models import Timer, WorkflowRun

    run = WorkflowRun.objects.filter(pk=RUN_ID).values("state", "wait_signal", "error").first()
    return {
        "fired": dict(Counter(Fired.objects.values_list("what", flat=True))),
        "timers": dict(Counter(Timer.objects.values_list("state", flat=True))),
        "run": run,
        "load_runs": dict(
            Counter(
                WorkflowRun.objects.filter(pk__startswith="load-").values_list("state", flat=True)
            )
        ),
    }


def signal() -> dict[str, Any]:
    """Send the signal the workflow waits for."""
    import durable

    sent = durable.send_signal(RUN_ID, "go", {"word": "hello"})
    return {"signal": sent.pk}


def admin() -> dict[str, Any]:
    """Every durable admin page, logged in as the superuser: each must answer 200."""
    from django.contrib import admin as django_admin
    from django.contrib.auth import get_user_model
    from django.test import Client
    from django.test.utils import setup_test_environment
    from django.urls import reverse

    setup_test_environment()  # lets the test client's host, "testserver", in
    client = Client(raise_request_exception=False)
    client.force_login(get_user_model().objects.get(username="admin"))
    urls = [reverse("admin:index"), reverse("admin:app_list", args=["durable"])]
    urls.append(reverse("admin:durable_overview"))
    rows: dict[str, int] = {}
    for model, model_admin in django_admin.site._registry.items():
        meta = model._meta
        if meta.app_label != "durable":
            continue
        prefix = f"admin:{meta.app_label}_{meta.model_name}"
        changelist = reverse(f"{prefix}_changelist")
        urls.append(changelist)
        if model_admin.search_fields:
            urls.append(f"{changelist}?q=smoke")
        # Rows in different states render differently: every row, up to 20 per model.
        pks = list(model._default_manager.order_by("-pk").values_list("pk", flat=True)[:20])
        rows[meta.model_name] = model._default_manager.count()
        urls += [reverse(f"{prefix}_change", args=[pk]) for pk in pks]
        urls += [reverse(f"{prefix}_history", args=[pk]) for pk in pks[:1]]
        if model_admin.has_add_permission(_request_as(client)):
            urls.append(reverse(f"{prefix}_add"))
    failures = {}
    for url in urls:
        response = client.get(url)
        if response.status_code != 200:
            failures[url] = f"{response.status_code}: {_error_of(response)}"
    return {"checked": urls, "rows": rows, "failures": failures}


def _request_as(client: Any) -> Any:
    # has_add_permission wants a request; one built for the logged-in user is enough.
    from django.contrib.auth import get_user_model
    from django.test import RequestFactory

    request = RequestFactory().get("/")
    request.user = get_user_model().objects.get(username="admin")
    return request


def _error_of(response: Any) -> str:
    exc = getattr(response, "exc_info", None)
    if exc and exc[1] is not None:
        return f"{type(exc[1]).__name__}: {exc[1]}"
    return response.content[:300].decode(errors="replace")


STEPS = {
    "schedule": schedule,
    "burst": burst,
    "load": load,
    "state": state,
    "signal": signal,
    "admin": admin,
}

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "smokesite.settings")
    import django

    django.setup()
    print(json.dumps(STEPS[sys.argv[1]](), default=str))
