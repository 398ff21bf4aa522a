"""Drive durable, installed from its wheel, in a new ``django-admin startproject``.

Run by ``scripts/wheel_smoke.sh`` with the Python of a fresh virtualenv that holds the
wheel and its dependencies only (no dev extras, no checkout on ``sys.path``):

    python driver.py WORKDIR

In ``WORKDIR`` (outside the checkout) it makes a project with the settings
``startproject`` writes (its SQLite database, no ``DURABLE`` settings) plus ``durable``
and a small app (``smokeapp``) in ``INSTALLED_APPS``, then: migrate, a superuser, the
worker (``run_timer_shards``) in the background while another process schedules timers,
starts a workflow and signals it; every timer kind fires, the workflow completes, the
worker stops on SIGTERM with status 0; every durable admin page answers 200;
``durable_status`` answers. Prints each check; exits 1 at the first failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CHECKOUT = HERE.parents[1]
BIN = Path(sys.executable).parent
DEADLINE_S = 60  # for the worker to fire everything; it takes a few seconds
# On startproject's SQLite settings (rollback journal, deferred transactions) a worker
# beside another writing process met "database is locked", and workflows stalled for
# CLAIM_TIMEOUT_S. durable now sets IMMEDIATE transactions, a busy timeout and WAL on its
# SQLite database (durable.storage.sqlite): a lock error in the worker's log is a failure.
LOCKED_FAILS = True


class SmokeFailure(Exception):
    """A check failed; the message says which and why."""


def ok(message: str) -> None:
    print(f"ok    {message}", flush=True)


def run(args: list[str], cwd: Path, timeout: float = 120) -> str:
    """Run a command in the project; its output, or SmokeFailure with its output."""
    result = subprocess.run(
        args, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )
    if result.returncode != 0:
        raise SmokeFailure(
            f"{' '.join(args)} exited {result.returncode}\n{result.stdout}{result.stderr}"
        )
    return result.stdout


def step(project: Path, name: str) -> Any:
    """Run ``inproject.py <name>`` in the project; its JSON answer."""
    out = run([sys.executable, "inproject.py", name], project)
    return json.loads(out.strip().splitlines()[-1])


def check_installed() -> None:
    spec = importlib.util.find_spec("durable")
    if spec is None or spec.origin is None:
        raise SmokeFailure("durable is not importable in the virtualenv")
    package = Path(spec.origin).parent
    if CHECKOUT in package.parents or not package.is_relative_to(sys.prefix):
        raise SmokeFailure(f"durable imports from {package}, not from the virtualenv")
    templates = sorted(p.name for p in (package / "templates").rglob("*.html"))
    if "overview.html" not in templates:
        raise SmokeFailure(f"the installed package has no admin templates: {templates}")
    ok(f"durable installed in {package} with {len(templates)} templates")


def make_project(work: Path) -> Path:
    project = work / "site"
    project.mkdir()
    run([str(BIN / "django-admin"), "startproject", "smokesite", str(project)], work)
    shutil.copytree(HERE / "smokeapp", project / "smokeapp")
    shutil.copy(HERE / "inproject.py", project / "inproject.py")
    settings = project / "smokesite" / "settings.py"
    with settings.open("a") as f:
        f.write('\nINSTALLED_APPS += ["durable", "smokeapp"]\n')
    python = sys.executable
    run([python, "manage.py", "makemigrations", "smokeapp"], project)
    run([python, "manage.py", "check"], project)
    run([python, "manage.py", "migrate", "--noinput"], project)
    ok("startproject, durable in INSTALLED_APPS, default settings: check and migrate pass")
    env = {
        **os.environ,
        "DJANGO_SUPERUSER_PASSWORD": "smoke-password",
        "DJANGO_SUPERUSER_EMAIL": "admin@example.com",
    }
    result = subprocess.run(
        [python, "manage.py", "createsuperuser", "--noinput", "--username", "admin"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if result.returncode != 0:
        raise SmokeFailure(f"createsuperuser failed:\n{result.stdout}{result.stderr}")
    ok("createsuperuser")
    return project


def wait_for(
    project: Path, worker: subprocess.Popen[bytes], done: Any, what: str
) -> dict[str, Any]:
    """Poll the project's state until ``done(state)``; SmokeFailure after the deadline
    or as soon as the worker has exited."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        current = step(project, "state")
        if done(current):
            return current
        if worker.poll() is not None:
            raise SmokeFailure(f"{what}: the worker exited {worker.returncode}; state {current}")
        if time.monotonic() > deadline:
            stuck = current["timers"].get("firing")
            hint = (
                f" ({stuck} timers stuck 'firing': a replay or completion failed, see the"
                " worker's log; they wait for CLAIM_TIMEOUT_S)"
                if stuck
                else ""
            )
            raise SmokeFailure(f"{what}: not done after {DEADLINE_S} s{hint}; state {current}")
        time.sleep(0.5)


