"""The persist transaction in one process: its CPU, fixed and per event, split by thread and PostgreSQL.

Over real processes on a shared two-core VM the persist figures move by a
fifth from run to run, and every event also pays for HTTP, routing and
replication. This measures the transaction alone: a real
:class:`~synflow.events.persist.EventPersister` (the real stream ID
generators, the real adbapi pool) on a fresh PostgreSQL database, no HTTP, no
replication connection, persisting batches of message events (each with a
client transaction ID, as a client's send has) into distinct rooms, one batch
at a time. For each batch size, the CPU per transaction of:

* the reactor thread (batching, the ID generators, the results),
* the other threads of the process (the database pool's: the statements
  through psycopg2),
* the database's PostgreSQL backends,

read from ``/proc`` around each pass; the best of several passes (the
least disturbed by other load) is kept. From two sizes, ``small`` and
``large`` events a batch, the fixed cost of a transaction and the cost of
each further event follow.

Run as ``python -m scripts.benchmarks.persistproc --dbname NAME`` (the
database created and dropped by the caller); prints one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import threading
import time
from typing import Any

from scripts.benchmarks.common import (
    PG_HOST,
    PG_PORT,
    PG_USER,
    cpu_seconds,
    pg_backend_pids,
    stat_cpu_seconds,
)

SIZES = (1, 8)
PARTS = ("reactor", "database_threads", "postgres")


def _thread_cpu() -> dict[int, float]:
    """CPU seconds of each thread of this process (0 for one that ended meanwhile)."""
    return {int(tid): stat_cpu_seconds(f"/proc/self/task/{tid}/stat") for tid in os.listdir("/proc/self/task")}


def _snapshot(backends: list[int]) -> dict[str, float]:
    threads = _thread_cpu()
    me = threading.get_native_id()
    return {"reactor": threads.get(me, 0.0), "database_threads": sum(v for t, v in threads.items() if t != me),
            "postgres": sum(cpu_seconds(pid) for pid in backends)}


async def _measure(reactor: Any, dbname: str, batches: int, passes: int) -> dict[str, Any]:
    from synflow import registry
    from synflow.config import DatabaseConfig
    from synflow.events.persist import EventPersister, EventSpec
    from synflow.storage.engines import Database
    from synflow.storage.id_generators import MultiWriterIdGenerator, StreamWriters
    from synflow.storage.instances import InstanceMap
    from synflow.storage.prepare import prepare_database

    hs, writer, sender = "bench.local", "persister1", "@alice:bench.local"
    db = Database(reactor, DatabaseConfig(engine="postgres", host=PG_HOST, port=PG_PORT, user=PG_USER, dbname=dbname))
    try:
        await prepare_database(db, apply=True)
        await InstanceMap(db).ids_for([writer])
        gens = {s: MultiWriterIdGenerator(registry.streams()[s], writer, 0, reactor) for s in ("events", "caches")}
        ids = itertools.count()
        persister = EventPersister(StreamWriters(db, gens), server_name=hs, instance_name=writer,
                                   event_writers=[writer], clock=reactor, new_event_id=lambda: f"$e{next(ids)}:{hs}")
        rooms = [f"!room{i}:{hs}" for i in range(max(SIZES) * 8)]
        await persister.persist([spec for room in rooms for spec in (
            EventSpec(room, "m.room.create", sender, {}, "", hs, 1),
            EventSpec(room, "m.room.member", sender, {"membership": "join"}, sender, hs, 1))])
        sent = itertools.count()

        async def run(size: int, count: int) -> None:
            for _ in range(count):
                batch = []
                for _ in range(size):
                    n = next(sent)
                    batch.append(EventSpec(rooms[n % len(rooms)], "m.room.message", sender,
                                           {"msgtype": "m.text", "body": f"message {n}"}, None, hs,
                                           1_700_000_000_000 + n, txn_id=f"t{n}"))
                results = await persister.persist(batch)
                if any(r.error is not None for r in results):
                    raise RuntimeError(f"a benchmark event was refused: {results}")

        backends = pg_backend_pids(dbname)
        best: dict[int, dict[str, float]] = {}
        for size in SIZES:
            await run(size, 50)  # warm-up: the pool's connections, the caches
        for _ in range(passes):
            for size in SIZES:  # alternating, so both sizes see the same machine
                before, t = _snapshot(backends), time.monotonic()
                await run(size, batches)
                after, wall = _snapshot(backends), time.monotonic() - t
                per_txn = {k: (after[k] - before[k]) * 1000 / batches for k in PARTS}
                per_txn["wall"] = wall * 1000 / batches
                total = sum(per_txn[k] for k in PARTS)
                if size not in best or total < sum(best[size][k] for k in PARTS):
                    best[size] = per_txn
    finally:
        await db.close()
    small, large = SIZES
    split = {k: {"per_transaction_ms": (large * best[small][k] - small * best[large][k]) / (large - small),
                 "per_event_ms": (best[large][k] - best[small][k]) / (large - small)} for k in PARTS}
    return {"sizes": {str(s): {k: round(v, 4) for k, v in best[s].items()} for s in SIZES},
            "fixed_ms_per_transaction": round(sum(split[k]["per_transaction_ms"] for k in PARTS), 4),
            "ms_per_further_event": round(sum(split[k]["per_event_ms"] for k in PARTS), 4),
            "split": {k: {kk: round(vv, 4) for kk, vv in v.items()} for k, v in split.items()},
            "batches": batches, "passes": passes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dbname", required=True)
    parser.add_argument("--batches", type=int, default=400, help="transactions per pass and size")
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args(argv)
    from twisted.internet import reactor
    from twisted.internet.defer import ensureDeferred

    out: dict[str, Any] = {}

    def done(result: Any) -> None:
        out["result"] = result
        reactor.stop()  # type: ignore[attr-defined]

    def failed(failure: Any) -> None:
        out["error"] = failure.getTraceback()
        reactor.stop()  # type: ignore[attr-defined]

    reactor.callWhenRunning(  # type: ignore[attr-defined]
        lambda: ensureDeferred(_measure(reactor, args.dbname, args.batches, args.passes)).addCallbacks(done, failed))
    reactor.run()  # type: ignore[attr-defined]
    if "error" in out:
        sys.stderr.write(out["error"])
        return 1
    print(json.dumps(out["result"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
