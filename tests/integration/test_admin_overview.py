"""The overview page: sections by permission, capped counts (issue 18).

A user who may view shard leases opens the overview; each other section (timers, runs,
schedules, workers) shows only to users who may view that model, so the page never
reveals what the model's own pages would refuse. Counts on the timer table stop at a
limit and read "N+" past it (``test_admin_scale.py`` checks the page on a million rows).
"""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.urls import reverse
from django.utils import timezone

from durable.models import ShardLease, Timer, WorkerNode, WorkflowRun
from durable.storage import admin_queries
from testproject.demo.workflows import onboarding

from .test_admin import later, staff

pytestmark = pytest.mark.django_db
OVERVIEW = "admin:durable_overview"


@pytest.fixture
def cluster(clock):
    """A shard, a worker, a failed timer, a failed run: something for every section."""
    ShardLease.objects.create(shard=0, owner="w1", token=3)
    now = timezone.now()
    WorkerNode.objects.create(name="w1-node", host="h1", pid=42, started_at=now, heartbeat_at=now)
    failed = later()[0]
    Timer.objects.filter(pk=failed.pk).update(state="failed", last_error="handler exploded")
    run = onboarding.start("ada@example.com")
    WorkflowRun.objects.filter(pk=run.pk).update(state="failed", error="secret step error")
    return run


def test_a_leases_only_user_sees_the_shards_and_nothing_else(client, cluster):
    client.force_login(staff("view_shardlease"))
    assert (
        client.get(reverse("admin:durable_workflowrun_change", args=[cluster.pk])).status_code
        == 403
    )
    response = client.get(reverse(OVERVIEW))
    assert response.status_code == 200
    body = response.content.decode()
    assert "shards owned" in body and "w1" in body  # the shards section
    for hidden in (
        "secret step error",
        cluster.pk,
        "handler exploded",
        "failed runs",
        "failed timers",
        "timers pending",
        "w1-node",
        "Needs attention",
        "schedules on",
    ):
        assert hidden not in body, hidden
    assert response.context["show"] == {
        "timers": False,
        "runs": False,
        "schedules": False,
        "workers": False,
    }


def test_each_section_follows_its_view_permission(client, cluster):
    client.force_login(staff("view_shardlease", "view_timer", "view_workernode"))
    body = client.get(reverse(OVERVIEW)).content.decode()
    for shown in ("handler exploded", "failed timers", "timers pending", "w1-node"):
        assert shown in body, shown
    for hidden in ("secret step error", "failed runs", "schedules on"):
        assert hidden not in body, hidden


def test_the_overview_still_needs_the_lease_permission(client, cluster):
    client.force_login(staff("view_timer", "view_workflowrun"))
    assert client.get(reverse(OVERVIEW)).status_code == 403


def test_a_superuser_sees_every_section(client, cluster):
    client.force_login(User.objects.create_superuser("admin", "admin@example.com", None))
    body = client.get(reverse(OVERVIEW)).content.decode()
    for shown in ("secret step error", "handler exploded", "w1-node", "schedules on"):
        assert shown in body, shown


def test_failed_and_pending_counts_are_capped(client, clock, monkeypatch):
    monkeypatch.setattr(admin_queries, "COUNT_LIMIT", 3)
    monkeypatch.setattr(admin_queries, "MIN_SHARD_LIMIT", 2)
    ShardLease.objects.create(shard=0, owner="w1", token=1)
    ShardLease.objects.create(shard=1, owner="w2", token=1)
    timers = later(9)
    Timer.objects.filter(pk__in=[t.pk for t in timers[:5]]).update(state="failed")
    Timer.objects.filter(pk__in=[t.pk for t in timers[5:]]).update(shard=0)  # 4 pending
    client.force_login(User.objects.create_superuser("admin", "admin@example.com", None))
    response = client.get(reverse(OVERVIEW))
    failed = response.context["failed_timers"]
    assert (failed.count, failed.capped) == (3, True)
    shards = {s["shard"]: s for s in response.context["shards"]}
    # A budget of 3 over SHARDS shards is less than one each: the floor of 2 applies.
    assert response.context["pending_limit"] == 2
    assert (shards[0]["pending"], shards[0]["pending_capped"]) == (2, True)
    assert (shards[1]["pending"], shards[1]["pending_capped"]) == (0, False)
    assert response.context["pending"] == 2 and response.context["pending_capped"]
    body = response.content.decode()
    assert ">3+</a>" in body  # failed timers
    assert "2+" in body and "each shard counted up to 2" in body


def test_counts_below_the_cap_are_exact(client, clock):
    ShardLease.objects.create(shard=0, owner="w1", token=1)
    timers = later(3)
    Timer.objects.filter(pk__in=[t.pk for t in timers]).update(shard=0)
    Timer.objects.filter(pk=timers[0].pk).update(state="failed")
    client.force_login(User.objects.create_superuser("admin", "admin@example.com", None))
    response = client.get(reverse(OVERVIEW))
    assert response.context["failed_timers"].count == 1
    assert not response.context["failed_timers"].capped
    assert response.context["pending"] == 2 and not response.context["pending_capped"]
