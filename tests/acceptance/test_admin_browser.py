"""The admin in a real browser: headless Chromium, driven by Playwright, against a live server.

A person's path through the admin: log in, list timers, filter them, cancel one and see
it gone from the pending list, reschedule one through the action's form, open a workflow
run and read its recorded steps, open the overview. The data is real: timers from
``durable.schedule``, a workflow run replayed by an in-process worker ``Engine``, which
also holds the shard leases the overview shows.

Needs Debian's ``chromium`` package and ``pip install playwright`` (never ``playwright
install``: the system browser is used). Without them the test is skipped, saying which
is missing. With ``DURABLE_SCREENSHOTS=docs/img`` it refreshes the documentation's
screenshots (``admin-*.png``); otherwise they go to the test's temporary directory.
"""

from __future__ import annotations

import importlib.util
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.db import connections

import durable
from durable.models import Timer, WorkflowRun
from durable.worker.engine import Engine
from testproject.demo import probes
from testproject.demo.models import Order
from testproject.demo.workflows import onboarding

CHROMIUM = Path(os.environ.get("DURABLE_CHROMIUM", "/usr/bin/chromium"))
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]

pytestmark = [
    pytest.mark.acceptance,
    pytest.mark.skipif(
        importlib.util.find_spec("playwright") is None,
        reason="needs the playwright Python package: pip install playwright",
    ),
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason=f"needs Chromium at {CHROMIUM}: apt-get install -y chromium",
    ),
]


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    """Where screenshots go: docs/img with DURABLE_SCREENSHOTS set, else a temp dir."""
    target = os.environ.get("DURABLE_SCREENSHOTS")
    return Path(target) if target else tmp_path


@pytest.fixture
def worker(transactional_db, settings):
    """A started worker engine on the real clock; it owns every shard for the test."""
    settings.DURABLE = {**settings.DURABLE, "SHARDS": 8, "LEASE_TTL_S": 600.0}
    engine = Engine(node="web-demo-worker", threads=1)
    engine.start()
    yield engine
    engine.shutdown()


