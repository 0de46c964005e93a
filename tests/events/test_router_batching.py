"""EventRouter's persist_events calls: sends of one reactor turn share a call, and calls in flight are capped."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.task import Clock
from twisted.trial.unittest import TestCase

from synflow.errors import HttpApiError
from synflow.events.persist import EventSpec
from synflow.events.router import (
    MAX_RPC_BATCH,
    MAX_RPC_IN_FLIGHT,
    MIN_EXTRA_CALL_BATCH,
    EventRouter,
)
from synflow.sharding import shard_for

SERVER = "router.test"
WRITERS = ["persister1", "persister2"]


class ControlledRpc:
    """An RpcClient stand-in: every call is recorded and answered when the test says so."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[dict[str, Any]], Deferred[Any]]] = []

    def call(self, instance: str, method: str, args: Any) -> Deferred[Any]:
        assert method == "persist_events", method
        d: Deferred[Any] = Deferred()
        self.calls.append((instance, args["events"], d))
        return d

    def answer(self, index: int) -> None:
        """Answer call ``index`` with one stored result per event."""
        instance, events, d = self.calls[index]
        d.callback([{"event_id": f"$e{n}", "stream_ordering": n, "instance_name": instance, "error": None}
                    for n, _ in enumerate(events)])

    def sizes(self) -> list[int]:
        return [len(events) for _, events, _ in self.calls]


def room_of(owner: str) -> str:
    return next(f"!r{i}:{SERVER}" for i in range(1000) if shard_for(f"!r{i}:{SERVER}", WRITERS) == owner)


def spec(room_id: str, n: int) -> EventSpec:
    return EventSpec(room_id, "m.room.message", f"@u:{SERVER}", {"body": str(n)}, None, SERVER, 1)


