"""The ``cache_invalidator`` worker type: keeps the shared cache tier consistent with the ``caches`` stream.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

from synflow.caching import TierInvalidator
from synflow.framework import ProcessContext
from synflow.worker_types._homeserver import Homeserver

__all__ = ["CacheInvalidatorWorker"]


class CacheInvalidatorWorker(Homeserver):
    """One of ``caches.cache_invalidator_instances``; idle unless ``caches.tier`` is set."""

    name = "cache_invalidator"
    summary = "retires shared cache tier entries as the caches stream invalidates them"
    follows = ("caches",)

    async def build_role(self, ctx: ProcessContext) -> None:
        if self.tier is None:
            return
        # A restarted invalidator starts at or above every caches fact written
        # before it started (its own stored position can be lower): entries
        # filled before then are retired by the start-up sweep, and nothing
        # later is missed.
        me = ctx.config.instance_name
        handler = ctx.handler
        allocated_at_start = ctx.allocated_at_start
        invalidator = TierInvalidator(
            self.tier, self.caches, me, ctx.config.caches.cache_invalidator_instances, ctx.clock,
            start_position=lambda: max(handler.position("caches", me), allocated_at_start.get("caches", 0)),
        )
        ctx.on_rows("caches", invalidator.row_handler)
        ctx.add_service(invalidator)
