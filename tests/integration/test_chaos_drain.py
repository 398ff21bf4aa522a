"""The chaos run's drain waits for every timer the load committed, not only the due ones.

Seed 20261203 stopped the workers while a timer committed in the load's last seconds
was not due yet; the checker then reported it lost. :func:`chaos.run.settled` must not
call that settled.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

import durable
from chaos.run import settled
from durable.models import Timer, TimerKind
from testproject.demo import handlers as h

pytestmark = pytest.mark.django_db(transaction=True)


def test_nothing_left_is_settled():
    assert settled()


def test_a_timer_not_due_yet_is_not_settled():
    durable.schedule(h.noop, delay=timedelta(seconds=5))
    assert not settled()


def test_a_firing_timer_is_not_settled():
    timer = durable.schedule(h.noop)
    Timer.objects.filter(pk=timer.pk).update(state="firing")
    assert not settled()


def test_the_schedules_next_occurrences_do_not_hold_the_drain():
    timer = durable.schedule(h.noop, delay=timedelta(seconds=5))
    Timer.objects.filter(pk=timer.pk).update(kind=TimerKind.CRON)
    fired = durable.schedule(h.noop)
    Timer.objects.filter(pk=fired.pk).update(state="fired")
    assert settled()
