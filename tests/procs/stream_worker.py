#!/usr/bin/env python3
"""A synflow process that writes or reads the events stream, for integration tests.

It runs the real process bootstrap (:class:`synflow.app.base.ProcessService`:
database, schema wait, replication over the configured transport) and then:

* ``--role writer``: writes ``--count`` synthetic events in transactions of
  1-3 events, ``--concurrency`` at a time, rolling back a ``--rollback``
  fraction of them after the rows are inserted, with random delays so that
  transactions complete out of order (on PostgreSQL). Each committed fact is
  appended to ``--out`` as it completes; a final ``done`` line carries the
  writer's position. Its position is also appended (``wpos``) whenever it
  changes, checked every 0.1 s, including idle leaps after ``done``, and
  once more at shutdown. With ``--hold-at N`` the N-th transaction, once its
  rows are inserted, appends its stream IDs to ``<out>.hold`` and stays open
  (for a test to SIGKILL the process mid-transaction).
* ``--role reader``: appends every applied batch of rows (``rows``) and every
  position advance (``pos``) of the events stream to ``--out``, in the order
  they happen, and its replication handler's counters (``stats``, e.g.
  ``catch_ups``) at shutdown.

It runs until SIGTERM (or, for a writer, ``--exit-when-done``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from twisted.internet import reactor
from twisted.internet.defer import DeferredSemaphore, gatherResults, inlineCallbacks
from twisted.internet.task import LoopingCall

from synflow.app.base import ProcessService
from synflow.app.build import setup_logging
from synflow.config import load_config
from synflow.streams import EventsRow


class Rollback(Exception):
    """Raised inside a write to roll it back on purpose."""


class Out:
    def __init__(self, path: str) -> None:
        self.f = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self.f.write(json.dumps(record) + "\n")
        self.f.flush()


def insert_events_txn(ctx, instance, events, rng, rollback, delay_ms, hold_path=None):
    ids = ctx.allocate("events", len(events))
    for stream_id, (event_id, room_id) in zip(ids, events, strict=True):
        ctx.txn.execute(
            "INSERT INTO events (stream_ordering, instance_name, event_id, room_id, type, state_key, sender, "
            "membership, content, origin_server_ts, origin, prev_event_id, depth, received_ts) "
            "VALUES (?, ?, ?, ?, 'm.test', NULL, '@load:test', NULL, '{}', 0, 'test', NULL, 0, 0)",
            (stream_id, instance, event_id, room_id),
        )
        ctx.add_rows("events", stream_id, [EventsRow(event_id, room_id, "m.test", None, "@load:test", None)],
                     room_id=room_id, event_id=event_id)
    if hold_path is not None:
        with open(hold_path + ".tmp", "w", encoding="utf-8") as f:
            json.dump({"sids": ids, "event_ids": [e for e, _ in events]}, f)
        os.replace(hold_path + ".tmp", hold_path)  # the test sees the whole file or none
        time.sleep(3600)
    if delay_ms:
        time.sleep(rng.uniform(0, delay_ms) / 1000)
    if rollback:
        raise Rollback()
    return list(zip(ids, (e for e, _ in events), strict=True))


def log_writer_position(proc: ProcessService, out: Out) -> None:
    """Append the writer's position whenever it changes, and once more at shutdown."""
    gen = proc.replication.handler.generators["events"]
    last = [None]

    def check(force: bool = False) -> None:
        if force or gen.position != last[0]:
            last[0] = gen.position
            out.write({"t": "wpos", "position": gen.position})

    LoopingCall(check).start(0.1)
    reactor.addSystemEventTrigger("before", "shutdown", check, True)


@inlineCallbacks
def run_writer(proc: ProcessService, args, out: Out):
    rng = random.Random(args.seed)
    me = proc.config.instance_name
    sem = DeferredSemaphore(args.concurrency)
    writers = proc.replication.writers
    log_writer_position(proc, out)

    def one(n):
        size = rng.randint(1, 3)
        events = [(f"${me}-{args.seed}-{n}-{i}:test", f"!{me}-{n % 7}:test") for i in range(size)]
        rollback = rng.random() < args.rollback
        txn_rng = random.Random(rng.random())

        def committed(result):
            for stream_id, event_id in result:
                out.write({"t": "fact", "sid": stream_id, "event_id": event_id})

        def failed(f):
            f.trap(Rollback)
            out.write({"t": "rollback", "events": [e for e, _ in events]})

        hold = args.out + ".hold" if n == args.hold_at else None
        d = writers.run_write(
            "test_insert", ["events"], insert_events_txn, me, events, txn_rng, rollback and hold is None,
            args.delay_ms, hold,
        )
        return d.addCallbacks(committed, failed)

    pending = []
    n = 0
    while n < args.count:
        pending.append(sem.run(one, n))
        n += 1
        if len(pending) >= 200:
            yield gatherResults(pending)
            pending = []
    yield gatherResults(pending)
    gen = proc.replication.handler.generators["events"]
    out.write({"t": "done", "position": gen.position})
    if args.exit_when_done:
        reactor.stop()


def run_reader(proc: ProcessService, out: Out) -> None:
    handler = proc.replication.handler
    handler.add_row_handler(
        "events", lambda inst, tok, rows: out.write({"t": "rows", "w": inst, "tok": tok, "ids": [r.event_id for r in rows]})
    )
    handler.add_position_listener("events", lambda inst, tok: out.write({"t": "pos", "w": inst, "p": tok}))
    out.write({"t": "ready", "positions": handler.positions("events")})
    reactor.addSystemEventTrigger("before", "shutdown", lambda: out.write({"t": "stats", **vars(handler.stats)}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", action="append", required=True)
    parser.add_argument("--role", choices=("writer", "reader"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rollback", type=float, default=0.1)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--delay-ms", type=float, default=2.0)
    parser.add_argument("--start-delay", type=float, default=0.0)
    parser.add_argument("--exit-when-done", action="store_true")
    parser.add_argument("--hold-at", type=int, default=None)
    args = parser.parse_args()
    config = load_config(args.config)
    setup_logging(config)
    out = Out(args.out)
    proc = ProcessService(config, reactor)
    proc.startService()

    def started(_):
        if args.role == "reader":
            run_reader(proc, out)
        else:
            reactor.callLater(args.start_delay, run_writer, proc, args, out)

    proc.ready.addCallback(started)
    reactor.addSystemEventTrigger("before", "shutdown", proc.stopService)
    reactor.run()


if __name__ == "__main__":
    main()
