"""The ``federation_sender`` worker type: sends local events and EDUs to the destinations it owns.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import logging
import random
from typing import Any

from twisted.application.service import Service
from twisted.internet.defer import Deferred

from synflow.federation.edus import EduFollower
from synflow.federation.sender import FederationSender
from synflow.federation.storage import SqlDestinationStore
from synflow.federation.transport import TreqFederationTransport
from synflow.federation.worker import EventsFollower
from synflow.framework import ProcessContext
from synflow.replication.commands import RemoteServerUpCommand
from synflow.worker_types._homeserver import Homeserver

__all__ = ["FederationSenderWorker"]

logger = logging.getLogger(__name__)


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


class FederationSenderWorker(Homeserver):
    """Follows the ``events`` and ``federation`` streams; one of ``federation_sender_instances``."""

    name = "federation_sender"
    summary = "per-destination queues, transactions, backoff and catch-up to remote servers"
    follows = ("events", "federation")
    signs_federation = True

    follower: EventsFollower
    federation_sender: FederationSender
    edu_follower: EduFollower

    async def build_role(self, ctx: ProcessContext) -> None:
        config = ctx.config
        store = SqlDestinationStore(ctx.db)
        self.follower = EventsFollower(store, ctx.handler, ctx.instances, config.server_name,
                                       config.instance_name, ctx.clock)
        transport = TreqFederationTransport.from_config(ctx.reactor, config.federation,
                                                        server_name=config.server_name, signing_key=self.signing_key)
        sender = self.federation_sender = FederationSender(
            server_name=config.server_name, instance_name=config.instance_name,
            instances=config.federation_sender_instances, store=store, transport=transport,
            clock=ctx.clock, rng=random.Random(), config=config.federation,
            events_position=self.follower.events_position, follower=self.sender_shards,
        )
        ctx.on_command(RemoteServerUpCommand, lambda _c, cmd: sender.notify_remote_server_up(cmd.server_name))
        self.edu_follower = EduFollower(ctx.handler, sender, config.instance_name, ctx.clock)
        ctx.add_service(_FederationService(self.follower, sender))

    async def settle_shards(self) -> None:
        """Before answering a hand-over: stop the queues of the destinations given away."""
        await self.federation_sender.release_unowned()
