"""The ``event_persister`` worker type: persists the events of the rooms that shard to it.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

from synflow.streams import EVENTS
from synflow.worker_types._homeserver import Homeserver

__all__ = ["EventPersisterWorker"]


class EventPersisterWorker(Homeserver):
    """A writer of the ``events`` stream; must be listed in ``stream_writers.events``.

    Its persister (``persist_events`` over internal RPC) is set up by the
    shared base for every process listed there, the master included.
    """

    name = "event_persister"
    summary = "persists the events of the rooms that shard to it (stream_writers.events)"
    writes = (EVENTS,)
