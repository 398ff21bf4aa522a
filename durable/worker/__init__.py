"""The ``run_timer_shards`` worker: leases, shard runners, firing, the main loop."""
