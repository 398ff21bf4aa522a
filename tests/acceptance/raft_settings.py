"""Settings of the Raft acceptance tests and ``bench/failover.py``: the test project's, Raft on.

Every node of a cluster shares this module; each passes its own ``--raft-self`` (and
``--raft-bind`` behind the test proxy). Read from the environment (set by the harness):

- ``DURABLE_RAFT_PEERS``: comma-separated base addresses of every node (``host:port``).
- ``DURABLE_RAFT_PASSWORD``: the cluster's password.
- ``DURABLE_RAFT_TICK_S``, ``DURABLE_RAFT_HEARTBEAT_S``, ``DURABLE_RAFT_ELECTION_TIMEOUT_S``
  (``min,max``): tuning, when a run sets them; durable's defaults otherwise.
"""

from testproject.settings import *  # noqa: F403
from testproject.settings import DURABLE, env

_peers = env.list("DURABLE_RAFT_PEERS")
RAFT = {"SELF": _peers[0], "PEERS": _peers[1:], "PASSWORD": env.str("DURABLE_RAFT_PASSWORD")}
for _key in ("TICK_S", "HEARTBEAT_S"):
    if env.str(f"DURABLE_RAFT_{_key}", default=""):
        RAFT[_key] = env.float(f"DURABLE_RAFT_{_key}")
if env.str("DURABLE_RAFT_ELECTION_TIMEOUT_S", default=""):
    RAFT["ELECTION_TIMEOUT_S"] = tuple(env.list("DURABLE_RAFT_ELECTION_TIMEOUT_S", cast=float))

DURABLE = {**DURABLE, "RAFT": RAFT}
