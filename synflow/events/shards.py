"""Live resharding of the ``events`` stream: the shard map's epochs, the write fence, and the hand-over.

Rooms map to persisters through a :class:`~synflow.sharding.ShardMap`: the
configured ``stream_writers.events`` as its base, then one step per epoch (a
persister added or removed). The epochs live in the database
(``shard_epochs``), the current one and the hand-over in progress in
``shard_state``; every process follows them (:class:`ShardFollower`).

The hand-over rule (one coordinator, the master: :class:`Resharder`):

1. **Propose.** Epoch ``e+1`` is written as *pending*, with the stream's last
   allocated ID as its floor. From then on a persist transaction refuses
   every event of a *moving* room (one whose owner differs between ``e`` and
   ``e+1``) with ``M_ROOM_MOVING``; transactions that began under ``e`` have
   finished before the proposal committed (the fence, below).
2. **Prepare.** Every process reloads the map and answers. Each one adds the
   new writer to its view of the stream at the floor -- below any ID the new
   writer can take -- so no process's token can pass an event the new owner
   has yet to finish; routers hold the sends of moving rooms. When a writer
   is added, every process must answer; when one is removed, nobody's view
   gains a writer, so the epoch commits even if some process (the removed
   persister itself, say, if it died) does not answer.
3. **Commit.** Epoch ``e+1`` becomes current. The new owners write the moved
   rooms from the database's committed state (room heads, members), with IDs
   from the shared sequence, so after every ID the old owner reserved.
   Routers release the held sends to the new owners.

If a process fails to answer the prepare of an added writer, the epoch is rolled back: the old
map stays, and held sends go back to the old owners. A master that restarts
with a pending epoch rolls it back. Either way no write of a moving room
could commit under the pending epoch.

**The fence.** Every persist transaction reads its stream's ``shard_state``
row -- on PostgreSQL ``FOR KEY SHARE``, which a coordinator's ``FOR UPDATE``
waits for; on SQLite the write lock orders them -- and checks each event's
room against the map it names. A persister whose view of the map is stale
can therefore never write a room it does not own, whatever its in-memory
state: the database decides.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final

import attrs
from twisted.internet.defer import Deferred, gatherResults
from twisted.python.failure import Failure

from synflow.errors import HttpApiError, ShardingError
from synflow.metrics import counter, gauge, histogram
from synflow.sharding import ShardMap, ShardStep
from synflow.storage.engines import Database, Txn
from synflow.storage.id_generators import last_allocated_txn
from synflow.streams import EVENTS

logger = logging.getLogger(__name__)

#: How often a router holding sends looks at the database for the end of a hand-over.
POLL_S: Final = 0.1
#: How long a send of a moving room waits at the router by default before 503 + ``Retry-After``.
DEFAULT_MAX_WAIT_S: Final = 10.0
#: Tries of each process's reload during a hand-over (a dead process must not hold the hand-over up).
PREPARE_ATTEMPTS: Final = 2
#: The RPC every process serves to reload the map.
RELOAD_RPC: Final = "shard_map_reload"
#: The master's RPC that runs one reshard.
RESHARD_RPC: Final = "reshard"
#: The master's RPC that describes the map.
SHARDS_RPC: Final = "shards"

ROOMS_PER_WRITER = gauge("synflow_shard_rooms", "Rooms each event persister owns, as of the last epoch change",
                         ["writer"])
HANDOVERS_IN_PROGRESS = gauge("synflow_shard_handovers_in_progress", "Epoch changes proposed and not yet over")
HANDOVER_SECONDS = histogram("synflow_shard_handover_seconds", "Time from proposing an epoch to its commit",
                             buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
SENDS_WAITING = gauge("synflow_shard_sends_waiting", "Sends held at this router while their room moves")
SENDS_HELD = counter("synflow_shard_sends_held_total", "Sends held at this router until a hand-over ended")
SENDS_REROUTED = counter("synflow_shard_sends_rerouted_total",
                         "Sends a persister refused for a stale shard map, re-routed by this router")
SHARD_EPOCH = gauge("synflow_shard_epoch", "The shard-map epoch this process follows, per group", ["group"])


@attrs.frozen
class ShardState:
    """The map a process follows: the current epoch's, and the pending one's during a hand-over."""

    current: ShardMap
    pending: ShardMap | None = None
    #: Internal addresses of writers added by resharding: ``{name: (host, port)}``.
    addresses: Mapping[str, tuple[str, int]] = attrs.field(factory=dict)
    #: The stream's last allocated ID when the pending epoch was proposed.
    floor: int = 0

    @property
    def key(self) -> tuple[int, int | None]:
        return self.current.epoch, None if self.pending is None else self.pending.epoch

    def moving(self, room_id: str) -> bool:
        """Whether ``room_id`` changes owner in the hand-over in progress."""
        return self.pending is not None and self.pending.owner(room_id) != self.current.owner(room_id)

    def writers(self) -> set[str]:
        """Every writer of the current and the pending map."""
        return set(self.current.writers) | set(() if self.pending is None else self.pending.writers)


# -- storage ------------------------------------------------------------------------------------


def read_state_row_txn(txn: Txn, stream: str = EVENTS.name, *, lock: str = "") -> tuple[int, int | None]:
    """``(epoch, pending)`` of ``stream``; ``lock`` is ``"share"`` (the fence) or ``"update"`` (the coordinator)."""
    suffix = ""
    if txn.engine.name == "postgres" and lock:
        suffix = " FOR KEY SHARE" if lock == "share" else " FOR UPDATE"
    txn.execute(f"SELECT epoch, pending FROM shard_state WHERE stream = ?{suffix}", (stream,))
    row = txn.fetchone()
    if row is None:
        return 0, None
    return int(row[0]), None if row[1] is None else int(row[1])


def load_state_txn(txn: Txn, base: Sequence[str], stream: str = EVENTS.name, *, lock: str = "") -> ShardState:
    """The stored map of ``stream``; ``base`` (the config's list) until the first reshard stores its own."""
    epoch, pending = read_state_row_txn(txn, stream, lock=lock)
    return _load_epochs_txn(txn, base, stream, epoch, pending)


def _load_epochs_txn(txn: Txn, base: Sequence[str], stream: str, epoch: int, pending: int | None) -> ShardState:
    txn.execute("SELECT epoch, op, writer, writers, address, state, floor_position FROM shard_epochs "
                "WHERE stream = ? ORDER BY epoch", (stream,))
    rows = txn.fetchall()
    steps: list[ShardStep] = []
    addresses: dict[str, tuple[str, int]] = {}
    pending_step: ShardStep | None = None
    floor = 0
    for number, op, writer, writers, address, state, floor_position in rows:
        number = int(number)
        if number == 0:
            base = json.loads(writers)
            continue
        if address:
            host, port = json.loads(address)
            addresses[writer] = (str(host), int(port))
        if state == "current" and number <= epoch:
            steps.append(ShardStep(op, writer))
        elif number == pending and state == "pending":
            pending_step = ShardStep(op, writer)
            floor = int(floor_position)
    current = ShardMap(base, steps, epoch)
    return ShardState(current, None if pending_step is None else current.then(pending_step, pending),
                      addresses, floor)


class ShardFence:
    """What a persist transaction checks: the stored map, read under the fence lock, cached by epoch."""

    def __init__(self, base: Sequence[str], stream: str = EVENTS.name) -> None:
        self.base = list(base)
        self.stream = stream
        self._cached: ShardState | None = None

    def read_txn(self, txn: Txn) -> ShardState:
        epoch, pending = read_state_row_txn(txn, self.stream, lock="share")
        cached = self._cached
        if cached is not None and cached.key == (epoch, pending):
            return cached
        state = self._cached = _load_epochs_txn(txn, self.base, self.stream, epoch, pending)
        return state


# -- following the map ---------------------------------------------------------------------------------


class ShardFollower:
    """One process's view of the map: reloaded on a coordinator's call, and polled while sends wait.

    Args:
        db: the deployment's database.
        base: ``stream_writers.events``.
        clock: for polling.
        on_state: called with each new state (to add new writers to the replication view,
            their addresses to the RPC client).
    """

    def __init__(self, db: Database, base: Sequence[str], clock: Any,
                 on_state: Callable[[ShardState], None] | None = None, group: str = EVENTS.name) -> None:
        self.db = db
        self.group = group
        self.base = list(base)
        self.clock = clock
        self.on_state = on_state
        self.state = ShardState(ShardMap(self.base))
        self._loading = False
        self._next: list[Deferred[ShardState]] = []
        self._waiters: list[Deferred[bool]] = []
        self._poll: Any = None

    def reload(self) -> Deferred[ShardState]:
        """Read the map from the database and apply it.

        Callers share reads, but never one that began before their call: a
        reload asked for during a read waits for the next read, so it sees
        every change committed before it was asked for.
        """
        d: Deferred[ShardState] = Deferred()
        self._next.append(d)
        if not self._loading:
            self._read()
        return d

    def _read(self) -> None:
        self._loading = True
        waiters, self._next = self._next, []
        d = self.db.run_interaction("load_shard_map", load_state_txn, self.base, self.group, read_only=True,
                                    idempotent=True)

        def done(result: Any) -> None:
            self._loading = False
            if isinstance(result, Failure):
                for w in waiters:
                    w.errback(result)
            else:
                self.apply(result)
                for w in waiters:
                    w.callback(result)
            if self._next:
                self._read()

        d.addBoth(done)

    def apply(self, state: ShardState) -> None:
        """Follow ``state`` if it differs from the one followed; wakes every waiter."""
        if state.key == self.state.key:
            return
        logger.info("%s shard map: epoch %d%s, writers %s", self.group, state.current.epoch,
                    "" if state.pending is None else f" (epoch {state.pending.epoch} pending)",
                    list(state.current.writers))
        self.state = state
        SHARD_EPOCH.labels(group=self.group).set(state.current.epoch)
        if self.on_state is not None:
            self.on_state(state)
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.called:
                w.callback(True)

    async def wait_for_change(self, timeout_s: float) -> bool:
        """Wait until the followed state changes (polling the database); False after ``timeout_s``."""
        d: Deferred[bool] = Deferred()
        self._waiters.append(d)

        def expire() -> None:
            if not d.called:
                d.callback(False)

        timer = self.clock.callLater(timeout_s, expire)
        self._start_polling()
        try:
            return await d
        finally:
            if timer.active():
                timer.cancel()
            if d in self._waiters:
                self._waiters.remove(d)
            if not self._waiters and self._poll is not None and self._poll.active():
                self._poll.cancel()  # nobody waits: no timer outlives the last waiter
                self._poll = None

    def _start_polling(self) -> None:
        if self._poll is None or not self._poll.active():
            self._poll = self.clock.callLater(POLL_S, self._poll_once)

    def _poll_once(self) -> None:
        self._poll = None
        if not any(not w.called for w in self._waiters):
            self._waiters = []
            return

        def again(_: Any) -> None:
            if self._waiters:
                self._start_polling()

        self.reload().addErrback(lambda f: logger.warning("reloading the shard map failed: %s",
                                                          f.getErrorMessage())).addBoth(again)


# -- the coordinator -----------------------------------------------------------------------------------

#: The shard groups: rooms over event persisters, destinations over federation senders.
EVENTS_GROUP: Final = EVENTS.name
FEDERATION_GROUP: Final = "federation"
GROUPS: Final = (EVENTS_GROUP, FEDERATION_GROUP)
#: What each group's keys are, for messages.
_KEYS = {EVENTS_GROUP: "rooms", FEDERATION_GROUP: "destinations"}


class Resharder:
    """Runs hand-overs, one at a time, on the master.

    Args:
        db: the database.
        followers: the master's own :class:`ShardFollower` of each group it follows.
        rpc_client: calls every process's :data:`RELOAD_RPC`.
        instances: every process of the deployment (``instance_map``).
        clock: timestamps.
        self_name: the master's instance name.
    """

    def __init__(self, db: Database, followers: Mapping[str, ShardFollower], rpc_client: Any,
                 instances: Callable[[], Sequence[str]], clock: Any, self_name: str,
                 recover_audit: Callable[[str], Awaitable[int]] | None = None) -> None:
        self.db = db
        #: Re-records what a dead, removed events writer committed but never logged (see :meth:`reshard`).
        self.recover_audit = recover_audit
        self.followers = dict(followers)
        self.rpc = rpc_client
        self.instances = instances
        self.clock = clock
        self.self_name = self_name
        self.busy = False

    def _follower(self, group: str) -> ShardFollower:
        follower = self.followers.get(group)
        if follower is None:
            hint = " (federation_sender_instances is empty)" if group == FEDERATION_GROUP else ""
            raise HttpApiError(400, "M_INVALID_PARAM", f"shard group {group!r} does not reshard here{hint}")
        return follower

    async def recover(self) -> None:
        """At start-up: roll back the hand-overs a previous master left pending."""
        for group, follower in self.followers.items():
            state = await self.db.run_interaction("load_shard_map", load_state_txn, follower.base, group,
                                                  idempotent=True)
            if state.pending is not None:
                logger.warning("rolling back %s epoch %d, left pending by a previous master", group,
                               state.pending.epoch)
                await self._finish(group, state.pending.epoch, commit=False)
            await follower.reload()
            if group == EVENTS_GROUP:
                self._count(follower.state.current, await self._keys(group))

    async def _keys(self, group: str) -> list[str]:
        return await self.db.run_interaction(f"shard_keys_{group}", _keys_txn, group, read_only=True)

    async def describe(self, group: str = EVENTS_GROUP) -> dict[str, Any]:
        """The current epoch, keys per writer, the hand-over in progress and the epochs' history."""
        state = await self._follower(group).reload()
        keys = await self._keys(group)
        per_writer = {w: 0 for w in state.current.writers}
        for key in keys:
            owner = state.current.owner(key)
            per_writer[owner] = per_writer.get(owner, 0) + 1
        history = await self.db.run_interaction("shard_history", _history_txn, group, read_only=True)
        return {
            "group": group, "keys": _KEYS[group], "epoch": state.current.epoch,
            "writers": list(state.current.writers), "owned": per_writer,
            "pending": None if state.pending is None else {
                "epoch": state.pending.epoch, "writers": list(state.pending.writers),
                "moving": sum(1 for k in keys if state.moving(k))},
            "history": history,
        }

    async def reshard(self, op: str, writer: str, address: tuple[str, int] | None = None,
                      group: str = EVENTS_GROUP) -> dict[str, Any]:
        """Add or remove ``writer`` in ``group``: propose, prepare every process, commit (or roll back).

        ``op`` is ``"add"`` or ``"remove"`` (the RPC handler checks what it is sent).

        Raises:
            HttpApiError: 409 if a hand-over is already in progress or the change is impossible;
                503 if a process did not answer the prepare of an added writer (the epoch was rolled back).
        """
        follower = self._follower(group)
        if op == "add" and address is None and writer not in self.rpc.instance_map:
            raise HttpApiError(400, "M_INVALID_PARAM", f"adding {writer!r} needs its internal address")
        if self.busy:
            raise HttpApiError(409, "M_HANDOVER_IN_PROGRESS", "a hand-over is already in progress")
        self.busy = True
        HANDOVERS_IN_PROGRESS.inc()
        started = time.perf_counter()
        try:
            try:
                epoch, new_map, old_map = await self.db.run_interaction(
                    "propose_epoch", _propose_txn, follower.base, ShardStep(op, writer),  # type: ignore[arg-type]
                    None if address is None else list(address), int(self.clock.seconds() * 1000), group)
            except ShardingError as e:
                raise HttpApiError(409, "M_INVALID_PARAM", str(e)) from None
            if address is not None:
                self.rpc.instance_map.setdefault(writer, _host_port(address))
            failed = await self._prepare(group, epoch, writer if op == "add" else None)
            dead = op == "remove" and any(f.startswith(f"{writer}:") for f in failed)
            if failed and op == "remove":
                # Nobody joins a view when a writer leaves: a process that missed the prepare only
                # learns of the move later (the fence refuses its writes, and its router re-routes).
                # So a dead persister or sender can be removed.
                logger.warning("%s epoch %d: committing without %s", group, epoch, "; ".join(failed))
            elif failed:
                await self._finish(group, epoch, commit=False)
                await self._broadcast()
                raise HttpApiError(503, "M_HANDOVER_FAILED",
                                   f"epoch {epoch} rolled back: {'; '.join(failed)}", retry_after_ms=1000)
            keys = await self._keys(group)
            moved = sum(1 for k in keys if new_map.owner(k) != old_map.owner(k))
            await self._finish(group, epoch, commit=True, moved=moved, total=len(keys))
            await self._broadcast()
            seconds = time.perf_counter() - started
            HANDOVER_SECONDS.observe(seconds)
            if group == EVENTS_GROUP:
                self._count(new_map, keys)
                if dead and self.recover_audit is not None:
                    # It can commit nothing more: record in its audit log what it committed last,
                    # as its own start-up would have (the validator needs every event's writer record).
                    recovered = await self.recover_audit(writer)
                    if recovered:
                        logger.warning("re-recorded %d events of removed writer %s missing from its audit log",
                                       recovered, writer)
            logger.info("%s epoch %d is current: %s %s; %d of %d %s moved in %.3fs", group, epoch, op, writer, moved,
                        len(keys), _KEYS[group], seconds)
            return {"group": group, "epoch": epoch, "op": op, "writer": writer, "writers": list(new_map.writers),
                    "keys": _KEYS[group], "moved": moved, "total": len(keys), "seconds": round(seconds, 4)}
        finally:
            self.busy = False
            HANDOVERS_IN_PROGRESS.dec()

    async def _prepare(self, group: str, epoch: int, joining: str | None) -> list[str]:
        """Every process reloads the maps; the problems of those that did not follow ``group``'s epoch ``epoch``.

        A federation sender answers only once it has stopped the queues of the destinations
        it gives away (their in-flight transactions finished, their positions stored).
        """
        names = sorted({*self.instances(), *([joining] if joining else [])})

        async def one(name: str) -> str | None:
            try:
                if name == self.self_name:
                    state = await self.followers[group].reload()
                    pending = None if state.pending is None else state.pending.epoch
                else:
                    answer = await self.rpc.call(name, RELOAD_RPC, {}, attempts=PREPARE_ATTEMPTS)
                    if isinstance(answer, dict) and group != EVENTS_GROUP:
                        answer = answer.get(group)
                    if not isinstance(answer, dict):
                        return None  # a process that does not follow this group
                    pending = answer.get("pending")
            except HttpApiError as e:
                if e.code == 404 and e.errcode == "M_UNRECOGNIZED":
                    return None  # a process that does not follow the shard maps
                return f"{name}: {e.msg}"
            except Exception as e:  # any failure of one process counts
                return f"{name}: {type(e).__name__}: {e}"
            return None if pending == epoch else f"{name} follows pending epoch {pending}, not {epoch}"

        answers = await gatherResults([Deferred.fromCoroutine(one(n)) for n in names], consumeErrors=True)
        return [a for a in answers if a is not None]

    async def _finish(self, group: str, epoch: int, *, commit: bool, moved: int | None = None,
                      total: int | None = None) -> None:
        await self.db.run_interaction("finish_epoch", _finish_txn, epoch, commit, moved, total,
                                      int(self.clock.seconds() * 1000), group)
        await self.followers[group].reload()

    async def _broadcast(self) -> None:
        """Tell every process to reload (best effort: routers holding sends also poll)."""
        async def one(name: str) -> None:
            try:
                await self.rpc.call(name, RELOAD_RPC, {}, attempts=PREPARE_ATTEMPTS)
            except Exception as e:  # any failure of one process counts
                logger.info("%s did not reload the shard map now (%s); it will on its own", name, e)

        names = [n for n in self.instances() if n != self.self_name]
        await gatherResults([Deferred.fromCoroutine(one(n)) for n in names], consumeErrors=True)

    def _count(self, shard_map: ShardMap, rooms: Sequence[str]) -> None:
        counts = {w: 0 for w in shard_map.writers}
        for room in rooms:
            counts[shard_map.owner(room)] += 1
        ROOMS_PER_WRITER.clear()
        for w, n in counts.items():
            ROOMS_PER_WRITER.labels(writer=w).set(n)


def _host_port(address: tuple[str, int]) -> Any:
    from synflow.config import HostPort

    return HostPort(address[0], int(address[1]))


def _propose_txn(txn: Txn, base: Sequence[str], step: ShardStep, address: list[Any] | None,
                 now_ms: int, group: str = EVENTS_GROUP) -> tuple[int, ShardMap, ShardMap]:
    epoch, pending = read_state_row_txn(txn, group, lock="update")
    if pending is not None:
        raise HttpApiError(409, "M_HANDOVER_IN_PROGRESS", f"{group} epoch {pending} is still being handed over")
    state = _load_epochs_txn(txn, base, group, epoch, None)
    state.current.then(step)  # raises ShardingError for an impossible change
    txn.execute("SELECT COALESCE(MAX(epoch), 0) FROM shard_epochs WHERE stream = ?", (group,))
    row = txn.fetchone()
    number = max(int(row[0]) if row else 0, epoch) + 1
    new_map = state.current.then(step, number)
    # Below every ID a joining writer of the events stream can take (IDs come from one sequence).
    floor = last_allocated_txn(txn, EVENTS) if group == EVENTS_GROUP else 0
    txn.execute("SELECT 1 FROM shard_epochs WHERE stream = ? AND epoch = 0", (group,))
    if txn.fetchone() is None:
        txn.execute("INSERT INTO shard_epochs (stream, epoch, op, writer, writers, address, state, floor_position, "
                    "proposed_ts, finished_ts) VALUES (?, 0, 'base', '', ?, NULL, 'current', ?, ?, ?)",
                    (group, json.dumps(list(state.current.base)), floor, now_ms, now_ms))
    txn.execute("INSERT INTO shard_epochs (stream, epoch, op, writer, writers, address, state, floor_position, "
                "proposed_ts) VALUES (?, ?, ?, ?, ?, ?, 'pending', ?, ?)",
                (group, number, step.op, step.writer, json.dumps(list(new_map.writers)),
                 None if address is None else json.dumps(address), floor, now_ms))
    txn.execute("UPDATE shard_state SET pending = ? WHERE stream = ?", (number, group))
    return number, new_map, state.current


def _finish_txn(txn: Txn, epoch: int, commit: bool, moved: int | None, total: int | None, now_ms: int,
                group: str = EVENTS_GROUP) -> None:
    _, pending = read_state_row_txn(txn, group, lock="update")
    if pending != epoch:
        raise HttpApiError(409, "M_HANDOVER_IN_PROGRESS", f"{group} epoch {epoch} is not pending (pending: {pending})")
    if commit:
        txn.execute("UPDATE shard_state SET epoch = ?, pending = NULL WHERE stream = ?", (epoch, group))
    else:
        txn.execute("UPDATE shard_state SET pending = NULL WHERE stream = ?", (group,))
    txn.execute("UPDATE shard_epochs SET state = ?, finished_ts = ?, moved = ?, total = ? "
                "WHERE stream = ? AND epoch = ?",
                ("current" if commit else "rolled_back", now_ms, moved, total, group, epoch))


def _keys_txn(txn: Txn, group: str) -> list[str]:
    if group == FEDERATION_GROUP:
        txn.execute("SELECT destination FROM destinations UNION SELECT destination FROM destination_rooms")
    else:
        txn.execute("SELECT room_id FROM rooms")
    return [r[0] for r in txn.fetchall()]


def _history_txn(txn: Txn, group: str = EVENTS_GROUP) -> list[dict[str, Any]]:
    txn.execute("SELECT epoch, op, writer, writers, state, proposed_ts, finished_ts, moved, total "
                "FROM shard_epochs WHERE stream = ? ORDER BY epoch", (group,))
    keys = ("epoch", "op", "writer", "writers", "state", "proposed_ts", "finished_ts", "moved", "total")
    out = []
    for row in txn.fetchall():
        item = dict(zip(keys, row, strict=True))
        item["writers"] = json.loads(item["writers"])
        out.append(item)
    return out
