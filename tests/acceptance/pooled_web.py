"""The web side through PgBouncer, run by test_pgbouncer.py as ``python -m`` in a process
whose ``DATABASE_URL`` is the pooled one: schedule(), a workflow start and the admin.

Prints one line, ``ok <port>``, naming the port Django connected to.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta


def main(prefix: str, count: int) -> None:
    """Schedule ``count`` timers and start one workflow, then read the admin's pages."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.db import connection, transaction
    from django.test import Client
    from django.test.utils import setup_test_environment
    from django.urls import reverse

    import durable
    from testproject.demo import probes
    from tests.acceptance import workflows as wf

    setup_test_environment()  # the test client's host name
    options = connection.settings_dict.get("OPTIONS") or {}
    assert options.get("prepare_threshold") is None, options  # preparing stays off
    with transaction.atomic():
        for i in range(count):
            durable.schedule(probes.record, args=[f"{prefix}{i}"], delay=timedelta(seconds=1))
    wf.three_steps.start(900)
    user = get_user_model().objects.create_superuser(f"{prefix}admin", "a@example.com", "x")
    client = Client()
    client.force_login(user)
    for name in ("timer", "workflowrun", "shardlease", "workernode", "cronschedule"):
        response = client.get(reverse(f"admin:durable_{name}_changelist"))
        assert response.status_code == 200, (name, response.status_code)
    response = client.get(reverse("admin:index"))
    assert response.status_code == 200, response.status_code
    print("ok", connection.get_connection_params()["port"])


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
