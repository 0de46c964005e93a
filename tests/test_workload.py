"""The load generator: what its sends retry, how long, with which transaction ID; and its draining syncs."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, ensureDeferred, succeed
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.task import Clock, deferLater
from twisted.trial.unittest import TestCase

from synflow.tools import workload as workload_module
from synflow.tools.client import ApiError
from synflow.tools.workload import SEND_ATTEMPTS, UserState, Workload

#: The pauses between a send's tries: 0.2 s doubling to a cap of 2 s, about 9 s in all.
PAUSES = [0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0]


class _FlakyClient:
    """A client whose sends fail with ``failures`` in turn, then succeed; it records each send's txn ID."""

    def __init__(self, failures: list[Exception]) -> None:
        self.failures = list(failures)
        self.txns: list[str] = []

    def at(self, url: str) -> _FlakyClient:
        return self

    async def send(self, room_id: str, content: dict[str, Any], txn: str) -> dict[str, Any]:
        self.txns.append(txn)
        if self.failures:
            raise self.failures.pop(0)
        return {"event_id": "$sent"}


class SendRetryTest(TestCase):
    def setUp(self) -> None:
        self.workload = Workload(["http://127.0.0.1:1"], users=1, rooms=1, messages=1)
        self.addCleanup(self.workload.pool.closeCachedConnections)
        self.pauses: list[float] = []
        self.patch(workload_module, "deferLater", lambda _r, s, f: self.pauses.append(s) or succeed(f()))

    def send(self, failures: list[Exception]) -> _FlakyClient:
        client = _FlakyClient(failures)
        sender = UserState(client)  # type: ignore[arg-type]
        self.workload.sent["!r"] = []
        self.successResultOf(ensureDeferred(self.workload._send("!r", sender, "http://x", 7, [0])))
        return client

    def test_a_restart_long_outage_is_ridden_out(self) -> None:
        """Transport errors and 5xx on every attempt but the last are retried, same txn, after each pause in turn."""
        errors: list[Exception] = [ConnectionRefusedError()] * 4 + [ApiError(503, {})] * 3
        client = self.send(errors)
        self.assertEqual(self.workload.sent["!r"], ["$sent"])
        self.assertEqual((self.workload.send_errors, self.workload.send_retries), (0, 7))
        self.assertEqual(self.pauses, PAUSES)
        self.assertGreater(sum(self.pauses), 5.0)  # longer than a process's restart
        self.assertEqual(set(client.txns), {"u-7"})

    def test_gives_up_after_the_last_attempt_without_a_pause(self) -> None:
        self.send([ConnectionRefusedError()] * SEND_ATTEMPTS)
        self.assertEqual((self.workload.sent["!r"], self.workload.send_errors), ([], 1))
        self.assertEqual(self.pauses, PAUSES)

    def test_a_refusal_is_not_retried(self) -> None:
        client = self.send([ApiError(403, {"errcode": "M_FORBIDDEN"})])
        self.assertEqual((self.workload.send_errors, self.pauses, len(client.txns)), (1, [], 1))

    def test_rate_limited_sends_are_retried(self) -> None:
        self.send([ApiError(429, {"errcode": "M_LIMIT_EXCEEDED"})])
        self.assertEqual((self.workload.sent["!r"], self.pauses), (["$sent"], [0.2]))


class _HeldSyncs:
    """A client whose syncs are answered when the test says; it records how many were in flight at once."""

    def __init__(self) -> None:
        self.pending: list[tuple[str | None, Deferred[dict[str, Any]]]] = []
        self.most_at_once = 0

    def at(self, url: str) -> _HeldSyncs:
        return self

    def sync(self, since: str | None, timeout_ms: int) -> Deferred[dict[str, Any]]:
        d: Deferred[dict[str, Any]] = Deferred()
        self.pending.append((since, d))
        self.most_at_once = max(self.most_at_once, len(self.pending))
        return d

    def answer(self) -> None:
        """Answer every pending sync as a server would: the event after the beginning, nothing after ``t1``."""
        pending, self.pending = self.pending, []
        for since, d in pending:
            events = [{"type": "m.room.message", "room_id": "!r", "event_id": "$e1"}] if since is None else []
            d.callback({"events": events, "next_batch": "t1"})


class DrainBesideChainsTest(TestCase):
    """Draining while the sync chains still run makes no sync of its own beside a chain's."""

    def test_no_second_sync_from_the_same_token(self) -> None:
        clock = Clock()
        self.patch(workload_module, "deferLater", lambda _r, s, f: deferLater(clock, s, f))
        workload = Workload(["http://127.0.0.1:1"], users=1, rooms=1, messages=1)
        self.addCleanup(workload.pool.closeCachedConnections)
        client = _HeldSyncs()
        user = UserState(client, rooms={"!r"})  # type: ignore[arg-type]
        workload.users = [user]
        workload.sent = {"!r": ["$e1"]}
        chain = ensureDeferred(workload._chain(user))
        drained = ensureDeferred(workload.drain(timeout_s=60))
        clock.advance(0.05)
        self.assertEqual(len(client.pending), 1)  # the chain's; the drain waits for it
        client.answer()
        clock.advance(0.05)
        self.successResultOf(drained)
        workload.stop_syncing()
        client.answer()
        self.successResultOf(chain)
        self.assertEqual(client.most_at_once, 1)
        report = workload.verify()
        self.assertEqual((report.lost, report.duplicated), (0, 0))
        self.assertFalse(user.chain_running)