class RouterBatchingTest(TestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.rpc = ControlledRpc()
        self.room = room_of("persister2")

    def router(self, **kwargs: Any) -> EventRouter:
        return EventRouter("master", WRITERS, None, self.rpc, self.clock, **kwargs)  # type: ignore[arg-type]

    def send(self, router: EventRouter, n: int) -> Deferred[Any]:
        return ensureDeferred(router.persist([spec(self.room, n)]))

    def test_sends_of_one_turn_share_one_call(self) -> None:
        """Sends made in the same reactor turn go to their persister in one persist_events call."""
        router = self.router()
        sent = [self.send(router, n) for n in range(5)]
        self.assertEqual(self.rpc.calls, [])  # nothing goes before the turn ends
        self.clock.advance(0)
        self.assertEqual(self.rpc.sizes(), [5])
        self.assertEqual(self.rpc.calls[0][0], "persister2")
        self.rpc.answer(0)
        results = [self.successResultOf(d)[0] for d in sent]
        self.assertEqual([r.stream_ordering for r in results], [0, 1, 2, 3, 4])

    def test_sends_wait_while_the_cap_is_in_flight_then_go_together(self) -> None:
        """At the cap, later sends are held and go in one call as soon as a call in flight returns."""
        router = self.router(max_rpc_in_flight=2, min_extra_call_batch=1)
        first = self.send(router, 0)
        self.clock.advance(0)
        second = self.send(router, 1)
        self.clock.advance(0)
        self.assertEqual(self.rpc.sizes(), [1, 1])  # two calls in flight: the cap
        held = [self.send(router, n) for n in range(2, 9)]
        self.clock.advance(0)
        self.clock.advance(1)
        self.assertEqual(self.rpc.sizes(), [1, 1])  # held, however long the calls take
        self.assertNoResult(held[0])
        self.rpc.answer(0)
        self.assertEqual(self.successResultOf(first)[0].instance_name, "persister2")
        self.assertEqual(self.rpc.sizes(), [1, 1, 7])  # every held send in the next call
        self.assertEqual([e["content"]["body"] for e in self.rpc.calls[2][1]], [str(n) for n in range(2, 9)])
        self.rpc.answer(1)
        self.rpc.answer(2)
        self.successResultOf(second)
        self.assertEqual([self.successResultOf(d)[0].stream_ordering for d in held], list(range(7)))
        # Idle again: a send goes at the end of its turn, not held.
        later = self.send(router, 9)
        self.clock.advance(0)
        self.assertEqual(self.rpc.sizes(), [1, 1, 7, 1])
        self.rpc.answer(3)
        self.successResultOf(later)

    def test_a_failed_call_fails_its_own_sends_and_frees_its_slot(self) -> None:
        """A call that fails errs its own sends only; the sends held behind it still go."""
        router = self.router(max_rpc_in_flight=1)
        first = self.send(router, 0)
        self.clock.advance(0)
        held = self.send(router, 1)
        self.clock.advance(0)
        self.assertEqual(self.rpc.sizes(), [1])
        self.rpc.calls[0][2].errback(HttpApiError(502, "M_UNKNOWN", "persister2 went away"))
        self.assertEqual(self.failureResultOf(first, HttpApiError).value.code, 502)
        self.assertEqual(self.rpc.sizes(), [1, 1])
        self.assertNoResult(held)
        self.rpc.answer(1)
        self.assertEqual(self.successResultOf(held)[0].event_id, "$e0")

    def test_calls_are_chunked_at_the_batch_limit(self) -> None:
        """More sends than MAX_RPC_BATCH in one turn go in several calls, within the in-flight cap."""
        router = self.router(max_rpc_in_flight=2)
        sent = [self.send(router, n) for n in range(MAX_RPC_BATCH * 2 + 3)]
        self.clock.advance(0)
        self.assertEqual(self.rpc.sizes(), [MAX_RPC_BATCH, MAX_RPC_BATCH])
        self.rpc.answer(0)
        self.assertEqual(self.rpc.sizes(), [MAX_RPC_BATCH, MAX_RPC_BATCH])  # 3: not worth a call beside one
        self.rpc.answer(1)
        self.assertEqual(self.rpc.sizes(), [MAX_RPC_BATCH, MAX_RPC_BATCH, 3])
        self.rpc.answer(2)
        for d in sent:
            self.successResultOf(d)

    def test_default_cap(self) -> None:
        """The default cap holds: MAX_RPC_IN_FLIGHT calls at once, each beside the first for a batch of
        MIN_EXTRA_CALL_BATCH sends or more, the rest held."""
        router = self.router()
        self.send(router, 0)
        self.clock.advance(0)
        for n in range(MAX_RPC_IN_FLIGHT * MIN_EXTRA_CALL_BATCH):
            self.send(router, n)
            self.clock.advance(0)
        self.assertEqual(self.rpc.sizes(), [1] + [MIN_EXTRA_CALL_BATCH] * (MAX_RPC_IN_FLIGHT - 1))

    def test_a_second_call_waits_for_a_batch_worth_it(self) -> None:
        """Beside a call in flight, fewer sends than the minimum wait for it to return and then go together;
        the minimum reached, they go in a call of their own at once."""
        router = self.router(max_rpc_in_flight=2, min_extra_call_batch=3)
        first = self.send(router, 0)
        self.clock.advance(0)
        waiting = [self.send(router, n) for n in (1, 2)]
        self.clock.advance(0)
        self.assertEqual(self.rpc.sizes(), [1])  # two are not worth a second call
        self.rpc.answer(0)
        self.successResultOf(first)
        self.assertEqual(self.rpc.sizes(), [1, 2])  # the call returned: they go at once, together
        more = [self.send(router, n) for n in (3, 4, 5)]
        self.clock.advance(0)
        self.assertEqual(self.rpc.sizes(), [1, 2, 3])  # three are: a second call beside the one in flight
        self.rpc.answer(1)
        self.rpc.answer(2)
        for d in waiting + more:
            self.successResultOf(d)

    def test_minimum_below_one_refused(self) -> None:
        with self.assertRaises(ValueError):
            self.router(min_extra_call_batch=0)

    def test_cap_below_one_refused(self) -> None:
        with self.assertRaises(ValueError):
            self.router(max_rpc_in_flight=0)
