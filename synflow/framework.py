"""What a worker type is, and what the common bootstrap hands it.

Public through :mod:`synflow.api`; this module holds the definitions.

A **worker type** is a subclass of :class:`WorkerType` naming itself
(``name``, the ``app:`` value in a config file), optionally its own config
section (:class:`Section`), the streams it writes (``writes``) or follows
(``follows``) and the roles it plays for the whole deployment
(:class:`Capability`). The bootstrap (``synflow/app/``) opens the database,
applies or waits for migrations, loads every registered stream, assembles
replication and internal RPC, then calls :meth:`WorkerType.build` with a
:class:`ProcessContext`. What ``build`` registers there -- services, HTTP
resources on named listeners, RPC methods, row handlers, health checks -- is
started, served and stopped by the bootstrap.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import attrs
from prometheus_client import CollectorRegistry
from twisted.application.service import IService, MultiService, Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorCore, IReactorTime
from twisted.web.resource import IResource

from synflow.errors import HttpApiError, ShardingError
from synflow.sharding import shard_for
from synflow.storage.id_generators import insert_stream_rows_txn
from synflow.streams import StreamDef, Writers

if TYPE_CHECKING:
    from synflow.audit import AuditLog
    from synflow.config import SynflowConfig
    from synflow.http.rpc import RpcClient, RpcServer
    from synflow.replication.handler import ReplicationHandler
    from synflow.storage.engines import Database
    from synflow.storage.id_generators import StreamWriters
    from synflow.storage.instances import InstanceMap
    from synflow.storage.stores import DataStore

__all__ = ["Capability", "ProcessContext", "Section", "StreamFollower", "WorkerType"]

logger = logging.getLogger(__name__)

S = TypeVar("S")

#: Called with (writer instance, stream position, rows) in stream order.
RowCallback = Callable[[str, int, list[Any]], None]


class Capability(enum.Enum):
    """A role a worker type plays for the whole deployment (instead of a name the bootstrap checks)."""

    #: Applies schema migrations (creating a missing PostgreSQL database
    #: first); every other process waits for them.
    MIGRATIONS = "migrations"
    #: Runs the TCP replication hub the other processes connect to (with
    #: ``replication.transport: tcp``).
    REPLICATION_HUB = "replication_hub"


@attrs.frozen
class Section:
    """A worker type's own top-level config section.

    Attributes:
        key: the top-level YAML key (``receipts:``).
        type: an attrs class; the section is checked key by key like synflow's
            own (unknown keys, types, validators: one ``file: key: problem``
            line).
    """

    key: str
    type: type


class WorkerType:
    """Base class of every worker type, built-in or plugin.

    Class attributes a subclass sets:

    * ``name`` -- the ``app:`` value that selects it;
    * ``summary`` -- one line for ``twistd synflow --help`` and ``synflowctl plugins``;
    * ``config`` -- its :class:`Section`, or None;
    * ``writes`` -- streams it writes: a ``Writers.DECLARED`` stream is
      written by the processes of the types that list it; a
      ``Writers.CONFIGURED`` one requires this process to be listed in
      ``stream_writers.<stream>``;
    * ``follows`` -- names of streams whose rows it handles (checked to exist at start);
    * ``capabilities`` -- :class:`Capability` members;
    * ``reserved_instance_name`` -- if set, its process must use this
      ``instance_name`` and no other type may;
    * ``requires_instance_map`` -- whether its process must be listed in
      ``instance_map`` (its internal RPC address);
    * ``schema`` -- a directory of its own migrations (namespace
      ``app:<name>``), for tables no stream declares.
    """

    name: ClassVar[str]
    summary: ClassVar[str] = ""
    config: ClassVar[Section | None] = None
    writes: ClassVar[tuple[StreamDef, ...]] = ()
    follows: ClassVar[tuple[str, ...]] = ()
    capabilities: ClassVar[frozenset[Capability]] = frozenset()
    reserved_instance_name: ClassVar[str | None] = None
    requires_instance_map: ClassVar[bool] = True
    schema: ClassVar[str | None] = None

    @classmethod
    def check_config(cls, config: SynflowConfig, error: Callable[[str, str], Exception]) -> None:
        """Cross-key checks of this type's config; raise ``error(dotted_key, problem)``."""

    def build(self, ctx: ProcessContext) -> Awaitable[None] | None:
        """Add this process's services, resources, RPC methods and row handlers to ``ctx``.

        May be a coroutine; the process starts serving once it returns.
        """
        return None

    def health_details(self) -> Mapping[str, Any]:
        """Extra fields of this process's ``/health`` answer."""
        return {}

    @classmethod
    def has(cls, capability: Capability) -> bool:
        """Whether this worker type declares ``capability``."""
        return capability in cls.capabilities

    @classmethod
    def declares_writer_of(cls, stream: StreamDef) -> bool:
        """Whether this type lists ``stream`` among the streams it writes."""
        return any(s.name == stream.name for s in cls.writes)


