"""synflow's built-in worker types, one module each.

They are registered like any plugin, in the ``synflow.apps`` entry point
group of ``setup.cfg``, and built on :class:`~synflow.framework.WorkerType`:

* :mod:`~synflow.worker_types.master` -- ``master``;
* :mod:`~synflow.worker_types.event_persister` -- ``event_persister``;
* :mod:`~synflow.worker_types.federation_sender` -- ``federation_sender``;
* :mod:`~synflow.worker_types.cache_invalidator` -- ``cache_invalidator``.

What they share (rooms, caches, the client API, inbound federation) is in
the internal module ``_homeserver``.

Internal to synflow: not part of the public API (``synflow.api``).
"""