def run_until(engine: Engine, predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "the worker did not get there in time"
        engine.tick()
        time.sleep(0.05)


@pytest.fixture
def page(live_server, monkeypatch):
    """A logged-in Chromium page on the live server's admin."""
    from playwright.sync_api import sync_playwright

    # Playwright's sync API keeps an event loop running in this thread; the test's own
    # ORM calls are ordinary synchronous ones, which Django would otherwise refuse.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    User.objects.create_superuser("ops", "ops@example.com", "correct horse")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        tab = browser.new_page(viewport={"width": 1440, "height": 900})
        tab.set_default_timeout(15_000)
        tab.goto(f"{live_server.url}/admin/login/")
        tab.fill("#id_username", "ops")
        tab.fill("#id_password", "correct horse")
        tab.click("input[type=submit]")
        tab.wait_for_selector("text=Site administration")
        tab.base = live_server.url  # type: ignore[attr-defined]
        yield tab
        browser.close()
        # ORM calls made while Playwright's loop ran used their own connection (Django
        # keys connections by async context); close it, or the test database cannot be
        # dropped at the end of the session.
        connections.close_all()


def test_operator_path_through_the_admin(worker, page, shots):
    durable.schedules.create("nightly-report", "testproject.demo.crons.record", cron="0 2 * * *")
    run = onboarding.start("ada@example.com")
    run_until(worker, lambda: WorkflowRun.objects.get(pk=run.pk).state == "sleeping")
    timers = [
        durable.schedule(probes.record, args=[f"invoice-{n}"], delay=_hours(n), key=f"invoice:{n}")
        for n in range(1, 6)
    ]
    failing = durable.schedule(probes.fail_until, args=["sync", 9], delay=_hours(9))
    Timer.objects.filter(pk=failing.pk).update(state="failed", attempts=3, last_error="boom")
    base = page.base

    # The timer list, then only the pending ones.
    page.goto(f"{base}/admin/durable/timer/")
    page.wait_for_selector("#result_list")
    page.screenshot(path=str(shots / "admin-timers.png"), full_page=True)
    page.click("#changelist-filter >> text=pending")
    page.wait_for_url("**state__exact=pending**")
    assert page.locator(f"input[name=_selected_action][value='{failing.pk}']").count() == 0

    # Cancel one: it leaves the pending list, and the message says so.
    victim = timers[0]
    page.check(f"input[name=_selected_action][value='{victim.pk}']")
    page.select_option("select[name=action]", "cancel_timers")
    page.click("button[name=index]")
    page.wait_for_selector(".messagelist >> text=Cancelled 1 timer.")
    assert page.locator(f"input[name=_selected_action][value='{victim.pk}']").count() == 0
    assert Timer.objects.get(pk=victim.pk).state == "canceled"

    # Reschedule another through the action's form.
    moved = timers[1]
    page.check(f"input[name=_selected_action][value='{moved.pk}']")
    page.select_option("select[name=action]", "reschedule")
    page.click("button[name=index]")
    page.wait_for_selector("#id_delay")
    page.fill("#id_delay", "1 00:00:00")
    page.screenshot(path=str(shots / "admin-reschedule.png"), full_page=True)
    page.click("input[type=submit][value='Reschedule timers']")
    page.wait_for_selector(".messagelist >> text=Rescheduled 1 timer.")
    replacement = Timer.objects.get(key="invoice:2")
    assert replacement.pk != moved.pk and replacement.fire_at_ms > moved.fire_at_ms

    # A workflow run and its recorded steps.
    page.goto(f"{base}/admin/durable/workflowrun/")
    page.click(f"#result_list >> text={run.pk}")
    page.wait_for_selector("text=steps (latest 50, newest first)")
    assert page.locator("td.field-name >> text=send_mail").count() >= 1
    assert page.locator("td.field-kind >> text=sleep").count() == 1
    page.screenshot(path=str(shots / "admin-run.png"), full_page=True)

    # Send it the signal it will wait for, from its own page; we come back to it.
    page.click("button[value=send_signal]")
    page.fill("#id_name", "first-order")
    page.fill("#id_payload", '{"order": 17}')
    page.click("input[type=submit][value='Send a signal']")
    page.wait_for_selector(".messagelist >> text=Sent 'first-order' to 1 workflow run.")
    assert page.locator("#signals-group td.field-name >> text=first-order").count() == 1

    page.goto(f"{base}/admin/durable/cronschedule/")
    page.wait_for_selector("#result_list >> text=nightly-report")
    page.screenshot(path=str(shots / "admin-schedules.png"), full_page=True)

    # The overview, from the app's index.
    page.goto(f"{base}/admin/durable/")
    page.click("#durable-overview-link >> text=Overview")
    page.wait_for_selector("h2 >> text=Shards")
    assert page.locator("td >> text=web-demo-worker").count() >= 8  # owner of every shard
    assert page.locator("text=boom").count() >= 1  # the failed timer needs attention
    page.screenshot(path=str(shots / "admin-overview.png"), full_page=True)


def test_a_runs_timeline(worker, page, shots):
    """A run drawn to scale on its page (the docs' admin-timeline.png), and a run bound
    to an order drawn on the order's page. Real worker, real clock: about 3 s of runs."""
    order = Order.objects.create(customer="ada", total_cents=4200)
    bound = order.fulfil.start()
    run = checkout.start("A-17")
    run_until(worker, lambda: WorkflowRun.objects.get(pk=run.pk).state == "waiting")
    time.sleep(0.5)  # the wait for the signal shows as a bar
    durable.send_signal(run.pk, "shipped", {"tracking": "<script>alert(1)</script>"})
    run_until(worker, lambda: WorkflowRun.objects.get(pk=run.pk).state == "completed")
    base = page.base

    page.goto(f"{base}/admin/demo/order/{order.pk}/change/")
    page.wait_for_selector(f"#timeline-{bound.pk}")
    page.goto(f"{base}/admin/durable/workflowrun/{run.pk}/change/")
    timeline = page.locator("fieldset.durable-runs")
    assert timeline.locator(".dt-row").count() == 2 + 5 + 1  # axis, run, 5 calls, 1 signal
    assert timeline.locator(".dt-bar.dt-failed").count() == 1  # the charge's first attempt
    sleep = timeline.locator(".dt-bar.dt-sleep").bounding_box()
    track = timeline.locator(".dt-track").nth(1).bounding_box()
    run = WorkflowRun.objects.get(pk=run.pk)
    total_s = (run.finished_at - run.created_at).total_seconds()
    assert sleep and track
    assert sleep["width"] / track["width"] == pytest.approx(1.0 / total_s, rel=0.1)
    timeline.screenshot(path=str(shots / "admin-timeline.png"))


def reserve(order: str) -> str:
    time.sleep(0.2)  # the work the timeline draws
    return order


def charge(order: str) -> str:
    time.sleep(0.1)
    if FLAKY.setdefault(order, 0) == 0:
        FLAKY[order] += 1
        raise ConnectionError("gateway timeout")
    return f"pay-{order}"


def mark_done(order: str) -> str:
    return order


FLAKY: dict[str, int] = {}


@durable.workflow(max_attempts=3)
def checkout(ctx, order: str) -> str:
    """Reserve, charge (fails once), sleep a second, wait for shipping, finish."""
    ctx.step(reserve, order)
    payment = ctx.step(charge, order)
    ctx.sleep(timedelta(seconds=1))
    ctx.wait_for_signal("shipped", timeout=timedelta(minutes=1))
    ctx.atomic(mark_done, order)
    return payment


def _hours(n: int):
    return timedelta(hours=n)