def fire_with_worker(project: Path, logs: Path) -> None:
    out, err = (logs / "worker.out").open("w"), (logs / "worker.err").open("w")
    worker = subprocess.Popen(
        [sys.executable, "manage.py", "run_timer_shards", "--duration", "150"],
        cwd=project,
        stdout=out,
        stderr=err,
    )
    try:
        scheduled = step(project, "schedule")
        ok(f"scheduled 4 timers and workflow run {scheduled['run']} while the worker runs")
        state = wait_for(
            project,
            worker,
            lambda s: (
                {"atomic", "external", "workflow-started:durable", "cron"} <= set(s["fired"])
                and s["timers"].get("failed") == 1
                and (s["run"] or {}).get("state") == "waiting"
            ),
            "atomic, external and cron handlers fire, poison timer fails, run waits",
        )
        ok(f"worker fired: {state['fired']}; timers {state['timers']}")
        burst = step(project, "burst")["burst"]
        state = wait_for(
            project,
            worker,
            lambda s: s["fired"].get("burst") == burst,
            f"{burst} timers scheduled one transaction each while the worker fires them",
        )
        ok(f"{burst} timers scheduled in {burst} transactions beside the worker all fired once")
        step(project, "signal")
        state = wait_for(
            project,
            worker,
            lambda s: (s["run"] or {}).get("state") == "completed",
            "the workflow completes after its signal",
        )
        if state["fired"].get("workflow-done:hello") != 1:
            raise SmokeFailure(f"workflow completed without its last write: {state}")
        ok("signal sent from another process; the workflow ran its step, sleep and completed")
        if os.environ.get("DURABLE_SMOKE_LOAD", "1") == "1":
            check_load(project, worker)
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(timeout=30)
        if code != 0:
            raise SmokeFailure(f"worker exited {code} after SIGTERM")
        ok("worker stopped on SIGTERM with status 0")
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        out.close()
        err.close()
        locked = (logs / "worker.err").read_text().count("database is locked")
        if locked and LOCKED_FAILS:
            raise SmokeFailure(f"'database is locked' {locked} times in the worker's log")
        if locked:
            print(f"WARN  the worker logged 'database is locked' {locked} times (it retried)")


def check_load(project: Path, worker: subprocess.Popen[bytes]) -> None:
    """Workflow replays and external handlers at once: the worker's own threads write
    together (on by default; DURABLE_SMOKE_LOAD=0 skips it). On startproject's SQLite
    settings, before durable set its own options there, some replays and completions
    failed with "database is locked" and their timers stayed ``firing`` until
    CLAIM_TIMEOUT_S."""
    sent = step(project, "load")
    state = wait_for(
        project,
        worker,
        lambda s: (
            s["load_runs"].get("waiting") == sent["runs"]
            and s["fired"].get("load") == sent["external"]
            and not s["timers"].get("firing")
        ),
        f"{sent['runs']} workflow runs and {sent['external']} external timers at once",
    )
    ok(f"load: {state['load_runs']} runs, {state['fired']['load']} external timers fired")


def check_admin(project: Path) -> None:
    answer = step(project, "admin")
    if answer["failures"]:
        failures = "\n".join(f"  {url} -> {why}" for url, why in answer["failures"].items())
        raise SmokeFailure(f"admin pages did not answer 200:\n{failures}")
    ok(f"{len(answer['checked'])} admin pages answer 200 (rows: {answer['rows']})")
    for url in answer["checked"]:
        print(f"        {url}")


def check_status(project: Path) -> None:
    text = run([sys.executable, "manage.py", "durable_status"], project)
    data = json.loads(run([sys.executable, "manage.py", "durable_status", "--json"], project))
    ok(f"durable_status answers ({len(text.splitlines())} lines; --json keys {sorted(data)})")


def main() -> int:
    work = Path(sys.argv[1]).resolve()
    if work == CHECKOUT or CHECKOUT in work.parents:
        print(f"FAIL  {work} is inside the checkout {CHECKOUT}")
        return 1
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        check_installed()
        project = make_project(work)
        fire_with_worker(project, logs)
        check_admin(project)
        check_status(project)
    except (SmokeFailure, subprocess.TimeoutExpired) as failure:
        print(f"FAIL  {failure}")
        for name in ("worker.out", "worker.err"):
            path = logs / name
            if path.exists() and path.read_text().strip():
                print(f"---- {name} (last 4000 characters)\n{path.read_text()[-4000:]}")
        return 1
    print(f"wheel smoke test passed in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
