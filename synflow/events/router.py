"""Routing event writes to the persister that owns each room.

Any process may accept an event; :class:`EventRouter` sends it to the room's
owner (``shard_for(room_id, stream_writers.events)``): directly when this
process is that persister, over internal RPC (``persist_events``) otherwise.
The RPC layer carries stream positions both ways, so when ``persist``
returns, this process has seen the events it persisted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from synflow.errors import HttpApiError
from synflow.events.persist import EventPersister, EventSpec, PersistResult
from synflow.replication.rpc import RpcClient, RpcServer
from synflow.sharding import shard_for


class EventRouter:
    """Sends events to their rooms' persisters and collects the results in order."""

    def __init__(self, instance_name: str, event_writers: Sequence[str], persister: EventPersister | None,
                 rpc: RpcClient | None) -> None:
        self.instance_name = instance_name
        self.event_writers = list(event_writers)
        self.persister = persister
        self.rpc = rpc

    def owner_of(self, room_id: str) -> str:
        return shard_for(room_id, self.event_writers)

    async def persist(self, specs: list[EventSpec]) -> list[PersistResult]:
        by_owner: dict[str, list[int]] = {}
        for i, spec in enumerate(specs):
            by_owner.setdefault(self.owner_of(spec.room_id), []).append(i)
        results: list[PersistResult | None] = [None] * len(specs)
        for owner, indexes in by_owner.items():
            batch = [specs[i] for i in indexes]
            if owner == self.instance_name and self.persister is not None:
                got = await self.persister.persist(batch)
            else:
                if self.rpc is None:
                    raise HttpApiError(502, "M_UNKNOWN", f"cannot reach event persister {owner!r}")
                raw = await self.rpc.call(owner, "persist_events", {"events": [s.to_json() for s in batch]})
                got = [PersistResult.from_json(r) for r in raw]
            for i, result in zip(indexes, got, strict=True):
                results[i] = result
        return [r for r in results if r is not None]


def serve_persist(server: RpcServer, persister: EventPersister) -> None:
    """Expose ``persist_events`` on this persister's internal listener."""

    async def persist_events(args: Any) -> Any:
        events = args.get("events") if isinstance(args, dict) else None
        if not isinstance(events, list) or not events or not all(isinstance(e, dict) for e in events):
            raise HttpApiError(400, "M_BAD_JSON", "persist_events needs a non-empty list of events")
        specs = [EventSpec.from_json(e) for e in events]
        results = await persister.persist(specs)
        return [r.to_json() for r in results]

    server.register("persist_events", persist_events)
