"""The replication handler: every writer's position, kept correct over any transport.

One handler per process. It runs the same over the TCP hub, the TCP client
and Redis, because it only ever sees *connections* (things it can send a
command to) and *commands*.

Reading. For each stream it keeps every writer's position (the vector
clock). Commands of one stream are processed strictly in order, one at a
time, so a catch-up never races later rows:

* ``RDATA`` of a writer is ignored until that writer's first ``POSITION`` on
  the connection has been processed (after a reconnect, rows may be missing
  in between); rows with the token ``batch`` are buffered until the row with
  the numeric token; rows at or below the current position are stale and
  dropped.
* ``POSITION s w prev new``: if the current position ``cur`` is outside
  ``prev <= cur <= new``, rows were missed, and they are fetched from the
  stream's source in pages before advancing to ``new``.
* Applying a batch of rows at a token runs, in order: the stream's row
  handlers (cache invalidation), the position advance, the position listeners
  (notifiers), and the waiters of :meth:`wait_for_position`.
* A stream name this process does not know is logged once and ignored.
* Before anything of a ``POSITION`` or a numeric ``RDATA`` is applied, the
  position it claims for its writer is checked against the stream's sequence
  (:class:`~synflow.replication.guard.PositionGuard`): a claim no handed-out
  ID reaches is refused, logged and counted (``positions_refused``), not
  applied.

Writing. When local facts become visible (the ID generator reports them in
ID order) the handler applies them locally, sends one ``RDATA`` per row (all
but the last row of an ID with the token ``batch``) and a ``POSITION`` for
any tail without rows; it answers ``REPLICATE`` and every new connection with
its positions, and a periodic tick lets idle writers leap forward and
persists positions.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from twisted.internet.defer import Deferred, DeferredLock, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.python.failure import Failure

from synflow.audit import AuditLog
from synflow.errors import ProtocolError
from synflow.replication.batch import write_batch
from synflow.replication.commands import (
    AnyCommand,
    AuthCommand,
    ClearUserSyncCommand,
    ErrorCommand,
    FederationAckCommand,
    NameCommand,
    PingCommand,
    PositionCommand,
    RdataCommand,
    RemoteServerUpCommand,
    ReplicateCommand,
    ServerCommand,
    UserSyncCommand,
    rdata_builder,
)
from synflow.replication.core import STREAM_COMMANDS
from synflow.replication.guard import PositionGuard
from synflow.replication.interfaces import Connection
from synflow.streams import StreamDef, Writers
from synflow.streams.tracker import Completed

if TYPE_CHECKING:  # types only: the transport layer does not import storage
    from synflow.storage.id_generators import FactPayload, MultiWriterIdGenerator

logger = logging.getLogger(__name__)

RowHandler = Callable[[str, int, list[Any]], None]
PositionListener = Callable[[str, int], None]

#: Default bound on waiting for another process to reach a position (seconds).
WAIT_FOR_POSITION_TIMEOUT_S = 5.0


class Source(Protocol):
    def get_updates(self, instance: str, from_token: int, to_token: int, limit: int = ...) -> Deferred[Any]: ...


class _StreamView:
    """One stream as this process sees it."""

    def __init__(self, stream: StreamDef, positions: Mapping[str, int]) -> None:
        self.stream = stream
        self.positions: dict[str, int] = dict(positions)
        self.pending_batches: dict[str, list[Any]] = {}
        self.queue: deque[tuple[Connection, RdataCommand | PositionCommand]] = deque()
        self.busy = False
        self.waiters: dict[str, list[tuple[int, Deferred[bool]]]] = {}
        self.row_handlers: list[RowHandler] = []
        self.position_listeners: list[PositionListener] = []


class HandlerStats:
    """Counters for the metrics endpoint."""

    def __init__(self) -> None:
        self.rdata_applied = 0
        self.rdata_stale = 0
        self.rdata_unconnected = 0
        self.bad_rows = 0
        self.catch_ups = 0
        self.rows_caught_up = 0
        self.unknown_stream_commands = 0
        self.positions_refused = 0


class ReplicationHandler:
    """Tracks and announces stream positions for one process.

    Args:
        instance_name: this process.
        clock: the reactor's time.
        streams: the streams this process knows, by name.
        sources: a catch-up source per stream.
        generators: the ID generators of the streams this process writes.
        initial_positions: writer positions per stream loaded at start-up.
        audit: records position announcements.
        tick_interval_s: how often idle writers leap and positions persist.
        persist: called as ``persist(stream, position)`` (returning a
            Deferred) to store this writer's position; None to skip.
        guard: checks every position another writer claims against the
            stream's sequence before it is applied; None to trust them all.
    """

    def __init__(
        self,
        instance_name: str,
        clock: IReactorTime,
        *,
        streams: Mapping[str, StreamDef],
        sources: Mapping[str, Source],
        generators: Mapping[str, MultiWriterIdGenerator] | None = None,
        initial_positions: Mapping[str, Mapping[str, int]] | None = None,
        audit: AuditLog | None = None,
        tick_interval_s: float = 1.0,
        persist: Callable[[str, int], Deferred[Any]] | None = None,
        guard: PositionGuard | None = None,
    ) -> None:
        self.instance_name = instance_name
        self.clock = clock
        self.sources = dict(sources)
        self.generators = dict(generators or {})
        self.audit = audit
        self.tick_interval_s = tick_interval_s
        self.persist = persist
        self.guard = guard
        #: Where this process's own commands go (the hub, the client service, Redis).
        self.transport: Connection | None = None
        self.stats = HandlerStats()
        initial = initial_positions or {}
        self.views = {name: _StreamView(s, initial.get(name, {})) for name, s in streams.items()}
        self._connected: dict[int, set[tuple[str, str]]] = {}
        self._warned_streams: set[str] = set()
        self._announced: dict[str, int] = {}
        self._persist_lock = DeferredLock()
        self._tick_call: IDelayedCall | None = None
        self._command_listeners: dict[type, list[Callable[[Connection, Any], object]]] = {}
        for name, gen in self.generators.items():
            self.views[name].positions[instance_name] = gen.position
            self._announced[name] = gen.position
            gen.add_listener(self._local_listener(name))
        self._dispatch: dict[type, Callable[[Connection, Any], None]] = {
            RdataCommand: self._on_stream_command,
            PositionCommand: self._on_stream_command,
            ReplicateCommand: self._on_replicate,
            AuthCommand: self._ignore,  # consumed by the connection core
            PingCommand: self._ignore,
            ServerCommand: self._ignore,
            NameCommand: self._ignore,
            ErrorCommand: self._ignore,
            UserSyncCommand: self._ignore,
            ClearUserSyncCommand: self._ignore,
            FederationAckCommand: self._ignore,
            RemoteServerUpCommand: self._ignore,
        }

    # -- wiring ------------------------------------------------------------------------

    def set_transport(self, transport: Connection) -> None:
        self.transport = transport

    def add_row_handler(self, stream: str, fn: RowHandler) -> None:
        """``fn(instance, token, rows)`` runs before the position advances (e.g. invalidation)."""
        self.views[stream].row_handlers.append(fn)

    def add_position_listener(self, stream: str, fn: PositionListener) -> None:
        """``fn(instance, token)`` runs after a writer's position advanced (e.g. notifiers)."""
        self.views[stream].position_listeners.append(fn)

    def add_command_listener(self, kind: type, fn: Callable[[Connection, Any], object]) -> None:
        """Also call ``fn(conn, cmd)`` for every received command of this class.

        What ``fn`` returns is not waited for; a Deferred it returns that
        fails is logged.
        """
        self._command_listeners.setdefault(kind, []).append(fn)

    @property
    def dispatch_table(self) -> Mapping[type, Callable[[Connection, Any], None]]:
        """The handler of each command class (tests check it covers them all)."""
        return self._dispatch

    def start(self) -> None:
        """Start the periodic tick (idle leaps, position persistence)."""
        if self._tick_call is None:
            self._tick_call = self.clock.callLater(self.tick_interval_s, self._tick)

    def stop(self) -> Deferred[Any]:
        """Stop ticking and persist this writer's positions one last time.

        The Deferred fires once the final positions are stored (after any
        store already under way).
        """
        if self._tick_call is not None and self._tick_call.active():
            self._tick_call.cancel()
        self._tick_call = None
        return self._persist_positions()

    # -- queries --------------------------------------------------------------------------

    def position(self, stream: str, instance: str) -> int:
        """This process's view of one writer's position (0 if never heard of)."""
        return self.views[stream].positions.get(instance, 0)

    def add_writer(self, stream: str, instance: str, position: int) -> bool:
        """Count ``instance`` as a writer of ``stream`` from ``position`` (a writer that joins by resharding).

        ``position`` must be below every ID the writer can still complete, so
        that no token this process makes passes one of them. A writer already
        known keeps its position. Returns whether it was added.
        """
        view = self.views[stream]
        if instance in view.positions:
            return False
        view.positions[instance] = position
        return True

    def remove_writer(self, stream: str, instance: str, if_at: int) -> bool:
        """Forget ``instance`` as a writer of ``stream`` if its position is still ``if_at``.

        For a writer :meth:`add_writer` counted ahead of a hand-over that was
        rolled back: if it has not been heard from since, it has written
        nothing, and keeping it would hold every token's minimum at ``if_at``.
        Returns whether it was removed.
        """
        view = self.views[stream]
        if view.positions.get(instance) != if_at:
            return False
        del view.positions[instance]
        return True

    def positions(self, stream: str) -> dict[str, int]:
        """Every known writer's position on a stream."""
        return dict(self.views[stream].positions)

    def wait_for_position(
        self, stream: str, instance: str, position: int, timeout: float = WAIT_FOR_POSITION_TIMEOUT_S
    ) -> Deferred[bool]:
        """Fires True once the writer's position reaches ``position``, or False on timeout."""
        view = self.views.get(stream)
        if view is None or instance == self.instance_name or view.positions.get(instance, 0) >= position:
            return succeed(True)
        d: Deferred[bool] = Deferred()
        waiters = view.waiters.setdefault(instance, [])
        entry = (position, d)
        waiters.append(entry)

        def expire() -> None:
            if entry in waiters:
                waiters.remove(entry)
                logger.warning(
                    "timed out after %.1fs waiting for %s to reach %s %d (at %d)",
                    timeout, instance, stream, position, view.positions.get(instance, 0),
                )
                d.callback(False)

        call = self.clock.callLater(timeout, expire)

        def cancel_timer(result: bool) -> bool:
            if call.active():
                call.cancel()
            return result

        d.addCallback(cancel_timer)
        return d

    # -- connections -----------------------------------------------------------------------

    def new_connection(self, conn: Connection) -> None:
        """A connection came up: announce our positions on it."""
        self._connected[id(conn)] = set()
        for name, gen in self.generators.items():
            pos = gen.position
            self._announced[name] = pos
            conn.send_command(PositionCommand(name, self.instance_name, pos, pos))

    def lost_connection(self, conn: Connection, reason: Failure | None = None) -> None:
        """A connection went away: its writers' next commands start from a POSITION again."""
        self._connected.pop(id(conn), None)

    def on_command(self, conn: Connection, cmd: AnyCommand) -> None:
        self._dispatch[type(cmd)](conn, cmd)
        for fn in self._command_listeners.get(type(cmd), ()):
            try:
                result = fn(conn, cmd)
            except Exception:
                logger.exception("listener for %s failed", cmd.NAME)
                continue
            if isinstance(result, Deferred):
                result.addErrback(self._listener_failed, cmd)

    def on_commands(self, conn: Connection, cmds: list[AnyCommand]) -> None:
        """:meth:`on_command` for each of ``cmds`` (RDATA and POSITION), in order, with fewer calls per row."""
        listeners = self._command_listeners
        if listeners.get(RdataCommand) or listeners.get(PositionCommand):
            for cmd in cmds:
                self.on_command(conn, cmd)
            return
        me = self.instance_name
        views = self.views
        for cmd in cmds:
            try:
                if type(cmd) not in STREAM_COMMANDS:
                    self.on_command(conn, cmd)
                    continue
                view = views.get(cmd.stream_name)  # type: ignore[union-attr]
                if view is None or cmd.instance_name == me:  # type: ignore[union-attr]
                    self._on_stream_command(conn, cmd)  # type: ignore[arg-type]  # counted and logged there
                    continue
                self._deliver(view, conn, cmd)  # type: ignore[arg-type]
            except Exception:  # as when delivered one by one: the next command still gets handled
                logger.exception("error handling %s", cmd.NAME)

    def _listener_failed(self, failure: Any, cmd: AnyCommand) -> None:
        logger.error("listener for %s failed: %s", cmd.NAME, failure.getTraceback())

    def send_command(self, cmd: AnyCommand) -> None:
        """Send one of this process's commands over the transport."""
        if self.transport is not None:
            self.transport.send_command(cmd)

    def send_commands(self, cmds: Sequence[AnyCommand]) -> None:
        """:meth:`send_command` for each of ``cmds``, in one call where the transport takes a list."""
        transport = self.transport
        if transport is None or not cmds:
            return
        send_many = getattr(transport, "send_commands", None)
        if send_many is not None:
            send_many(cmds)
        else:
            for cmd in cmds:
                transport.send_command(cmd)

    def _ignore(self, conn: Connection, cmd: AnyCommand) -> None:
        pass

    def _on_replicate(self, conn: Connection, cmd: ReplicateCommand) -> None:
        for name, gen in self.generators.items():
            pos = gen.position
            self._announced[name] = pos
            self.send_command(PositionCommand(name, self.instance_name, pos, pos))

    # -- reading: per-stream ordered processing ---------------------------------------------

    def _on_stream_command(self, conn: Connection, cmd: RdataCommand | PositionCommand) -> None:
        if cmd.instance_name == self.instance_name:
            return  # our own echo (Redis delivers our publishes back to us)
        view = self.views.get(cmd.stream_name)
        if view is None:
            self.stats.unknown_stream_commands += 1
            if cmd.stream_name not in self._warned_streams:
                self._warned_streams.add(cmd.stream_name)
                logger.warning(
                    "ignoring %s for unknown stream %r from %s (a newer peer?); logged once",
                    cmd.NAME, cmd.stream_name, cmd.instance_name,
                )
            return
        self._deliver(view, conn, cmd)

    def _deliver(self, view: _StreamView, conn: Connection, cmd: RdataCommand | PositionCommand) -> None:
        """Process ``cmd`` in its stream's order: queued behind what the stream is processing, else now.

        A row with nothing queued before it and no guard to ask is processed
        here, as :meth:`_drain` would process it, without a trip through the
        queue; the stream is busy meanwhile, so a command delivered while it
        is applied (by a row handler) waits for it.
        """
        if view.busy or view.queue or self.guard is not None or type(cmd) is not RdataCommand:
            view.queue.append((conn, cmd))
            if not view.busy:
                self._drain(view)
            return
        view.busy = True
        try:
            self._process_rdata(view, conn, cmd)
        except Exception:
            logger.exception("error processing %s on %s", cmd.NAME, view.stream.name)
        view.busy = False
        if view.queue:  # delivered while it was processed
            self._drain(view)

    def _drain(self, view: _StreamView) -> None:
        view.busy = True
        while view.queue:
            conn, cmd = view.queue.popleft()
            d: Deferred[Any] | None
            try:
                verdict = True if self.guard is None else self.guard.check_command(cmd)
                if verdict is False:
                    self._refused(view, cmd)
                    continue
                if verdict is True:
                    if type(cmd) is RdataCommand:  # the bulk of the traffic: one call less
                        self._process_rdata(view, conn, cmd)
                        continue
                    d = self._process(view, conn, cmd)
                else:
                    d = verdict.addCallback(self._process_if_allowed, view, conn, cmd)
            except Exception:
                logger.exception("error processing %s on %s", cmd.NAME, view.stream.name)
                continue
            if d is not None:
                d.addErrback(self._processing_failed, view, cmd)
                d.addCallback(lambda _: self._drain(view))
                return
        view.busy = False

    def _process(self, view: _StreamView, conn: Connection, cmd: RdataCommand | PositionCommand) -> Deferred[None] | None:
        if isinstance(cmd, RdataCommand):
            self._process_rdata(view, conn, cmd)
            return None
        return self._process_position(view, conn, cmd)

    def _process_if_allowed(
        self, allowed: bool, view: _StreamView, conn: Connection, cmd: RdataCommand | PositionCommand
    ) -> Deferred[None] | None:
        if allowed:
            return self._process(view, conn, cmd)
        self._refused(view, cmd)
        return None

    def _refused(self, view: _StreamView, cmd: RdataCommand | PositionCommand) -> None:
        """A claim beyond the stream's sequence: nothing of it is applied (the guard logged it)."""
        self.stats.positions_refused += 1
        view.pending_batches.pop(cmd.instance_name, None)

    def _processing_failed(self, failure: Any, view: _StreamView, cmd: RdataCommand | PositionCommand) -> None:
        logger.error(
            "processing %s of %s from %s failed: %s; will retry on its next POSITION",
            cmd.NAME, view.stream.name, cmd.instance_name, failure.getErrorMessage(),
        )

    def _process_rdata(self, view: _StreamView, conn: Connection, cmd: RdataCommand) -> None:
        instance = cmd.instance_name
        if (view.stream.name, instance) not in self._connected.get(id(conn), ()):
            self.stats.rdata_unconnected += 1
            return
        try:
            row = view.stream.row_type.from_wire(cmd.row)  # type: ignore[attr-defined]
        except ProtocolError as e:
            self.stats.bad_rows += 1
            logger.warning("dropping bad %s row from %s: %s", view.stream.name, instance, e)
            return
        if cmd.token is None:
            view.pending_batches.setdefault(instance, []).append(row)
            return
        rows = view.pending_batches.pop(instance, None) if view.pending_batches else None
        if rows is None:
            rows = [row]
        else:
            rows.append(row)
        if cmd.token <= view.positions.get(instance, 0):
            self.stats.rdata_stale += 1
            return
        self.stats.rdata_applied += 1
        self._apply(view, instance, cmd.token, rows)

    def _process_position(self, view: _StreamView, conn: Connection, cmd: PositionCommand) -> Deferred[None] | None:
        instance = cmd.instance_name
        key = (view.stream.name, instance)
        view.pending_batches.pop(instance, None)
        if instance not in view.positions and view.stream.writers is Writers.ANY:
            # A process we never heard of: nothing of its caches rows matters
            # from before it announced itself.
            view.positions[instance] = cmd.prev_token
        cur = view.positions.get(instance, 0)
        connected = self._connected.setdefault(id(conn), set())
        if cmd.prev_token <= cur <= cmd.new_token or cur > cmd.new_token:
            if cmd.new_token > cur:
                self._apply(view, instance, cmd.new_token, [])
            connected.add(key)
            return None
        source = self.sources.get(view.stream.name)
        if source is None:
            logger.warning("no catch-up source for %s; advancing %s to %d", view.stream.name, instance, cmd.new_token)
            self._apply(view, instance, cmd.new_token, [])
            connected.add(key)
            return None
        self.stats.catch_ups += 1
        logger.info("catching up %s of %s from %d to %d", view.stream.name, instance, cur, cmd.new_token)
        return Deferred.fromCoroutine(self._catch_up(view, source, conn, cmd))

    async def _catch_up(self, view: _StreamView, source: Source, conn: Connection, cmd: PositionCommand) -> None:
        await self._read_up_to(view, source, cmd.instance_name, cmd.new_token)
        if id(conn) in self._connected:
            self._connected[id(conn)].add((view.stream.name, cmd.instance_name))

    async def catch_up_writer(self, stream: str, instance: str, upto: int) -> None:
        """Read ``instance``'s rows of ``stream`` up to ``upto`` from the catch-up source and apply them.

        For a writer that will announce nothing more (one removed from the shard map while
        it was dead): what it committed but never announced is read from the database.
        ``upto`` must be a position the writer has completed everything up to.
        """
        view = self.views[stream]
        source = self.sources.get(stream)
        if source is None or upto <= view.positions.get(instance, 0):
            return
        self.stats.catch_ups += 1
        logger.info("catching up %s of %s to %d from the database", stream, instance, upto)
        await self._read_up_to(view, source, instance, upto)

    async def _read_up_to(self, view: _StreamView, source: Source, instance: str, new_token: int) -> None:
        cur = view.positions.get(instance, 0)
        while cur < new_token:
            updates, upto, limited = await source.get_updates(instance, cur, new_token)
            group: list[Any] = []
            for i, (token, row) in enumerate(updates):
                group.append(row)
                if i + 1 == len(updates) or updates[i + 1][0] != token:
                    if token > view.positions.get(instance, 0):
                        self._apply(view, instance, token, group)
                        self.stats.rows_caught_up += len(group)
                    group = []
            if not limited:
                break
            cur = max(upto, view.positions.get(instance, 0))
        if new_token > view.positions.get(instance, 0):
            self._apply(view, instance, new_token, [])

    # -- applying ---------------------------------------------------------------------------------

    def _apply(self, view: _StreamView, instance: str, token: int, rows: list[Any]) -> None:
        """Rows at ``token``: handlers, then the advance, then listeners, then waiters."""
        if rows:
            for fn in view.row_handlers:
                try:
                    fn(instance, token, rows)
                except Exception:
                    logger.exception("row handler of %s failed", view.stream.name)
        if token > view.positions.get(instance, 0):
            view.positions[instance] = token
        gen = self.generators.get(view.stream.name)
        if gen is not None and instance != self.instance_name:
            gen.observe_position(token)
        for listener in view.position_listeners:
            try:
                listener(instance, token)
            except Exception:
                logger.exception("position listener of %s failed", view.stream.name)
        waiters = view.waiters.get(instance)
        if waiters:
            ready = [w for w in waiters if w[0] <= token]
            for w in ready:
                waiters.remove(w)
                w[1].callback(True)

    # -- writing -------------------------------------------------------------------------------

    def _local_listener(self, stream: str) -> Callable[[list[Completed[FactPayload]], int], None]:
        rdata = rdata_builder(stream, self.instance_name)  # this writer's rows of the stream

        def on_visible(visible: list[Completed[FactPayload]], position: int) -> None:
            self._announce_local(stream, visible, position, rdata)

        return on_visible

    def _announce_local(self, stream: str, visible: list[Completed[FactPayload]], position: int,
                        rdata: Callable[[int | None, list[Any]], RdataCommand]) -> None:
        view = self.views[stream]
        me = self.instance_name
        if self.guard is not None:
            self.guard.note_allocated(stream, position)
        announced = self._announced.get(stream, 0)
        cmds: list[AnyCommand] = []
        append = cmds.append
        with write_batch:  # the announcement's lines go out in one write per connection
            try:
                for fact in visible:
                    if not fact.ok or fact.payload is None or not fact.payload.rows:
                        continue
                    rows = list(fact.payload.rows)
                    self._apply(view, me, fact.stream_id, rows)
                    for row in rows[:-1]:
                        append(rdata(None, row.to_wire()))
                    append(rdata(fact.stream_id, rows[-1].to_wire()))
                    announced = fact.stream_id
                if position > view.positions.get(me, 0):
                    self._apply(view, me, position, [])
                if position > announced:
                    append(PositionCommand(stream, me, announced, position))
                    announced = position
            finally:  # what was built before a failure still goes out
                self.send_commands(cmds)
        self._announced[stream] = announced
        if self.audit is not None:
            self.audit.position(stream, position)

    def _tick(self) -> None:
        self._tick_call = None
        for name, gen in self.generators.items():
            others = [p for i, p in self.views[name].positions.items() if i != self.instance_name]
            if others:
                gen.observe_position(max(others))
            gen.idle_advance()
        if not self._persist_lock.locked:  # a slow database must not pile up runs
            self._persist_positions()
        self._tick_call = self.clock.callLater(self.tick_interval_s, self._tick)

    def _persist_positions(self) -> Deferred[Any]:
        """Store every position that moved since it was last stored.

        Runs one at a time: a run asked for while another is under way (the
        final one from :meth:`stop`, say) waits for it, then stores the
        positions as they are by then.
        """
        if self.persist is None:
            return succeed(None)
        return self._persist_lock.run(self._persist_now)

    def _persist_now(self) -> Deferred[None]:
        return Deferred.fromCoroutine(self._persist_all())

    async def _persist_all(self) -> None:
        assert self.persist is not None
        for name, gen in self.generators.items():
            pos = gen.position
            if pos <= gen.persisted_position:
                continue
            try:
                await self.persist(name, pos)
            except Exception as e:
                logger.warning("could not persist position %d of %s: %s", pos, name, e)
            else:
                gen.persisted_position = max(gen.persisted_position, pos)
