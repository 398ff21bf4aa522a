"""The SQLite options durable needs, set on its database unless the project set them.

``django-admin startproject`` gives SQLite's defaults: deferred transactions, a 5 s busy
timeout and the rollback journal. A worker beside a web process (and the worker's own
loop beside its handler threads) then meets ``database is locked`` at once: a deferred
transaction that read and then writes cannot wait for the lock, so SQLite fails it. A
workflow's checkpoint failed that way, and the error's own bookkeeping after it, which
left the run ``running`` until its claim expired. So, on the SQLite database that holds
durable's rows, durable sets (only where the project's ``OPTIONS`` say nothing):

- ``transaction_mode = "IMMEDIATE"``: a transaction takes the write lock when it begins,
  and waits for it (Django's own advice for concurrent writers);
- ``timeout = 20``: how long it waits;
- ``PRAGMA journal_mode=WAL`` (through ``init_command``): readers do not block the writer.
  The journal mode is kept in the database file; ``synchronous`` stays SQLite's default
  (``FULL``), so a commit is on disk when it returns.
"""

from __future__ import annotations

from typing import Any

#: What durable sets on its SQLite database's ``OPTIONS`` unless they are set.
DEFAULT_OPTIONS: dict[str, Any] = {"transaction_mode": "IMMEDIATE", "timeout": 20}
WAL = "PRAGMA journal_mode=WAL;"


def apply_defaults(database: dict[str, Any]) -> bool:
    """Fill ``database["OPTIONS"]`` (a ``DATABASES`` entry) in place; True if SQLite.

    Called from ``DurableConfig.ready()``, before connections open (Django's connections
    read the same dict when they connect).
    """
    if not str(database.get("ENGINE", "")).endswith("sqlite3"):
        return False
    options = database.setdefault("OPTIONS", {})
    for key, value in DEFAULT_OPTIONS.items():
        options.setdefault(key, value)
    init = str(options.get("init_command", "") or "")
    if "journal_mode" not in init.lower():
        options["init_command"] = f"{WAL} {init}".strip()
    return True
