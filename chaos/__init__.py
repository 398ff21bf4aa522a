"""The chaos run: a real workload, a nemesis and a history checker (``make chaos``).

Not part of the shipped package. ``python -m chaos`` (:mod:`chaos.run`) starts worker
processes and the load generator (:mod:`chaos.load`) against a PostgreSQL database of its
own, lets the nemesis (:mod:`chaos.nemesis`) break things at seeded random times, drains,
and hands the history, the ledger and the tables to the checker (:mod:`chaos.checker`),
whose verdict :mod:`chaos.report` prints.
"""
