"""The transaction-aware public API for timers: ``schedule``, ``schedule_many``, ``cancel``
(in :mod:`durable.scheduling.api`) and the ``@durable.handler`` decorator (in
:mod:`durable.scheduling.handlers`).

Deliberately empty of imports: handler modules apply ``@durable.handler`` while Django
loads apps, before models can be imported, and only :mod:`.handlers` is safe then.
"""
