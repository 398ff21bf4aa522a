"""Durable by default: nothing durable reports done commits asynchronously unless
``ASYNC_COMMIT`` opts in (PostgreSQL; other databases have no such switch)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
from django.db import connection

import durable
from durable.workflows.resume import resume_once
from testproject.demo import probes
from testproject.demo.workflows import ten_steps
from tests.integration.test_poison import SETTINGS, load, turns

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres]

ASYNC = "set_config('synchronous_commit', 'off', true)"


@contextmanager
def statements():
    """Every statement this thread's connection runs, as written (prepared ones too)."""
    seen: list[str] = []

    def keep(execute, sql, params, many, context):
        seen.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(keep):
        yield seen


def _replay_statements() -> list[str]:
    """A run replayed to its end in this thread: its checkpoints' statements."""
    run = ten_steps.start(start=1)
    with statements() as sql:
        assert resume_once(run.pk) == "completed"
    return sql


def test_checkpoints_and_claims_commit_synchronously_by_default(start_engine, clock):
    engine = start_engine(dict(SETTINGS))
    durable.schedule(probes.record_external, args=["claim-only"])
    load(engine, clock)
    with statements() as sql:
        turns(engine, clock, n=2)  # a batch that only claims
    claims = [s for s in sql if "claim_token = (" in s and "claim_expires_ms = %s" in s]
    assert claims, sql
    counts = [s for s in sql if "attempts = attempts + 1" in s]
    assert counts, "the attempt counts ran on the loop's connection"
    # Only the attempt counts commit asynchronously: they report nothing done.
    assert [s for s in sql if ASYNC in s and s not in counts] == []
    checkpoints = _replay_statements()
    assert len(checkpoints) >= 10 and not any(ASYNC in s for s in checkpoints)


def test_async_commit_opts_in(settings):
    settings.DURABLE = {**SETTINGS, "ASYNC_COMMIT": True}
    checkpoints = _replay_statements()
    assert sum(ASYNC in s for s in checkpoints) >= 10
