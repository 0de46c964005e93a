"""The ``master`` worker type: migrations, the TCP replication hub, the client API and the EDU queue.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

from typing import Any

from synflow.errors import HttpApiError
from synflow.federation.edus import EduQueue
from synflow.framework import Capability, ProcessContext
from synflow.replication.commands import FederationAckCommand
from synflow.streams import FEDERATION
from synflow.worker_types._homeserver import Homeserver

__all__ = ["Master"]


class Master(Homeserver):
    """One per deployment: applies migrations, runs the hub, queues EDUs on the ``federation`` stream."""

    name = "master"
    summary = "client API, inbound federation, schema migrations, the replication hub"
    capabilities = frozenset({Capability.MIGRATIONS, Capability.REPLICATION_HUB})
    reserved_instance_name = "master"
    requires_instance_map = False
    writes = (FEDERATION,)

    async def build_role(self, ctx: ProcessContext) -> None:
        config = ctx.config
        queue = self.edu_queue = EduQueue(ctx.db, ctx.writers, config.instance_name,
                                          config.federation_sender_instances)
        ctx.on_command(FederationAckCommand, queue.on_ack)

        async def queue_edus(args: Any) -> Any:
            edus = args.get("edus") if isinstance(args, dict) else None
            if not isinstance(edus, list) or not all(
                isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and isinstance(e[1], str)
                and isinstance(e[2], dict) for e in edus
            ):
                raise HttpApiError(400, "M_BAD_JSON", "queue_edus needs a list of [destination, edu_type, content]")
            return await queue.queue([tuple(e) for e in edus])

        ctx.rpc.register("queue_edus", queue_edus)
