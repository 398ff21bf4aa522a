"""Start-up discovery: import the modules that register what the worker may run.

The worker runs only what is registered: ``@durable.handler`` functions, workflows
(``@durable.workflow``, ``durable.Workflow`` subclasses), schedule functions
(``@durable.cron``, ``@durable.every``, ``DURABLE["CRONS"]``) and Django ``@task``\\ s on
a ``DurableBackend``. Registration happens when their module is imported, and
:func:`discover` imports, once at start-up:

- for every installed app (but Django's own), its modules named in :data:`MODULES` that exist
  (``handlers``, ``workflows``, ``crons``, ``tasks``), as Django's admin imports each
  app's ``admin`` and Celery each app's ``tasks``; an app's ``models`` module, and so
  workflows on model methods, is imported by Django anyway;
- every module listed in ``DURABLE["IMPORTS"]``, for code kept elsewhere;
- the function of every ``DURABLE["CRONS"]`` entry.

Everything it imports is named by code or settings, never by a row. Later, at fire time,
a timer's, schedule's, run's or task's stored name is only looked up, so a row that names
``sys.exit`` or ``unittest.__main__.x`` fails with a clear error and imports nothing.

Where it runs: the worker (:meth:`durable.worker.engine.Engine.start`) and
``run_durable_executor``, before they fire anything. Not in ``DurableConfig.ready()``:
that runs in every process (web servers, ``migrate``, shells), which would then import
every app's handler modules, and their imports, for nothing. Web processes import what
they use, and ``durable.schedule(fn)`` checks the handler is registered; reading a task
result from a process that never imported the task runs :func:`discover_once`.
"""

from __future__ import annotations

import importlib
import threading

from django.apps import apps
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import module_has_submodule

from durable.conf import DurableSettings, get_settings

#: The module names imported from every installed app, when the app has them.
MODULES = ("handlers", "workflows", "crons", "tasks")

_lock = threading.Lock()
_done = False


def discover(conf: DurableSettings | None = None) -> list[str]:
    """Import every installed app's :data:`MODULES` and ``DURABLE["IMPORTS"]``; register
    the ``CRONS`` functions. Return the names of the modules imported, in order.

    Idempotent (Python imports a module once). A module that exists but fails to import
    raises its error: a worker should not start without half of its handlers.
    """
    global _done
    conf = conf or get_settings()
    imported = []
    for app in apps.get_app_configs():
        if app.name == "durable" or app.name.startswith("django."):
            # durable's own modules are imported by DurableConfig.ready(); Django's own
            # apps hold no durable code (but do have unrelated ``handlers`` modules).
            continue
        for module in MODULES:
            if module_has_submodule(app.module, module):
                importlib.import_module(f"{app.name}.{module}")
                imported.append(f"{app.name}.{module}")
    if isinstance(conf.IMPORTS, str) or not isinstance(conf.IMPORTS, list | tuple):
        raise ImproperlyConfigured(
            f"DURABLE['IMPORTS']: expected a list of module names, got {conf.IMPORTS!r}"
        )
    for index, name in enumerate(conf.IMPORTS):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            raise ImproperlyConfigured(
                f"DURABLE['IMPORTS'][{index}]: cannot import {name!r} ({exc})"
            ) from exc
        imported.append(name)
    from durable.scheduling.cron import register_configured

    register_configured(conf.CRONS)
    with _lock:
        _done = True
    return imported


def discover_once() -> None:
    """Run :func:`discover` unless this process has already run it."""
    with _lock:
        if _done:
            return
    discover()
