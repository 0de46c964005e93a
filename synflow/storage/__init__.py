"""synflow's storage layer.

- :mod:`synflow.storage.engines` -- the database config, the SQLite and
  PostgreSQL engines, the :class:`~synflow.storage.engines.Txn` handed to
  ``_txn`` functions and the :class:`~synflow.storage.engines.Database` pool.
- :mod:`synflow.storage.prepare` -- versioned schema migrations (applied by
  the master) and the wait for them (by workers).
- ``schema/`` -- synflow's migration files.

Stores (events, rooms, destinations, caches, audit) and stream ID generators
are built on :class:`~synflow.storage.engines.Database`. See ``docs/storage.md``.
"""
