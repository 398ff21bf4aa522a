"""Settings of the workflow acceptance tests' workers: the test project's, claims of 3 s.

A worker killed mid-replay leaves the run's wake-up timer claimed (state ``firing``)
until the claim expires, and only then does another worker replay the run. With the
default ``CLAIM_TIMEOUT_S`` (300 s) the crash tests would wait five minutes.
"""

from testproject.settings import *  # noqa: F403
from testproject.settings import DURABLE

DURABLE = {**DURABLE, "CLAIM_TIMEOUT_S": 3.0}
