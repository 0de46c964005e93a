"""synflow's storage layer.

- :mod:`synflow.storage.engines` -- the database config, the SQLite and
  PostgreSQL engines, the :class:`~synflow.storage.engines.Txn` handed to
  ``_txn`` functions and the :class:`~synflow.storage.engines.Database` pool.
- :mod:`synflow.storage.prepare` -- versioned schema migrations (applied by
  the master) and the wait for them (by workers).
- :mod:`synflow.storage.sources` -- the catch-up source of each stream:
  one writer's missed rows, paged from the stream's table.
- ``schema/`` -- synflow's migration files.

Stores (events, rooms, destinations, caches, audit) and stream ID generators
are built on :class:`~synflow.storage.engines.Database`. See ``docs/storage.md``.

Internal to synflow: not part of the public API (``synflow.api``).
"""
