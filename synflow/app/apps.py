"""The common part of every process: internal RPC, listeners, health, then the worker type's own build.

:class:`SynflowProcess` runs the bootstrap of :class:`~synflow.app.base.ProcessService`
(database, migrations or the wait for them, replication), then for the
process's worker type (:func:`synflow.registry.worker_type_for`):

* an internal RPC server on its ``instance_map`` address and a client to the
  other processes (both with the deployment's secret);
* a :class:`~synflow.framework.ProcessContext`, handed to
  :meth:`WorkerType.build <synflow.framework.WorkerType.build>`;
* one HTTP site per configured listener, serving exactly the resources it
  names (synflow/listeners.py): what the worker type registered with
  ``ctx.listen`` for that resource name, internal RPC on ``rpc``, ``/health``
  and ``/metrics`` where named;
* ``sd_notify`` READY once ``/health`` would answer 200 (under systemd).

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from prometheus_client import REGISTRY
from twisted.internet.defer import Deferred, succeed

from synflow.app.base import ProcessService
from synflow.app.services import ListeningService
from synflow.app.systemd import SystemdNotifier
from synflow.config import SynflowConfig, Transport
from synflow.framework import ProcessContext, WorkerType
from synflow.http.rpc import PREFIX as RPC_PREFIX
from synflow.http.rpc import PositionSource, RpcClient, RpcServer
from synflow.http.site import HealthResource, build_site
from synflow.listeners import effective_listeners

logger = logging.getLogger(__name__)


class SynflowProcess(ProcessService):
    """A synflow process of any worker type.

    Attributes:
        worker: the worker type's instance (what its ``build`` set up).
        context: what the bootstrap handed it.
        listeners: the listening services, by listener name and by each resource they serve.
    """

    worker: WorkerType
    context: ProcessContext
    rpc_server: RpcServer
    rpc_client: RpcClient
    listeners: dict[str, ListeningService]

    def __init__(self, config: SynflowConfig, reactor: Any, *, exit_on_failure: bool = True) -> None:
        super().__init__(config, reactor, exit_on_failure=exit_on_failure)
        self.worker = self.worker_type()
        self.listeners = {}

    async def setup_app(self) -> None:
        config = self.config
        assert self.db is not None and self.replication is not None and self.instances is not None
        assert self.audit is not None
        handler = self.replication.handler
        SystemdNotifier(self.health_problems, self.reactor, os.environ.get("NOTIFY_SOCKET")).setServiceParent(self.app_services)
        positions = PositionSource(handler, config.replication.wait_for_position_timeout_s)
        secret = config.replication_secret()
        self.rpc_server = RpcServer(positions, self.reactor, secret)
        self.rpc_client = RpcClient(self.reactor, config.instance_map, positions, secret)
        self.context = ProcessContext(
            config=config, reactor=self.reactor, clock=self.reactor, db=self.db, audit=self.audit,
            instances=self.instances, handler=handler, writers=self.replication.writers, rpc=self.rpc_server,
            rpc_client=self.rpc_client, metrics=REGISTRY, allocated_at_start=self.replication.allocated_at_start,
            services=self.app_services,
        )
        self.context.listen("rpc", RPC_PREFIX, self.rpc_server)
        built = self.worker.build(self.context)
        if built is not None:
            await built
        health = HealthResource(self.health_problems, self.health_details, self.health_degraded)
        for listener in effective_listeners(config):
            if not listener.is_http:
                continue  # the replication hub (synflow/app/replication.py)
            mounts: dict[str, Any] = {}
            for resource in listener.resources:
                mounts.update(self.context.resources.get(resource, {}))
            site = build_site(mounts, health=health if listener.serves("health") else None,
                              metrics=listener.serves("metrics"), max_body_bytes=config.limits.max_request_bytes)
            service = self._listen(listener.name, listener.endpoint, site)
            for resource in listener.resources:
                self.listeners.setdefault(resource, service)

    def _listen(self, name: str, endpoint: str, site: Any) -> ListeningService:
        service = ListeningService(self.reactor, endpoint, site)
        service.setName(f"listener-{name}")
        service.setServiceParent(self.app_services)
        self.listeners[name] = service
        return service

    # -- health -------------------------------------------------------------------------

    def health_problems(self) -> list[str]:
        """Why ``/health`` answers 503: empty once started, replicating, reaching the database and the worker type's checks pass."""
        problems = []
        if not self.started:
            problems.append(self.failure or "starting")
        transport = self.replication.transport if self.replication else None
        if transport is not None and not getattr(transport, "connected", True):
            problems.append(f"not connected to replication ({self.replication_address()})")
        if self.db_probe is not None and self.db_probe.problem is not None:
            problems.append(self.db_probe.problem)
        context = getattr(self, "context", None)
        for check in context.health_checks if context is not None else ():
            problem = check()
            if problem is not None:
                problems.append(problem)
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
        details: dict[str, Any] = {"instance": self.config.instance_name, "app": self.worker.name}
        if self.replication is not None:
            handler = self.replication.handler
            details["positions"] = {name: handler.positions(name) for name in handler.views}
        details.update(self.worker.health_details())
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
