"""durable's pytest plugin (entry point ``pytest11``): the ``durable_time_machine`` fixture.

pytest loads it wherever django-durable is installed. It imports nothing of Django or
of durable's engine until a test asks for the fixture, so it costs nothing elsewhere.
The fixture is named ``durable_time_machine``, not ``time_machine``, which is the fixture
of the popular ``time-machine`` package (that one moves ``datetime.now``; this one moves
durable's clock and runs its engine).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from durable.testing.travel import TimeMachine


@pytest.fixture
def durable_time_machine(db: Any) -> Iterator[TimeMachine]:
    """A :class:`~durable.testing.travel.TimeMachine` for the test: durable's real engine in
    the test's database on a manual clock (``durable_time_machine.advance(days=30)``).

    Requests pytest-django's ``db``; mark the test ``django_db(transaction=True)`` (or ask
    for ``transactional_db``) to run it outside a wrapping transaction instead.
    """
    from durable.testing.travel import time_machine

    with time_machine() as machine:
        yield machine
