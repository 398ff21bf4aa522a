"""Raft beside the leases (``DURABLE["RAFT"]``, off by default; DESIGN 5a).

One Raft group per shard across the worker nodes decides, fast, who should own a shard
next and keeps that node's wheel warm; the database stays the truth and the lease token
the fence. :mod:`durable.raft.config` reads the settings, :mod:`durable.raft.groups` runs
the groups (the worker's interface), :mod:`durable.raft.state` is what they replicate,
:mod:`durable.raft.standby` a follower's standby, :mod:`durable.raft.transport` the network.
"""
