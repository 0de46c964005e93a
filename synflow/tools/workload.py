"""A client workload against a running deployment, and the check of what it got back.

:class:`Workload` registers users, creates rooms with several members, then
sends messages through the client API of several processes while every user
runs a chain of syncs (each ``since`` the previous ``next_batch``, against a
random process). :meth:`Workload.verify` checks, from the responses alone,
that each user's chain received every message of their rooms exactly once,
with no gaps, and that every user saw each room's messages in the same
order. It measures send latency and send -> visible-in-sync latency.

Used by the main job (``scripts/demo``), the integration tests and the
benchmarks.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
from twisted.internet import reactor
from twisted.internet.defer import (
    CancelledError,
    Deferred,
    DeferredSemaphore,
    ensureDeferred,
    gatherResults,
)
from twisted.internet.task import deferLater

from synflow.backoff import Backoff
from synflow.sharding import shard_for
from synflow.tools.client import ApiError, Client, new_pool, retry_delay_s

#: A send that meets a 5xx, a 429 or a transport error is tried up to this many
#: times with the same transaction ID, pausing :data:`SEND_BACKOFF` between tries
#: (0.2, 0.4, 0.8, 1.6, then 2 s: about 9 s in all), longer than a process takes
#: to restart, so a client rides out a restart of the process it sends through.
SEND_ATTEMPTS = 8
SEND_BACKOFF = Backoff(initial_s=0.2, multiplier=2.0, max_s=2.0, jitter=0.0)


@attrs.define
class UserState:
    client: Client
    server: str = ""
    rooms: set[str] = attrs.Factory(set)
    since: str | None = None
    delivered: list[tuple[str, str]] = attrs.Factory(list)  # (room_id, event_id)
    syncs: int = 0
    errors: int = 0
    online: bool = False
    #: Whether its sync chain (:meth:`Workload.sync_chains`) is running: then no other sync of its is made.
    chain_running: bool = False


@attrs.define
class Report:
    users: int
    rooms: int
    sent: int
    send_errors: int
    lost: int
    duplicated: int
    order_mismatches: int
    foreign: int
    sync_requests: int
    federated_expected: int
    federated_delivered: int
    send_seconds: float
    events_per_s: float
    send_latency_ms: dict[str, float]
    visible_latency_ms: dict[str, float]
    latencies_ms: list[float]

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.duplicated == 0 and self.order_mismatches == 0 and self.foreign == 0

    def as_dict(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d.pop("latencies_ms")
        d["ok"] = self.ok
        return d


def quantile(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile (0 < q <= 1, in steps of 0.01) of ``values``, by :func:`statistics.quantiles`; 0.0 if empty."""
    data = [float(v) for v in values]
    if len(data) < 2:
        return data[0] if data else 0.0
    if q >= 1:
        return max(data)
    return statistics.quantiles(data, n=100, method="inclusive")[max(0, round(q * 100) - 1)]


def percentiles(values: list[float]) -> dict[str, float]:
    """p50, p95, p99 and the maximum of ``values`` (all 0.0 if empty)."""
    return {"p50": quantile(values, 0.50), "p95": quantile(values, 0.95), "p99": quantile(values, 0.99),
            "max": max(values, default=0.0)}


def _deferred(coro: Any) -> Any:
    return ensureDeferred(coro)


