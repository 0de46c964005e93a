"""What every built-in worker type shares: one Matrix-style server's rooms, caches, client API and inbound federation.

Internal to synflow (not part of :mod:`synflow.api`). Every process of the
default deployment gets:

* the stores and the per-process caches, invalidated by the ``caches``
  stream and by membership changes on the ``events`` stream, and the shared
  cache tier when ``caches.tier`` is set;
* an event persister for the rooms it owns if it is listed in
  ``stream_writers.events`` (``persist_events`` over internal RPC);
* the event router and the sync handler;
* the client API on a ``client`` listener and inbound federation (behind the
  signature check) on a ``federation`` listener, where the config names them.

Each built-in worker type adds its own role in :meth:`Homeserver.build_role`.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

from twisted.internet.defer import Deferred

from synflow.caching import CacheRegistry, open_tier, tier_prefix
from synflow.config import HostPort
from synflow.events.persist import EventPersister, PersistResult
from synflow.events.router import EventRouter, serve_persist
from synflow.events.shards import FEDERATION_GROUP, RELOAD_RPC, ShardFollower, ShardState
from synflow.events.sync import SyncHandler
from synflow.federation.auth import (
    FEDERATION_PREFIX,
    FEDERATION_SEND_PREFIX,
    KEY_PATH,
    FederationAuthResource,
    ServerKeyResource,
    require_origin,
)
from synflow.federation.edus import EduQueue
from synflow.federation.keyring import KeyRing, pinned_keys
from synflow.federation.keys import load_or_create_signing_key
from synflow.federation.missing_events import (
    GET_MISSING_EVENTS_PREFIX,
    MissingEventsResource,
    SqlMissingEventsStore,
)
from synflow.federation.transport import TreqFederationTransport
from synflow.federation.worker import inbound_handler
from synflow.framework import ProcessContext, WorkerType
from synflow.http.client_api import PREFIX as CLIENT_PREFIX
from synflow.http.client_api import ClientApi
from synflow.listeners import serving
from synflow.storage.stores import DataStore
from synflow.streams import EVENTS
from synflow.tokens import StreamToken

logger = logging.getLogger(__name__)


class Homeserver(WorkerType):
    """The shared base of the built-in worker types (see the module docstring)."""

    #: Whether this type signs outbound federation requests even without a ``federation`` listener.
    signs_federation: bool = False

    ctx: ProcessContext
    store: DataStore
    persister: EventPersister | None = None
    router: EventRouter
    shards: ShardFollower
    #: Destinations over federation senders (None when ``federation_sender_instances`` is empty).
    sender_shards: ShardFollower | None
    sync: SyncHandler | None
    client_api: ClientApi | None = None
    federation_inbound: Any = None
    missing_events: MissingEventsResource | None = None
    edu_queue: EduQueue | None = None
    signing_key: Any = None
    keyring: KeyRing

    async def build(self, ctx: ProcessContext) -> None:
        self.ctx = ctx
        config = ctx.config
        me = config.instance_name
        event_writers = config.writers_of(EVENTS)
        await ctx.instances.ids_for(sorted(ctx.handler.positions(EVENTS.name)))
        self.store = DataStore(ctx.db)
        self.setup_caches(ctx)
        #: Writers counted from an epoch's floor and not yet heard from, by the position they were counted at.
        self._joined_at: dict[str, int] = {}
        self.shards = ShardFollower(ctx.db, event_writers, ctx.clock, on_state=self.follow_shards)
        await self.shards.reload()

        self.sender_shards = None
        if config.federation_sender_instances:
            self.sender_shards = ShardFollower(ctx.db, config.federation_sender_instances, ctx.clock,
                                               group=FEDERATION_GROUP)
            await self.sender_shards.reload()

        async def reload_shards(args: Any) -> Any:
            state = await self.shards.reload()
            answer: dict[str, Any] = {"epoch": state.current.epoch,
                                      "pending": None if state.pending is None else state.pending.epoch}
            if self.sender_shards is not None:
                senders = await self.sender_shards.reload()
                await self.settle_shards()
                answer[FEDERATION_GROUP] = {"epoch": senders.current.epoch,
                                            "pending": None if senders.pending is None else senders.pending.epoch}
            return answer

        ctx.rpc.register(RELOAD_RPC, reload_shards)
        if me in event_writers or me in self.shards.state.writers() or EVENTS.name in ctx.writers.generators:
            self.persister = EventPersister(
                ctx.writers, server_name=config.server_name, instance_name=me,
                event_writers=event_writers, clock=ctx.clock, new_event_id=self.new_event_id,
                follower=self.shards,
            )
            serve_persist(ctx.rpc, self.persister)
            ctx.add_drain(self.persister.drain)
        self.router = EventRouter(me, event_writers, self.persister, ctx.rpc_client, ctx.clock,
                                  follower=self.shards, max_wait_s=config.limits.reshard_max_wait_s)
        # Sync is the client API's: a process without it (a persister, a sender) does not follow rows for it.
        self.sync = (SyncHandler(self.store, ctx.handler, ctx.instances, ctx.clock, ctx.audit)
                     if serving(config, "client") is not None else None)
        if serving(config, "federation") is not None or self.signs_federation:
            self.signing_key = load_or_create_signing_key(config.signing_key_file)
        if serving(config, "federation") is not None:
            self.setup_federation_inbound(ctx)
        await self.build_role(ctx)
        if self.sync is not None:
            self.client_api = ClientApi(config.server_name, self.store, self.sync, self.router.persist,
                                        self.event_position, ctx.clock, config.limits, queue_edus=self.queue_edus)
            ctx.listen("client", CLIENT_PREFIX, self.client_api)

    async def build_role(self, ctx: ProcessContext) -> None:
        """What this worker type adds (subclasses)."""

    async def settle_shards(self) -> None:
        """Once the maps are reloaded: finish what a hand-over needs of this process before it answers
        (a federation sender stops the queues of the destinations it gives away)."""

    def follow_shards(self, state: ShardState) -> None:
        """A new shard map: count its new writers from the epoch's floor, and learn their addresses."""
        writers = state.writers()
        for writer in sorted(writers):
            at = max(1, state.floor)
            if self.ctx.handler.add_writer(EVENTS.name, writer, at):
                self._joined_at[writer] = at
                logger.info("events writer %s joins this process's view at %d", writer, at)
        for writer, at in list(self._joined_at.items()):
            if writer not in writers:  # its hand-over was rolled back
                del self._joined_at[writer]
                if self.ctx.handler.remove_writer(EVENTS.name, writer, at):
                    logger.info("events writer %s leaves this process's view (its epoch was rolled back)", writer)
        for writer, (host, port) in state.addresses.items():
            self.ctx.rpc_client.instance_map.setdefault(writer, HostPort(host, port))
        for writer in sorted(set(self.ctx.handler.positions(EVENTS.name)) - writers):
            # Removed: it can commit nothing more, but it may have died before announcing what it
            # committed last. Read that from the database, so no sync misses it.
            Deferred.fromCoroutine(self.catch_up_removed(writer)).addErrback(_log_catch_up_failure, writer)

    async def catch_up_removed(self, writer: str) -> None:
        """Apply the events a removed writer committed, up to its last, from the database."""
        rows = await self.ctx.db.run_interaction(
            "removed_writer_max", _max_event_txn, writer, read_only=True, idempotent=True)
        if rows is not None:
            await self.ctx.handler.catch_up_writer(EVENTS.name, writer, rows)

    def setup_federation_inbound(self, ctx: ProcessContext) -> None:
        """Inbound ``/send`` and ``get_missing_events`` behind the signature check, and the key server."""
        config = ctx.config
        allowed = self.allowed_origins()
        client = TreqFederationTransport.from_config(ctx.reactor, config.federation,
                                                     server_name=config.server_name, signing_key=self.signing_key)
        self.keyring = KeyRing(client.get_server_keys, ctx.clock, pinned_keys(config.federation.trusted_keys))
        self.federation_inbound = inbound_handler(
            ctx.db, self.router, ctx.handler,
            allowed_origins=allowed,
            max_body_bytes=config.federation.max_body_bytes, max_json_depth=config.limits.max_json_depth,
            clock=ctx.clock,
            missing_events=client,
        )
        self.missing_events = MissingEventsResource(
            SqlMissingEventsStore(ctx.db, config.server_name), allowed_origins=allowed,
            max_json_depth=config.limits.max_json_depth, origin_of=require_origin,
        )
        endpoints = {FEDERATION_SEND_PREFIX: self.federation_inbound.resource(origin_of=require_origin),
                     GET_MISSING_EVENTS_PREFIX: self.missing_events}
        ctx.listen("federation", FEDERATION_PREFIX,
                   FederationAuthResource(config.server_name, self.keyring, endpoints, allowed))
        ctx.listen("federation", KEY_PATH, ServerKeyResource(config.server_name, self.signing_key, ctx.clock))

    def allowed_origins(self) -> list[str]:
        """``federation.allowed_origins``, else the servers listed in ``federation.destinations``."""
        federation = self.ctx.config.federation
        return federation.allowed_origins if federation.allowed_origins is not None else sorted(federation.destinations)

    def setup_caches(self, ctx: ProcessContext) -> None:
        """Per-process caches, the shared tier (if configured), and their invalidation."""
        config = ctx.config
        self.tier = open_tier(ctx.reactor, config.caches, tier_prefix(config.server_name))
        self.caches = CacheRegistry(
            config.caches, tier=self.tier, clock=ctx.clock,
            position_source=lambda: ctx.position("caches"),
        )
        self.caches.register(self.store)
        ctx.on_rows("caches", self.caches.row_handler)
        # A membership change invalidates the membership caches as soon as its
        # event is applied -- before the events position passes it -- so no
        # read at that position can see the old membership.
        ctx.on_rows(EVENTS.name, self.caches.events_row_handler)
        if self.tier is not None:
            ctx.add_drain(self.tier.close)

    async def queue_edus(self, edus: list[tuple[str, str, dict[str, Any]]]) -> None:
        """Queue EDUs on the master's federation stream (directly, or over RPC)."""
        if self.edu_queue is not None:
            await self.edu_queue.queue(edus)
        else:
            await self.ctx.rpc_client.call("master", "queue_edus", {"edus": [list(e) for e in edus]})

    def new_event_id(self) -> str:
        return f"${secrets.token_urlsafe(18)}:{self.ctx.config.server_name}"

    async def event_position(self, result: PersistResult) -> StreamToken:
        """A sync token just before a persisted event (a sync from it returns the event)."""
        assert result.stream_ordering is not None and self.sync is not None
        now, _ = await self.sync.current_token()
        ids = await self.ctx.instances.ids_for([result.instance_name])
        before = result.stream_ordering - 1
        positions = dict(now.positions)
        positions[ids[result.instance_name]] = before
        return StreamToken.with_minimum(min(now.minimum, before), positions)


def _log_catch_up_failure(failure: Any, writer: str) -> None:
    logger.warning("catching up removed writer %s: %s", writer, failure.getErrorMessage())


def _max_event_txn(txn: Any, writer: str) -> int | None:
    txn.execute("SELECT MAX(stream_ordering) FROM events WHERE instance_name = ?", (writer,))
    row = txn.fetchone()
    return None if row is None or row[0] is None else int(row[0])
