"""Settings of the DISPATCH = "kombu" acceptance test: the test project's, shipping handlers.

The broker comes from ``DURABLE_BROKER_URL`` (read by the test project's settings); the
workers claim and ship, ``run_durable_executor`` processes run the handlers.
"""

from testproject.settings import *  # noqa: F403
from testproject.settings import DURABLE

DURABLE = {**DURABLE, "DISPATCH": "kombu", "CLAIM_TIMEOUT_S": 5.0}
