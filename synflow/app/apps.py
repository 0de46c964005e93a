"""The process types: what each ``app`` serves on top of the common bootstrap.

Every process gets the stores, internal RPC (server on its ``instance_map``
address, client to the others), the event router and the sync handler. Each
listener serves exactly the resources it names (synflow/listeners.py): the
client API on a ``client`` listener, inbound federation on a ``federation``
one, ``/health``, ``/metrics`` and internal RPC where ``health``,
``metrics`` and ``rpc`` are named -- by default the internal listener on the
process's ``instance_map`` address serves those three.

* ``master`` -- the client API and inbound federation for the server;
* ``event_persister`` -- persists events for the rooms it owns
  (``persist_events`` over internal RPC);
* ``federation_sender`` and ``cache_invalidator`` -- see their modules.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
from typing import Any

from twisted.application.service import Service
from twisted.internet.defer import Deferred, succeed

from synflow.app.base import ProcessService
from synflow.app.services import ListeningService
from synflow.app.systemd import SystemdNotifier
from synflow.caching import (
    CacheRegistry,
    TierInvalidator,
    open_tier,
    tier_prefix,
)
from synflow.config import Transport
from synflow.errors import HttpApiError
from synflow.events.persist import EventPersister, PersistResult
from synflow.events.router import EventRouter, serve_persist
from synflow.events.sync import SyncHandler
from synflow.federation.auth import (
    FEDERATION_PREFIX,
    KEY_PATH,
    FederationAuthResource,
    ServerKeyResource,
    require_origin,
)
from synflow.federation.edus import EduFollower, EduQueue
from synflow.federation.keyring import KeyRing, pinned_keys
from synflow.federation.keys import load_or_create_signing_key
from synflow.federation.missing_events import (
    GET_MISSING_EVENTS_PREFIX,
    MissingEventsResource,
    SqlMissingEventsStore,
)
from synflow.federation.sender import FederationSender
from synflow.federation.storage import SqlDestinationStore
from synflow.federation.transport import TreqFederationTransport
from synflow.federation.worker import EventsFollower, inbound_handler
from synflow.http.client_api import PREFIX as CLIENT_PREFIX
from synflow.http.client_api import ClientApi
from synflow.http.site import HealthResource, build_site
from synflow.listeners import effective_listeners, serving
from synflow.replication.commands import FederationAckCommand, RemoteServerUpCommand
from synflow.replication.rpc import PREFIX as RPC_PREFIX
from synflow.replication.rpc import PositionSource, RpcClient, RpcServer
from synflow.storage.stores import DataStore
from synflow.tokens import StreamToken

FEDERATION_SEND_PREFIX = "/_matrix/federation/v1/send"

logger = logging.getLogger(__name__)


class _Drain(Service):
    """Waits for in-flight work on shutdown (stopped first: services stop in reverse)."""

    def __init__(self, drain: Any) -> None:
        self.drain = drain

    def stopService(self) -> Deferred[None]:
        super().stopService()
        result: Deferred[None] = self.drain()
        return result


class _Closer(Service):
    def __init__(self, close: Any) -> None:
        self.close = close

    def stopService(self) -> Any:
        super().stopService()
        return self.close()


class _FederationService(Service):
    """Starts the follower and the sender together; stops the sender first."""

    def __init__(self, follower: EventsFollower, sender: FederationSender) -> None:
        self.follower = follower
        self.sender = sender

    def startService(self) -> None:
        super().startService()
        self.sender.start()
        d = Deferred.fromCoroutine(self.follower.start(self.sender))
        d.addErrback(lambda f: logger.error("federation follower failed to start: %s", f.getTraceback()))

    def stopService(self) -> Deferred[Any]:
        super().stopService()
        d = self.sender.stop()
        return d.addBoth(lambda _: self.follower.stop())


class SynflowProcess(ProcessService):
    """A synflow process of any app type."""

    store: DataStore
    rpc_server: RpcServer
    rpc_client: RpcClient
    persister: EventPersister | None
    router: EventRouter
    sync: SyncHandler
    client_api: ClientApi | None = None
    federation_inbound: Any = None
    missing_events: MissingEventsResource | None = None
    federation_sender: FederationSender | None = None
    edu_queue: EduQueue | None = None
    signing_key: Any = None
    keyring: KeyRing
    listeners: dict[str, ListeningService]

    async def setup_app(self) -> None:
        config = self.config
        assert self.db is not None and self.replication is not None and self.instances is not None
        handler = self.replication.handler
        me = config.instance_name
        self.listeners = {}
        SystemdNotifier(self.health_problems, self.reactor, os.environ.get("NOTIFY_SOCKET")).setServiceParent(self.app_services)
        self.store = DataStore(self.db)
        self.setup_caches(handler)
        positions = PositionSource(handler, config.replication.wait_for_position_timeout_s)
        secret = config.replication_secret()
        self.rpc_server = RpcServer(positions, self.reactor, secret)
        self.rpc_client = RpcClient(self.reactor, config.instance_map, positions, secret)
        self.persister = None
        if me in config.event_writers:
            self.persister = EventPersister(
                self.replication.writers, server_name=config.server_name, instance_name=me,
                event_writers=config.event_writers, clock=self.reactor, new_event_id=self.new_event_id,
            )
            serve_persist(self.rpc_server, self.persister)
            _Drain(self.persister.drain).setServiceParent(self.app_services)
        self.router = EventRouter(me, config.event_writers, self.persister, self.rpc_client, self.reactor)
        if config.app == "master":
            self.edu_queue = EduQueue(self.db, self.replication.writers, me, config.federation_sender_instances)
            handler.add_command_listener(FederationAckCommand, self.edu_queue.on_ack)
            queue = self.edu_queue

            async def queue_edus(args: Any) -> Any:
                edus = args.get("edus") if isinstance(args, dict) else None
                if not isinstance(edus, list) or not all(
                    isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and isinstance(e[1], str)
                    and isinstance(e[2], dict) for e in edus
                ):
                    raise HttpApiError(400, "M_BAD_JSON", "queue_edus needs a list of [destination, edu_type, content]")
                return await queue.queue([tuple(e) for e in edus])

            self.rpc_server.register("queue_edus", queue_edus)
        self.sync = SyncHandler(self.store, handler, self.instances, self.reactor, self.audit)
        if serving(config, "federation") is not None or config.app == "federation_sender":
            self.signing_key = load_or_create_signing_key(config.signing_key_file)
        if serving(config, "federation") is not None:
            allowed = self.allowed_origins()
            client = TreqFederationTransport.from_config(self.reactor, config.federation,
                                                         server_name=config.server_name, signing_key=self.signing_key)
            self.keyring = KeyRing(client.get_server_keys, self.reactor, pinned_keys(config.federation.trusted_keys))
            self.federation_inbound = inbound_handler(
                self.db, self.router, handler,
                allowed_origins=allowed,
                max_body_bytes=config.federation.max_body_bytes, max_json_depth=config.limits.max_json_depth,
                clock=self.reactor,
                missing_events=client,
            )
            self.missing_events = MissingEventsResource(
                SqlMissingEventsStore(self.db, config.server_name), allowed_origins=allowed,
                max_json_depth=config.limits.max_json_depth, origin_of=require_origin,
            )
        if config.app == "federation_sender":
            await self.setup_federation_sender(handler)
        if serving(config, "client") is not None:
            self.client_api = ClientApi(config.server_name, self.store, self.sync, self.router.persist,
                                        self.event_position, self.reactor, config.limits, queue_edus=self.queue_edus)
        health = HealthResource(self.health_problems, self.health_details, self.health_degraded)
        for listener in effective_listeners(config):
            if not listener.is_http:
                continue  # the replication hub (synflow/app/replication.py)
            mounts: dict[str, Any] = {}
            for resource in listener.resources:
                mounts.update(self.resources_for(resource))
            site = build_site(mounts, health=health if listener.serves("health") else None,
                              metrics=listener.serves("metrics"), max_body_bytes=config.limits.max_request_bytes)
            service = self._listen(listener.name, listener.endpoint, site)
            for resource in listener.resources:
                self.listeners.setdefault(resource, service)

    def resources_for(self, kind: str) -> dict[str, Any]:
        """The HTTP resources a listener of ``kind`` mounts (by path prefix)."""
        if kind == "client" and self.client_api is not None:
            return {CLIENT_PREFIX: self.client_api}
        if kind == "federation" and self.federation_inbound is not None:
            return {FEDERATION_PREFIX: FederationAuthResource(self.config.server_name, self.keyring,
                                                              self.federation_endpoints(), self.allowed_origins()),
                    KEY_PATH: ServerKeyResource(self.config.server_name, self.signing_key, self.reactor)}
        if kind == "rpc":
            return {RPC_PREFIX: self.rpc_server}
        return {}

    def federation_endpoints(self) -> dict[str, Any]:
        """The federation endpoints, by full path prefix: all behind the signature check."""
        return {FEDERATION_SEND_PREFIX: self.federation_inbound.resource(origin_of=require_origin),
                GET_MISSING_EVENTS_PREFIX: self.missing_events}

    def allowed_origins(self) -> list[str]:
        """``federation.allowed_origins``, else the servers listed in ``federation.destinations``."""
        federation = self.config.federation
        return federation.allowed_origins if federation.allowed_origins is not None else sorted(federation.destinations)

    async def setup_federation_sender(self, handler: Any) -> None:
        """Follow the events stream and send to the destinations this sender owns."""
        config = self.config
        assert self.db is not None and self.instances is not None
        store = SqlDestinationStore(self.db)
        self.follower = EventsFollower(store, handler, self.instances, config.server_name,
                                       config.instance_name, self.reactor)
        transport = TreqFederationTransport.from_config(self.reactor, config.federation,
                                                        server_name=config.server_name, signing_key=self.signing_key)
        self.federation_sender = FederationSender(
            server_name=config.server_name, instance_name=config.instance_name,
            instances=config.federation_sender_instances, store=store, transport=transport,
            clock=self.reactor, rng=random.Random(), config=config.federation,
            events_position=self.follower.events_position,
        )
        sender = self.federation_sender
        handler.add_command_listener(RemoteServerUpCommand, lambda _c, cmd: sender.notify_remote_server_up(cmd.server_name))
        self.edu_follower = EduFollower(handler, sender, config.instance_name, self.reactor)
        self.app_services.addService(_FederationService(self.follower, sender))

    def setup_caches(self, handler: Any) -> None:
        """Per-process caches, the shared tier (if configured), and their invalidation."""
        config = self.config
        self.tier = open_tier(self.reactor, config.caches, tier_prefix(config.server_name))
        self.caches = CacheRegistry(
            config.caches, tier=self.tier, clock=self.reactor,
            position_source=lambda: min(handler.positions("caches").values(), default=0),
        )
        self.caches.register(self.store)
        handler.add_row_handler("caches", self.caches.row_handler)
        # A membership change invalidates the membership caches as soon as its
        # event is applied -- before the events position passes it -- so no
        # read at that position can see the old membership.
        handler.add_row_handler("events", self._invalidate_for_events)
        if self.tier is not None:
            self.app_services.addService(_Closer(self.tier.close))
            if config.app == "cache_invalidator":
                # A restarted invalidator starts at or above every caches fact
                # written before it started (its own stored position can be
                # lower): entries filled before then are retired by the
                # start-up sweep, and nothing later is missed.
                assert self.replication is not None
                allocated_at_start = self.replication.allocated_at_start
                me = config.instance_name
                invalidator = TierInvalidator(
                    self.tier, self.caches, me, config.caches.cache_invalidator_instances,
                    self.reactor,
                    start_position=lambda: max(handler.position("caches", me), allocated_at_start.get("caches", 0)),
                )
                handler.add_row_handler("caches", invalidator.row_handler)
                invalidator.setServiceParent(self.app_services)

    def _invalidate_for_events(self, instance: str, token: int, rows: list[Any]) -> None:
        # Every state event: its room's caches (membership, hosts, current state).
        self.caches.events_row_handler(instance, token, rows)

    def _listen(self, name: str, endpoint: str, site: Any) -> ListeningService:
        service = ListeningService(self.reactor, endpoint, site)
        service.setName(f"listener-{name}")
        service.setServiceParent(self.app_services)
        self.listeners[name] = service
        return service

    async def queue_edus(self, edus: list[tuple[str, str, dict[str, Any]]]) -> None:
        """Queue EDUs on the master's federation stream (directly, or over RPC)."""
        if self.edu_queue is not None:
            await self.edu_queue.queue(edus)
        else:
            await self.rpc_client.call("master", "queue_edus", {"edus": [list(e) for e in edus]})

    def new_event_id(self) -> str:
        return f"${secrets.token_urlsafe(18)}:{self.config.server_name}"

    async def event_position(self, result: PersistResult) -> StreamToken:
        """A sync token just before a persisted event (a sync from it returns the event)."""
        assert self.instances is not None and result.stream_ordering is not None
        now, _ = await self.sync.current_token()
        ids = await self.instances.ids_for([result.instance_name])
        before = result.stream_ordering - 1
        positions = dict(now.positions)
        positions[ids[result.instance_name]] = before
        return StreamToken.with_minimum(min(now.minimum, before), positions)

    # -- health -------------------------------------------------------------------------

    def health_problems(self) -> list[str]:
        """Why ``/health`` answers 503: empty once started, replicating and reaching the database."""
        problems = []
        if not self.started:
            problems.append(self.failure or "starting")
        transport = self.replication.transport if self.replication else None
        if transport is not None and not getattr(transport, "connected", True):
            problems.append(f"not connected to replication ({self.replication_address()})")
        if self.db_probe is not None and self.db_probe.problem is not None:
            problems.append(self.db_probe.problem)
        return problems

    def health_degraded(self) -> list[str]:
        """What ``/health`` reports as degraded (200, ``"status": "degraded"``): the audit log failing."""
        problem = self.audit.problem if self.audit is not None else None
        return [problem] if problem is not None else []

    def replication_address(self) -> str:
        """Where this process replicates through, for health messages."""
        replication = self.config.replication
        if replication.transport is Transport.REDIS:
            redis = replication.redis
            return f"redis {redis.path or f'{redis.host}:{redis.port}'}"
        return f"hub {replication.hub.host}:{replication.hub.port}"

    def health_details(self) -> dict[str, Any]:
        details: dict[str, Any] = {"instance": self.config.instance_name, "app": self.config.app}
        if self.replication is not None:
            handler = self.replication.handler
            details["positions"] = {name: handler.positions(name) for name in handler.views}
        return details

    def stopService(self) -> Deferred[None]:
        rpc_server = getattr(self, "rpc_server", None)
        if rpc_server is not None:
            rpc_server.stopping = True  # calls already running finish; new ones are refused and retried
        d = super().stopService()

        def close_rpc(result: Any) -> Any:
            rpc = getattr(self, "rpc_client", None)
            return rpc.close().addBoth(lambda _: result) if rpc is not None else succeed(result)

        return d.addBoth(close_rpc)
