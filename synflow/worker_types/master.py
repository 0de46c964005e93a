"""The ``master`` worker type: migrations, the TCP replication hub, the client API and the EDU queue.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import os
import re
from typing import Any

from synflow.audit import AuditLog
from synflow.errors import HttpApiError
from synflow.events.shards import (
    EVENTS_GROUP,
    FEDERATION_GROUP,
    GROUPS,
    RESHARD_RPC,
    SHARDS_RPC,
    Resharder,
    ShardState,
)
from synflow.federation.edus import EduQueue
from synflow.framework import Capability, ProcessContext
from synflow.replication.commands import FederationAckCommand
from synflow.storage.id_generators import recover_audit
from synflow.streams import FEDERATION
from synflow.worker_types._homeserver import Homeserver

__all__ = ["Master"]

_INSTANCE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class Master(Homeserver):
    """One per deployment: applies migrations, runs the hub, queues EDUs on the ``federation`` stream."""

    name = "master"
    summary = "client API, inbound federation, schema migrations, the replication hub"
    capabilities = frozenset({Capability.MIGRATIONS, Capability.REPLICATION_HUB})
    reserved_instance_name = "master"
    requires_instance_map = False
    writes = (FEDERATION,)
    resharder: Resharder

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
        self.setup_resharding(ctx)
        await self.resharder.recover()

    def setup_resharding(self, ctx: ProcessContext) -> None:
        """The coordinator of live resharding and its RPCs (``reshard``, ``shards``; see ``synflowctl reshard``)."""
        followers = {EVENTS_GROUP: self.shards}
        if self.sender_shards is not None:
            followers[FEDERATION_GROUP] = self.sender_shards
            queue = self.edu_queue

            def follow_senders(state: ShardState) -> None:
                # Outbox rows are trimmed once every current sender has acknowledged them.
                if queue is not None:
                    queue.senders = list(state.current.writers)

            self.sender_shards.on_state = follow_senders
            follow_senders(self.sender_shards.state)
        config = ctx.config

        async def recover_audit_of(writer: str) -> int:
            # Only when the writer's log is here (one machine, a shared audit.dir): elsewhere its own
            # files are out of reach, and re-recording from scratch would duplicate them.
            if not config.audit.enabled or not os.path.isdir(os.path.join(config.audit_dir, "writer_logs", writer)):
                return 0
            audit = AuditLog(config.audit_dir, writer, ctx.clock, max_bytes=config.audit.max_bytes,
                             retain_bytes=config.audit.retain_bytes, retain_days=config.audit.retain_days)
            try:
                return await recover_audit(ctx.db, audit, writer)
            finally:
                audit.close()

        resharder = self.resharder = Resharder(ctx.db, followers, ctx.rpc_client,
                                               lambda: sorted(ctx.rpc_client.instance_map), ctx.clock,
                                               ctx.config.instance_name, recover_audit=recover_audit_of)

        async def reshard(args: Any) -> Any:
            if not isinstance(args, dict):
                raise HttpApiError(400, "M_BAD_JSON", "reshard needs {op, writer[, address]}")
            op, writer, address = args.get("op"), args.get("writer"), args.get("address")
            if op not in ("add", "remove"):
                raise HttpApiError(400, "M_INVALID_PARAM", "op must be 'add' or 'remove'")
            if not isinstance(writer, str) or not _INSTANCE_NAME.fullmatch(writer):
                raise HttpApiError(400, "M_INVALID_PARAM", "writer must be an instance name")
            where: tuple[str, int] | None = None
            if address is not None:
                if not (isinstance(address, list) and len(address) == 2 and isinstance(address[0], str)
                        and isinstance(address[1], int) and 0 < address[1] < 65536 and len(address[0]) <= 255):
                    raise HttpApiError(400, "M_INVALID_PARAM", "address must be [host, port]")
                where = (address[0], address[1])
            return await resharder.reshard(op, writer, where, _group(args))

        async def shards(args: Any) -> Any:
            return await resharder.describe(_group(args))

        ctx.rpc.register(RESHARD_RPC, reshard)
        ctx.rpc.register(SHARDS_RPC, shards)


def _group(args: Any) -> str:
    """The ``group`` an RPC's arguments name (default ``events``).

    Raises:
        HttpApiError: 400 for anything but a known group.
    """
    group = args.get("group", EVENTS_GROUP) if isinstance(args, dict) else EVENTS_GROUP
    if group not in GROUPS:
        raise HttpApiError(400, "M_INVALID_PARAM", f"group must be one of {', '.join(GROUPS)}")
    return str(group)
