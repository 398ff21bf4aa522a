"""Storage: the only package that runs ORM queries on durable's tables.

The rest of durable asks it in domain words (``claim_due(shard, ids, token)``), so every
query, its index and its locking live in one place.
"""