class Workload:
    """Drives users, rooms, messages and sync chains against client API URLs.

    Args:
        urls: base URLs of processes with a client listener.
        users / rooms / members_per_room / messages: the size of the workload.
        concurrency: sends in flight at once.
        seed: makes the workload reproducible.
        progress: called as ``progress(done, total)`` while sending.
        name_prefix: distinguishes users of several workloads on one server.
        room_shards: when given, the event persisters of the first server (its
            ``stream_writers.events`` list); the rooms that carry traffic are then
            spread evenly over them, so that uniform traffic over the rooms is
            uniform over the persisters. Rooms created beyond a full shard's share
            are left without traffic.
    """

    def __init__(self, urls: list[str] | dict[str, list[str]], *, users: int = 20, rooms: int = 40,
                 members_per_room: int = 4, messages: int = 1000, concurrency: int = 16, seed: int = 1,
                 progress: Callable[[int, int], None] | None = None, name_prefix: str = "u",
                 sync_timeout_ms: int = 2000, remote_members: int = 1,
                 room_shards: Sequence[str] | None = None) -> None:
        # One server (a list of its client URLs) or several ({server_name: urls}):
        # rooms are created on the first server and shared with the others.
        self.servers = urls if isinstance(urls, dict) else {"": list(urls)}
        self.urls = next(iter(self.servers.values()))
        self.remote_members = remote_members
        self.n_users = users
        self.n_rooms = rooms
        self.members_per_room = members_per_room
        self.n_messages = messages
        self.concurrency = concurrency
        self.rng = random.Random(seed)
        self.progress = progress
        self.name_prefix = name_prefix
        self.sync_timeout_ms = sync_timeout_ms
        self.room_shards = list(room_shards) if room_shards else None
        self.pool = new_pool()
        self.users: list[UserState] = []
        self.rooms: dict[str, list[UserState]] = {}
        self.sent: dict[str, list[str]] = {}  # room -> event ids, in send-completion order
        self.sent_at: dict[str, float] = {}
        self.visible_at: dict[str, float] = {}
        self.send_latencies: list[float] = []
        #: (monotonic start, latency in ms) of every successful send, in completion order.
        self.send_log: list[tuple[float, float]] = []
        self.send_errors = 0
        #: Attempts that failed (5xx, 429 or a connection error) and were retried with the same txn_id.
        self.send_retries = 0
        #: txn_id -> room of every send retried at least once.
        self.retried: dict[str, str] = {}
        self.send_seconds = 0.0
        self._stop_syncing = False
        self._online = 0
        self._online_waiters: list[Deferred[None]] = []

    def url(self, server: str | None = None) -> str:
        return self.rng.choice(self.servers[server] if server is not None else self.urls)

    async def close(self) -> None:
        await self.pool.closeCachedConnections()

    # -- set-up ------------------------------------------------------------------------

    async def setup(self) -> None:
        """Register the users, create the rooms, invite remote members and join everyone."""
        sem = DeferredSemaphore(self.concurrency)
        names = list(self.servers)
        for i in range(self.n_users):
            server = names[i % len(names)]
            self.users.append(UserState(Client(self.url(server), self.pool), server))
        await gatherResults([
            sem.run(_deferred, u.client.register(f"{self.name_prefix}{i}")) for i, u in enumerate(self.users)
        ])
        home = [u for u in self.users if u.server == names[0]]
        remote = [u for u in self.users if u.server != names[0]]
        per_shard: dict[str, int] = {}
        quota = -(-self.n_rooms // len(self.room_shards)) if self.room_shards else self.n_rooms
        created = 0
        while len(self.rooms) < self.n_rooms:
            if created >= 4 * self.n_rooms:
                raise RuntimeError(f"{created} rooms created but only {per_shard} fall to {self.room_shards}: "
                                   "the room IDs do not spread over the persisters")
            created += 1
            members = self.rng.sample(home, min(self.members_per_room, len(home)))
            if remote:
                members += self.rng.sample(remote, min(self.remote_members, len(remote)))
            room_id = await members[0].client.at(self.url(names[0])).create_room()
            if self.room_shards:
                shard = shard_for(room_id, self.room_shards)
                if per_shard.get(shard, 0) >= quota:
                    continue
                per_shard[shard] = per_shard.get(shard, 0) + 1
            self.rooms[room_id] = members
            self.sent[room_id] = []
            for member in members:
                member.rooms.add(room_id)
        await gatherResults([sem.run(_deferred, self._fill_room(r, ms)) for r, ms in self.rooms.items()])

    async def _fill_room(self, room_id: str, members: list[UserState]) -> None:
        """Invite and join a room's members: the creator's server's at once, then the remote ones one at a time.

        A remote member's invite is the room's latest event until it has
        reached the remote server (the member's join there proves it), so a
        federation queue in catch-up mode, which sends only each room's
        latest event, still delivers it.
        """
        creator = members[0]
        local = [m for m in members[1:] if m.server == creator.server]
        await gatherResults([_deferred(self._join(room_id, m, creator)) for m in local])
        for member in members[1:]:
            if member.server != creator.server:
                await self._join(room_id, member, creator)

    async def _join(self, room_id: str, member: UserState, creator: UserState) -> None:
        """The creator invites the member (rooms are invite-only); the member joins through its own server.

        A remote member's server learns of the room from the invite's PDU, so
        its join answers 404 until that has arrived; the member is in the room
        once the join's PDU has reached the room's server, which is awaited too
        (until then the room's server refuses the member's messages).
        """
        user_id = member.client.user_id
        assert user_id is not None
        home = creator.client.at(self.url(creator.server))
        await home.invite(room_id, user_id)
        for _ in range(300):
            try:
                await member.client.at(self.url(member.server)).join(room_id)
                break
            except ApiError as e:
                if e.code != 404:  # the invite has not crossed over yet
                    raise
            await deferLater(reactor, 0.1, lambda: None)
        else:
            raise RuntimeError(f"{user_id} could not join {room_id}: the invite never arrived")
        if member.server == creator.server:
            return
        for _ in range(300):
            if user_id in (await home.members(room_id))["members"]:
                return
            await deferLater(reactor, 0.1, lambda: None)
        raise RuntimeError(f"{user_id}'s join of {room_id} never reached the room's server")

    # -- traffic -------------------------------------------------------------------------

    async def send_messages(self, rate_per_s: float | None = None) -> None:
        """Send the messages (optionally at a fixed offered rate), recording latencies."""
        sem = DeferredSemaphore(self.concurrency)
        rooms = list(self.rooms)
        started = time.monotonic()
        done = [0]
        jobs = []
        for n in range(self.n_messages):
            room_id = self.rng.choice(rooms)
            sender = self.rng.choice(self.rooms[room_id])
            url = self.url(sender.server)
            if rate_per_s:
                delay = started + n / rate_per_s - time.monotonic()
                if delay > 0:
                    await deferLater(reactor, delay, lambda: None)
            jobs.append(sem.run(_deferred, self._send(room_id, sender, url, n, done)))
        await gatherResults(jobs)
        self.send_seconds = time.monotonic() - started

    async def _send(self, room_id: str, sender: UserState, url: str, n: int, done: list[int]) -> None:
        t0 = time.monotonic()
        txn = f"{self.name_prefix}-{n}"
        attempts = SEND_ATTEMPTS
        for attempt in range(attempts):
            try:
                result = await sender.client.at(url).send(room_id, {"body": f"message {n}", "n": n}, txn)
                break
            except ApiError as e:
                if e.code < 500 and e.code != 429:
                    self.send_errors += 1
                    return
            except Exception:
                pass
            if attempt + 1 < attempts:
                self.send_retries += 1
                self.retried[txn] = room_id
                await deferLater(reactor, SEND_BACKOFF.base_delay(attempt + 1), lambda: None)
        else:
            self.send_errors += 1
            return
        now = time.monotonic()
        self.send_latencies.append((now - t0) * 1000)
        self.send_log.append((t0, (now - t0) * 1000))
        self.sent[room_id].append(result["event_id"])
        self.sent_at[result["event_id"]] = t0
        done[0] += 1
        if self.progress is not None:
            self.progress(done[0], self.n_messages)

    # -- sync chains ----------------------------------------------------------------------

    async def sync_chains(self) -> None:
        """Run every user's sync chain until :meth:`stop_syncing` (:meth:`syncing` waits for their first answers)."""
        await gatherResults([ensureDeferred(self._chain(u)) for u in self.users])

    def stop_syncing(self) -> None:
        self._stop_syncing = True

    async def _chain(self, user: UserState) -> None:
        user.chain_running = True
        try:
            await self._chain_syncs(user)
        finally:
            user.chain_running = False

    async def _chain_syncs(self, user: UserState) -> None:
        while not self._stop_syncing:
            await self.sync_once(user, self.sync_timeout_ms)
            if user.since is not None and not user.online:
                user.online = True
                self._online += 1
                if self._online == len(self.users):
                    waiters, self._online_waiters = self._online_waiters, []
                    for d in waiters:
                        if not d.called:
                            d.callback(None)

    async def syncing(self, timeout_s: float = 60.0) -> None:
        """Wait until every user's sync chain has had its first answer: every client is online.

        A client makes its first sync when it starts, before it sends: the
        traffic starts from there rather than together with every user's
        first sync.

        Raises:
            RuntimeError: some chain had no answer within ``timeout_s``.
        """
        if self._online == len(self.users):
            return
        d: Deferred[None] = Deferred()
        self._online_waiters.append(d)
        timer = reactor.callLater(timeout_s, d.cancel)
        try:
            await d
        except CancelledError:
            raise RuntimeError(f"{len(self.users) - self._online} of {len(self.users)} users' first sync "
                               f"had no answer within {timeout_s:g} s") from None
        finally:
            if timer.active():
                timer.cancel()

    def sync_url(self, user: UserState) -> str:
        """Where ``user``'s next sync goes: the client API of the user's server."""
        return self.url(user.server)

    async def sync_once(self, user: UserState, timeout_ms: int = 0) -> int:
        try:
            result = await user.client.at(self.sync_url(user)).sync(since=user.since, timeout_ms=timeout_ms)
        except Exception as e:
            user.errors += 1
            # A 429 says how long to wait; anything else waits a little before retrying.
            await deferLater(reactor, retry_delay_s(e), lambda: None)
            return 0
        now = time.monotonic()
        user.syncs += 1
        for event in result["events"]:
            if event["type"] == "m.room.message":
                user.delivered.append((event["room_id"], event["event_id"]))
                self.visible_at.setdefault(event["event_id"], now)
        user.since = result["next_batch"]
        return len(result["events"])

    async def drain(self, quiet_rounds: int = 2, timeout_s: float = 120) -> None:
        """Sync every chain until it has every message sent to its rooms (or time runs out).

        A user whose sync chain is still running is left to it (this waits
        for its deliveries): a second sync from the same token beside the
        chain's would be delivered the same events again, which the check
        would count as duplicates the server never sent.
        """
        deadline = time.monotonic() + timeout_s
        for user in self.users:
            expected = sum(len(self.sent[r]) for r in user.rooms)
            while time.monotonic() < deadline:
                got = len(user.delivered)
                if user.chain_running:
                    if got >= expected:
                        break
                    await deferLater(reactor, 0.05, lambda: None)
                    continue
                if got >= expected:
                    # One more round to catch duplicates arriving late.
                    await self.sync_once(user, 0)
                    break
                await self.sync_once(user, 500)

    # -- verification ------------------------------------------------------------------------

    def verify(self) -> Report:
        """Lost, duplicated, misordered and foreign deliveries, from the responses alone.

        Users of one server must see each room's messages in the same order;
        across servers, the messages of each origin server must keep their order.
        """
        lost = duplicated = mismatches = foreign = 0
        fed_expected = fed_delivered = 0
        room_orders: dict[tuple[str, str], list[str]] = {}
        for user in self.users:
            by_room: dict[str, list[str]] = {}
            for room_id, event_id in user.delivered:
                by_room.setdefault(room_id, []).append(event_id)
            for room_id, got in by_room.items():
                if room_id not in user.rooms:
                    foreign += len(got)
                    continue
                duplicated += len(got) - len(set(got))
                for key, seq in self._order_keys(user.server, got):
                    first = room_orders.setdefault((room_id, key), seq)
                    if first is not seq and [e for e in seq if e in set(first)] != [e for e in first if e in set(seq)]:
                        mismatches += 1
            for room_id in user.rooms:
                got_set = set(by_room.get(room_id, []))
                missing = set(self.sent[room_id]) - got_set
                lost += len(missing)
                remote = ([e for e in self.sent[room_id] if _origin(e) != user.server]
                          if len(self.servers) > 1 else [])
                fed_expected += len(remote)
                fed_delivered += sum(1 for e in remote if e in got_set)
        visible = [
            (self.visible_at[e] - self.sent_at[e]) * 1000 for e in self.sent_at if e in self.visible_at
        ]
        sent = sum(len(v) for v in self.sent.values())
        return Report(
            users=len(self.users), rooms=len(self.rooms), sent=sent, send_errors=self.send_errors,
            lost=lost, duplicated=duplicated, order_mismatches=mismatches, foreign=foreign,
            sync_requests=sum(u.syncs for u in self.users), federated_expected=fed_expected,
            federated_delivered=fed_delivered, send_seconds=self.send_seconds,
            events_per_s=sent / self.send_seconds if self.send_seconds else 0.0,
            send_latency_ms=percentiles(self.send_latencies), visible_latency_ms=percentiles(visible),
            latencies_ms=visible,
        )

    def _order_keys(self, server: str, events: list[str]) -> list[tuple[str, list[str]]]:
        if len(self.servers) == 1:
            return [("", events)]
        keys = [(f"server:{server}", events)]
        for origin in self.servers:
            keys.append((f"origin:{origin}", [e for e in events if _origin(e) == origin]))
        return keys


def _origin(event_id: str) -> str:
    return event_id.partition(":")[2]
