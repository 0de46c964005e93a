"""What every synflow process does at start-up, whatever its worker type.

:class:`ProcessService` is the root service of a process. Its
``startService`` returns at once and runs the start-up asynchronously: open
the database; in a process whose worker type declares
:attr:`~synflow.framework.Capability.MIGRATIONS` (the master) apply
synflow's migrations, elsewhere wait (bounded) for them; apply the plugins'
migrations not yet applied (each in its namespace, under the schema lock);
load instance IDs; assemble replication of every registered stream; then let the worker type add its own services (:meth:`ProcessService.setup_app`),
beside a :class:`~synflow.app.services.DatabaseProbe` that ``/health`` reads.
If start-up fails, the reason is logged in one line and the process exits
non-zero. ``stopService`` stops the app's services, then replication (which
persists positions), then closes the database and the audit log.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

from twisted.application.service import MultiService
from twisted.internet.defer import Deferred, succeed
from twisted.internet.error import CannotListenError
from twisted.internet.threads import deferToThreadPool

from synflow import registry
from synflow.app.replication import Replication, setup_replication
from synflow.app.services import DatabaseProbe, ListeningService
from synflow.audit import AuditLog
from synflow.config import SynflowConfig
from synflow.errors import SynflowError
from synflow.framework import Capability
from synflow.storage.createdb import ensure_database_txn
from synflow.storage.engines import Database
from synflow.storage.id_generators import ensure_sequences_txn
from synflow.storage.instances import InstanceMap
from synflow.storage.prepare import prepare_database, prepare_plugin_schemas, wait_for_schema

logger = logging.getLogger(__name__)


def _listeners(parent: MultiService) -> Iterator[ListeningService]:
    """Every listener under ``parent``: the replication hub's and the app's."""
    for service in parent:
        if isinstance(service, ListeningService):
            yield service
        elif isinstance(service, MultiService):
            yield from _listeners(service)


class ProcessService(MultiService):
    """The root service of one synflow process.

    Args:
        config: the validated config.
        reactor: the reactor (only ``synflow/app`` passes the global one).
        exit_on_failure: stop the reactor with an error if start-up fails.
    """

    def __init__(self, config: SynflowConfig, reactor: Any, *, exit_on_failure: bool = True) -> None:
        super().__init__()
        self.config = config
        self.reactor = reactor
        #: The process's worker type (what it declares decides migrations, the hub, the streams it writes).
        self.worker_type = registry.worker_type_for(config)
        self.exit_on_failure = exit_on_failure
        self.db: Database | None = None
        self.audit: AuditLog | None = None
        self.instances: InstanceMap | None = None
        self.replication: Replication | None = None
        self.db_probe: DatabaseProbe | None = None
        self.app_services = MultiService()
        self.ready: Deferred[ProcessService] = Deferred()
        self.started = False
        self.failure: str | None = None

    def startService(self) -> None:
        MultiService.startService(self)
        d = Deferred.fromCoroutine(self._start())
        d.addCallbacks(self._started, self._start_failed)

    async def _start(self) -> None:
        config = self.config
        os.makedirs(config.data_dir, exist_ok=True)
        self.audit = AuditLog(
            config.audit_dir, config.instance_name, self.reactor,
            max_bytes=config.audit.max_bytes, enabled=config.audit.enabled,
            retain_bytes=config.audit.retain_bytes, retain_days=config.audit.retain_days,
        )
        db_config = config.database_config()
        migrates = self.worker_type.has(Capability.MIGRATIONS)
        if migrates and db_config.engine == "postgres":
            if await deferToThreadPool(self.reactor, self.reactor.getThreadPool(), ensure_database_txn, db_config):
                logger.info("created the PostgreSQL database %r", db_config.dbname)
        db = self.db = Database(self.reactor, db_config)
        self.db_probe = DatabaseProbe(db, self.reactor)
        self.db_probe.setServiceParent(self.app_services)
        if migrates:
            version = await prepare_database(db, apply=True)
        else:
            version = await wait_for_schema(db, self.reactor)
        logger.info("%s %r: database schema at version %s", self.worker_type.name, config.instance_name, version)
        plugin_versions = await prepare_plugin_schemas(db, registry.plugin_schemas(config))
        if plugin_versions:
            logger.info("plugin schemas: %s", ", ".join(f"{n} at {v}" for n, v in sorted(plugin_versions.items())))
        created = await db.run_interaction("ensure_sequences", ensure_sequences_txn, list(registry.streams().values()),
                                           idempotent=True)
        if created:
            logger.info("created the ID sequences of streams %s", ", ".join(created))
        self.instances = InstanceMap(db, self.audit)
        await self.instances.load()
        self.replication = await setup_replication(config, self.reactor, db, audit=self.audit)
        await self.setup_app()
        self.replication.service.setServiceParent(self)
        when_ready = getattr(self.replication.transport, "when_ready", None)
        if when_ready is not None:
            await when_ready()
        self.app_services.setServiceParent(self)
        # A listener that cannot bind its port fails start-up, naming it: a process must not report
        # itself started while one of its listeners is missing.
        for service in list(_listeners(self)):
            try:
                await service.when_listening()
            except CannotListenError as e:
                raise SynflowError(f"{service.name}: cannot listen on {service.description}: "
                                   f"{e.socketError}") from None

    async def setup_app(self) -> None:
        """Add the app type's services to ``self.app_services`` (subclasses)."""

    def _started(self, _: Any) -> None:
        self.started = True
        logger.info("%s %r started", self.worker_type.name, self.config.instance_name)
        self.ready.callback(self)

    def _start_failed(self, failure: Any) -> None:
        if isinstance(failure.value, SynflowError):
            self.failure = str(failure.value)
        else:
            self.failure = f"{type(failure.value).__name__}: {failure.value}"
            logger.error("start-up failed:\n%s", failure.getTraceback())
        logger.error("%s %r could not start: %s", self.worker_type.name, self.config.instance_name, self.failure)
        # Under twistd sys.stderr is the log; the operator's terminal is the original stream.
        for stream in {id(sys.stderr): sys.stderr, id(sys.__stderr__): sys.__stderr__}.values():
            if stream is not None:
                stream.write(f"synflow: {self.config.instance_name} could not start: {self.failure}\n")
                stream.flush()
        self.ready.errback(failure)
        self.ready.addErrback(lambda _: None)
        if self.exit_on_failure and self.reactor.running:
            self.reactor.callLater(0, _exit, self.reactor, 1)

    def stopService(self) -> Deferred[None]:
        d: Deferred[Any] = Deferred.fromCoroutine(self._stop())
        return d

    async def _stop(self) -> None:
        if self.app_services.running:
            await _maybe(self.app_services.stopService())
        if self.replication is not None and self.replication.service.running:
            await _maybe(self.replication.service.stopService())
        MultiService.stopService(self)
        if self.db is not None:
            await self.db.close()
        if self.audit is not None:
            self.audit.close()


def _maybe(result: Any) -> Deferred[Any]:
    return result if isinstance(result, Deferred) else succeed(result)


def _exit(reactor: Any, code: int) -> None:
    """Stop the reactor, then leave with ``code`` (twistd itself would exit 0)."""
    reactor.addSystemEventTrigger("after", "shutdown", os._exit, code)
    reactor.stop()
