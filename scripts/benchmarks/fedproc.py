"""Child processes of the federation benchmark.

``python -m scripts.benchmarks.fedproc ROLE ...`` where ROLE is:

* ``receivers`` -- ``--count`` loopback HTTP servers, each synflow's inbound
  ``/send`` endpoint (:class:`~synflow.federation.inbound.SendResource` over an
  :class:`~synflow.federation.inbound.InboundTransactionHandler`: parsing,
  validation of every PDU, dedupe on (origin, txn_id)) with an in-memory
  dedupe store and a PDU "persister" that only counts;
* ``sender`` -- one federation sender instance: the real
  :class:`~synflow.federation.sender.FederationSender` (per-destination queues,
  transactions of 50 PDUs, one in flight per destination, sharding over
  ``--instances``) sending through the real
  :class:`~synflow.federation.transport.TreqFederationTransport`, fed every
  event as the events follower would feed it, with an in-memory destination
  store (the SQL store's reads are not on the hot path once a queue has left
  catch-up mode; its position writes are);
* ``rawput`` -- the ceiling: a bare ``treq.put`` loop sending transactions of
  the same 50 PDUs to the destinations this instance owns, one in flight per
  destination.

Senders say ``ready``, start on SIGUSR1 (sent to all of them at once) and
report, with ``time.monotonic()`` stamps (one clock for the whole machine),
when every queue they own is empty.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import signal
import sys
import time
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred, succeed
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.task import LoopingCall

from scripts.benchmarks.common import emit
from synflow.config import FederationConfig
from synflow.federation.auth import FEDERATION_SEND_PREFIX
from synflow.federation.inbound import InboundTransactionHandler
from synflow.federation.interfaces import DestinationRecord, Pdu
from synflow.federation.policy import MAX_PDUS_PER_TRANSACTION, RetryState
from synflow.federation.sender import FederationSender
from synflow.federation.transport import TreqFederationTransport, build_treq_client
from synflow.http.site import HealthResource, build_site
from synflow.sharding import shard_for
from synflow.tokens import StreamToken

ORIGIN = "origin.bench"
WRITER_ID = 1


def pdu_json(i: int) -> dict[str, Any]:
    return {"event_id": f"$ev{i}AbCdEfGh:{ORIGIN}", "room_id": f"!room{i % 50}:{ORIGIN}", "type": "m.room.message",
            "sender": f"@user{i % 20}:{ORIGIN}", "content": {"body": f"message number {i}", "msgtype": "m.text"},
            "origin_server_ts": 1_700_000_000_000 + i, "depth": i, "prev_events": [f"$ev{i - 1}AbCdEfGh:{ORIGIN}"]}


# -- receivers ---------------------------------------------------------------------------------


class MemoryDedupe:
    def __init__(self) -> None:
        self.responses: dict[tuple[str, str], tuple[int, dict[str, Any]]] = {}

    def get_response(self, origin: str, txn_id: str) -> Deferred[Any]:
        return succeed(self.responses.get((origin, txn_id)))

    def store_response(self, origin: str, txn_id: str, code: int, body: dict[str, Any]) -> Deferred[None]:
        self.responses[(origin, txn_id)] = (code, body)
        return succeed(None)


def run_receivers(args: argparse.Namespace) -> None:
    counts = [0] * args.count
    ports: list[int] = []

    def make(i: int) -> Any:
        def persist(origin: str, pdu: dict[str, Any]) -> None:
            counts[i] += 1

        handler = InboundTransactionHandler(MemoryDedupe(), persist, lambda origin: None, allowed_origins=None)
        # The site a synflow process serves (synflow.http.site), /send mounted as on the master.
        return build_site({FEDERATION_SEND_PREFIX: handler.resource()}, health=HealthResource(list, dict),
                          max_body_bytes=handler.max_body_bytes)

    def listening(port: Any) -> None:
        ports.append(port.getHost().port)
        if len(ports) == args.count:
            emit("ready", ports=ports)

    for i in range(args.count):
        TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(make(i)).addCallback(listening)
    LoopingCall(lambda: emit("counts", counts=counts, t=time.monotonic())).start(0.5, now=False)


# -- senders -----------------------------------------------------------------------------------


class MemoryDestinationStore:
    """The destinations store in memory (nothing to catch up: every PDU goes through the queues)."""

    def __init__(self) -> None:
        self.records: dict[str, DestinationRecord] = {}
        self.position_writes = 0

    def get_destination(self, destination: str) -> Deferred[Any]:
        return succeed(self.records.get(destination))

    def set_retry(self, destination: str, retry: RetryState) -> Deferred[None]:
        old = self.records.get(destination, DestinationRecord(destination))
        self.records[destination] = DestinationRecord(destination, retry, old.last_successful)
        return succeed(None)

    def set_last_successful(self, destination: str, token: StreamToken) -> Deferred[None]:
        old = self.records.get(destination, DestinationRecord(destination))
        self.records[destination] = DestinationRecord(destination, old.retry, token)
        self.position_writes += 1
        return succeed(None)

    def get_catch_up_pdus(self, destination: str, after: StreamToken, upto: StreamToken, limit: int) -> Deferred[Any]:
        return succeed([])

    def count_catch_up_events(self, destination: str, after: StreamToken, upto: StreamToken, limit: int) -> Deferred[int]:
        return succeed(0)

    def get_catch_up_events(self, destination: str, after: StreamToken, upto: StreamToken, limit: int) -> Deferred[Any]:
        return succeed([])

    def outstanding_destinations(self, upto: StreamToken) -> Deferred[Any]:
        return succeed([])


def on_go(fn: Any) -> None:
    """Run ``fn`` on the reactor when SIGUSR1 arrives."""
    r: Any = reactor
    signal.signal(signal.SIGUSR1, lambda signum, frame: r.callFromThread(fn))


def destinations_of(spec: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in spec.split(","))


def finish_when(done: Any, started: float, pdus: int, extra: dict[str, Any]) -> None:
    def check() -> None:
        if done():
            loop.stop()
            end = time.monotonic()
            emit("result", pdus=pdus, start=started, end=end, seconds=round(end - started, 4),
                 cpu_s=round(time.process_time(), 3), **extra)

    loop = LoopingCall(check)
    loop.start(0.005)


def run_sender(args: argparse.Namespace) -> None:
    dests = destinations_of(args.destinations)
    instances = args.instances.split(",")
    store = MemoryDestinationStore()
    fed = {"max": 0}
    config = FederationConfig(destinations=dests, request_timeout_s=60.0)
    transport = TreqFederationTransport.from_config(reactor, config)
    sender = FederationSender(
        server_name=ORIGIN, instance_name=args.name, instances=instances, store=store, transport=transport,
        clock=reactor, rng=random.Random(1), config=config,
        events_position=lambda: StreamToken.from_positions({WRITER_ID: fed["max"]}),
    )
    owned = [d for d in dests if sender.owns(d)]
    sender.start()
    for d in owned:
        sender.wake_destination(d)  # leaves start-up catch-up mode (nothing is outstanding)

    def settled() -> None:
        if any(sender.queue(d).catching_up for d in owned):
            reactor.callLater(0.05, settled)
            return
        on_go(lambda: feed(1))
        emit("ready", owned=owned)

    def feed(first: int) -> None:
        if first == 1:
            state["started"] = time.monotonic()
            finish_when(lambda: fed["max"] == args.events and all(
                q.pending_pdus == 0 and not q.in_flight for q in sender.queues.values()),
                state["started"], args.events * len(owned), {"owned": owned})
        last = min(args.events, first + args.chunk - 1)
        for i in range(first, last + 1):
            pdu = Pdu(f"$ev{i}AbCdEfGh:{ORIGIN}", f"!room{i % 50}:{ORIGIN}", WRITER_ID, i, pdu_json(i))
            fed["max"] = i
            sender.notify_new_pdu(pdu, dests)
        if last < args.events:
            reactor.callLater(0, feed, last + 1)

    def debug() -> None:
        emit("queues", fed=fed["max"], queues={d: [q.pending_pdus, q.in_flight, q.catching_up, q.backing_off]
                                                for d, q in sender.queues.items()})

    LoopingCall(debug).start(1.0, now=False)
    state: dict[str, float] = {}
    reactor.callLater(0.2, settled)


def run_rawput(args: argparse.Namespace) -> None:
    dests = destinations_of(args.destinations)
    instances = args.instances.split(",")
    owned = [d for d in dests if shard_for(d, instances) == args.name]
    client = build_treq_client(reactor)
    txns = args.events // MAX_PDUS_PER_TRANSACTION
    left = {d: txns for d in owned}
    counter = {"n": 0}

    def body(n: int) -> bytes:
        first = (n % txns) * MAX_PDUS_PER_TRANSACTION + 1
        pdus = [pdu_json(i) for i in range(first, first + MAX_PDUS_PER_TRANSACTION)]
        return json.dumps({"origin": ORIGIN, "origin_server_ts": 1_700_000_000_000, "pdus": pdus},
                          separators=(",", ":")).encode()

    bodies = [body(n) for n in range(min(txns, 20))]

    async def loop(dest: str) -> None:
        while left[dest]:
            counter["n"] += 1
            url = f"{dests[dest]}/_matrix/federation/v1/send/raw{args.name}-{counter['n']}"
            response = await client.put(url, data=bodies[counter["n"] % len(bodies)],
                                        headers={b"Content-Type": [b"application/json"]})
            await response.content()
            if response.code != 200:
                raise RuntimeError(f"{dest} answered {response.code}")
            left[dest] -= 1

    def start() -> None:
        started = time.monotonic()
        for d in owned:
            Deferred.fromCoroutine(loop(d)).addErrback(lambda f: emit("error", traceback=f.getTraceback()))
        finish_when(lambda: not any(left.values()), started, txns * MAX_PDUS_PER_TRANSACTION * len(owned),
                    {"owned": owned})

    on_go(start)
    emit("ready", owned=owned)


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="role", required=True)
    r = sub.add_parser("receivers")
    r.add_argument("--count", type=int, default=10)
    for role in ("sender", "rawput"):
        s = sub.add_parser(role)
        s.add_argument("--name", required=True)
        s.add_argument("--instances", required=True)
        s.add_argument("--destinations", required=True)
        s.add_argument("--events", type=int, default=10_000)
        s.add_argument("--chunk", type=int, default=500)
    args = p.parse_args()
    {"receivers": run_receivers, "sender": run_sender, "rawput": run_rawput}[args.role](args)
    reactor.run()


if __name__ == "__main__":
    main()