class _Starter(Service):
    """Runs a coroutine function when started; a failure is logged."""

    def __init__(self, start: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self.start = start

    def startService(self) -> None:
        super().startService()
        Deferred.fromCoroutine(self.start()).addErrback(
            lambda f: logger.error("start-up task failed: %s", f.getTraceback()))


class _AtStop(Service):
    """Calls a function when stopped and waits for what it returns (services stop in reverse order)."""

    def __init__(self, call: Callable[[], Deferred[Any] | None]) -> None:
        self.call = call

    def stopService(self) -> Deferred[Any] | None:
        super().stopService()
        return self.call()


class StreamFollower:
    """Hands a consumer every row of one stream exactly once, in order per writer, across restarts.

    Made by :meth:`ProcessContext.follow`. The consumer keeps, with its own
    state, the position it has applied per writer (``since``) and stores it
    in the same transaction as what it derives from the rows. At start the
    follower reads what was written after those positions from the stream's
    table (the catch-up source), then the live rows; live rows that arrive
    during the catch-up wait, and rows at or below a writer's applied
    position are skipped, so nothing is applied twice or missed.

    Attributes:
        positions: the position applied per writer.
        caught_up: fires once the start-up catch-up is applied.
    """

    def __init__(self, ctx: ProcessContext, stream: str,
                 apply: Callable[[str, int, list[Any]], Awaitable[None] | None], since: Mapping[str, int]) -> None:
        self.ctx = ctx
        self.stream = stream
        self.apply = apply
        self.positions: dict[str, int] = dict(since)
        self.caught_up: Deferred[None] = Deferred()
        self._queue: list[tuple[str, int, list[Any]]] = []
        self._busy = True  # until the catch-up is applied
        ctx.on_rows(stream, self._on_rows)

    def _on_rows(self, writer: str, token: int, rows: list[Any]) -> None:
        self._queue.append((writer, token, rows))
        if not self._busy:
            self._busy = True
            Deferred.fromCoroutine(self._drain()).addErrback(self._failed)

    async def start(self) -> None:
        """Apply what each writer wrote after ``since`` up to its current position, then the live rows."""
        try:
            source = self.ctx.handler.sources[self.stream]
            for writer, upto in sorted(self.ctx.handler.positions(self.stream).items()):
                start = self.positions.get(writer, 0)
                while start < upto:
                    updates, reached, limited = await source.get_updates(writer, start, upto)
                    for token, row in updates:
                        await self._apply(writer, token, [row])
                    start = reached
                    if not limited:
                        break
            await self._drain()
        except Exception:
            self._busy = False
            raise
        self.caught_up.callback(None)

    async def _drain(self) -> None:
        try:
            while self._queue:
                writer, token, rows = self._queue.pop(0)
                await self._apply(writer, token, rows)
        finally:
            self._busy = False

    async def _apply(self, writer: str, token: int, rows: list[Any]) -> None:
        if token <= self.positions.get(writer, 0):
            return
        result = self.apply(writer, token, rows)
        if result is not None:
            await result
        self.positions[writer] = token

    def _failed(self, failure: Any) -> None:
        logger.error("following %s failed: %s", self.stream, failure.getTraceback())


@attrs.define(eq=False)
class ProcessContext:
    """What the bootstrap hands a worker type's :meth:`WorkerType.build`.

    Attributes:
        config: the process's validated config (a plugin's own section: :meth:`section`).
        reactor: the reactor (only the bootstrap passes the global one).
        clock: the same reactor, as a clock.
        db: the database (``run_interaction``, ``run_query``).
        audit: the audit log every stream writes to.
        instances: persistent small integer IDs of instance names (stream tokens).
        handler: replication: positions, waiting for positions, commands.
        writers: the one way to write streams this process writes (``run_write``).
        rpc: the internal RPC server (``register(name, method)``).
        rpc_client: calls other processes of the deployment.
        metrics: the process's Prometheus registry (served on ``metrics`` listeners).
        allocated_at_start: each stream's highest allocated ID when the process started.
    """

    config: SynflowConfig
    reactor: IReactorCore
    clock: IReactorTime
    db: Database
    audit: AuditLog
    instances: InstanceMap
    handler: ReplicationHandler
    writers: StreamWriters
    rpc: RpcServer
    rpc_client: RpcClient
    metrics: CollectorRegistry
    allocated_at_start: Mapping[str, int]
    services: MultiService
    #: HTTP resources by listener resource name, then path prefix.
    resources: dict[str, dict[str, IResource]] = attrs.Factory(dict)
    health_checks: list[Callable[[], str | None]] = attrs.Factory(list)
    _store: DataStore | None = attrs.field(default=None, init=False)

    def section(self, cls: type[S]) -> S:
        """This process's config section of type ``cls`` (its defaults if the files have none)."""
        return self.config.section(cls)

    def listen(self, resource: str, prefix: str, site_resource: IResource) -> None:
        """Serve ``site_resource`` under the path ``prefix`` on the listener naming ``resource``.

        ``resource`` is one of the listener resource names (``client``,
        ``federation``, ...). Nothing is served if no listener of this process
        names it.
        """
        self.resources.setdefault(resource, {})[prefix] = site_resource

    def on_rows(self, stream: str, callback: RowCallback) -> None:
        """Call ``callback(writer, position, rows)`` for each batch of ``stream``'s rows, in order."""
        if stream not in self.handler.views:
            raise LookupError(f"unknown stream {stream!r}; registered: {', '.join(sorted(self.handler.views))}")
        self.handler.add_row_handler(stream, callback)

    def on_command(self, command: type, callback: Callable[[Any, Any], object]) -> None:
        """Call ``callback(connection, command)`` for each replication command of class ``command``."""
        self.handler.add_command_listener(command, callback)

    def follow(self, stream: str, apply: Callable[[str, int, list[Any]], Awaitable[None] | None],
               since: Mapping[str, int]) -> StreamFollower:
        """Apply every row of ``stream`` after ``since`` (per writer) once, in order: catch-up first, then live.

        ``apply(writer, position, rows)`` may return an awaitable; the next
        batch waits for it. The catch-up starts with the process.
        """
        follower = StreamFollower(self, stream, apply, since)
        self.add_service(_Starter(follower.start))
        return follower

    async def requester(self, request: Any) -> str:
        """The user ID an HTTP request's ``Authorization: Bearer`` access token belongs to.

        Raises:
            HttpApiError: 401 ``M_MISSING_TOKEN`` or ``M_UNKNOWN_TOKEN``.
        """
        from synflow.http.server import bearer_token

        token = bearer_token(request)
        if token is None:
            raise HttpApiError(401, "M_MISSING_TOKEN", "missing access token (Authorization: Bearer <token>)")
        found = await self._data_store().get_user_by_access_token(token)
        if found is None:
            raise HttpApiError(401, "M_UNKNOWN_TOKEN", "unknown access token")
        request.synflow_user = found.user_id  # for the access log
        return str(found.user_id)

    async def membership(self, room_id: str, user_id: str) -> str | None:
        """``user_id``'s current membership of ``room_id`` (``join``, ``invite``, ``leave``, ``ban``), or None."""
        return await self._data_store().get_membership(room_id, user_id)

    def _data_store(self) -> DataStore:
        from synflow.storage.stores import DataStore

        if self._store is None:
            self._store = DataStore(self.db)
        return self._store

    def add_service(self, service: IService) -> None:
        """Start ``service`` with the process and stop it (before replication) at shutdown."""
        service.setServiceParent(self.services)

    def add_drain(self, drain: Callable[[], Deferred[Any] | None]) -> None:
        """At shutdown, before replication stops, call ``drain()`` and wait for what it returns.

        For in-flight work finishing, or connections closing; later additions run first.
        """
        _AtStop(drain).setServiceParent(self.services)

    def add_health_check(self, check: Callable[[], str | None]) -> None:
        """``/health`` answers 503 with the returned text while ``check()`` is not None."""
        self.health_checks.append(check)

    def writes(self, stream: StreamDef) -> bool:
        """Whether this process writes ``stream`` (it has its ID generator)."""
        return stream.name in self.writers.generators

    def position(self, stream: str) -> int:
        """The lowest position every writer of ``stream`` has reached (all of it is visible)."""
        return min(self.handler.positions(stream).values(), default=0)

    def writer_for(self, stream: StreamDef, key: str) -> str:
        """The instance that writes ``stream``'s rows whose shard key is ``key`` (``shard_for`` over its writers)."""
        return shard_for(key, self.config.writers_of(stream))

    async def write_rows(self, stream: StreamDef, rows: Sequence[Any]) -> list[int]:
        """Insert ``rows`` into ``stream``'s table in one transaction; their stream IDs, once committed.

        Each row is stored as ``(id, instance, *row_to_db(row))`` in the
        stream's ``id_column``, ``instance_column`` and ``select`` columns, and
        announced to every process once its ID is visible (the ID generator
        completes it after the commit, in order). For other SQL in the same
        transaction use ``writers.run_write`` directly.

        Raises:
            ShardingError: a sharded stream's row whose shard this process does not own.
            ValueError: this process does not write ``stream``.
        """
        if not self.writes(stream):
            raise ValueError(f"{self.config.instance_name!r} does not write stream {stream.name!r}")
        me = self.config.instance_name
        if stream.shard_key is not None and stream.writers is Writers.CONFIGURED:
            for row in rows:
                owner = self.writer_for(stream, stream.shard_key(row))
                if owner != me:
                    raise ShardingError(f"{stream.name} row for {stream.shard_key(row)!r} belongs to {owner!r}, not {me!r}")
        return await self.writers.run_write(f"write_{stream.name}", [stream.name], insert_stream_rows_txn,
                                            stream, me, rows)


def writer_kind(stream: StreamDef) -> str:
    """How the writers of ``stream`` are chosen, in words (for listings)."""
    return {Writers.CONFIGURED: f"stream_writers.{stream.name}", Writers.ANY: "any process",
            Writers.DECLARED: "the worker types that declare it"}[stream.writers]
