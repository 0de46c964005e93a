"""Two writer processes and a reader process on one events stream, for real.

Each run starts a master with twistd, two writers and a reader (the stream
harness in tests/procs/stream_worker.py, running synflow's real process
bootstrap), writes thousands of facts with random rollbacks and out-of-order
completion, and checks the reader's log against the database: every
committed fact exactly once, in per-writer order, and no position advance
past a fact the reader had not yet applied.
"""

from __future__ import annotations

import json
import os

from twisted.internet.defer import inlineCallbacks
from twisted.trial.unittest import TestCase

from tests.cluster import Cluster, DroppingProxy, read_jsonl, sleep, wait_until

WORKER = "tests/procs/stream_worker.py"
WRITERS = ("persister1", "persister2")
READERS = ("reader1", "reader2")
#: Transactions each writer keeps in flight (``stream_worker.py --concurrency``).
CONCURRENCY = 4


def redis_command(*commands: bytes) -> list[bytes]:
    """Send inline commands to the test Redis and return the raw replies."""
    import socket as _socket

    from tests.services import REDIS_HOST, REDIS_PORT

    with _socket.create_connection((REDIS_HOST, REDIS_PORT), timeout=5) as s:
        s.sendall(b"".join(c + b"\r\n" for c in commands))
        s.settimeout(0.3)
        data = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        except TimeoutError:
            pass
    return data.split(b"\r\n")


def redis_client_count() -> int:
    """How many clients other than this one Redis has."""
    text = b"\n".join(redis_command(b"CLIENT LIST"))
    return sum(1 for line in text.split(b"\n") if line.startswith(b"id=")) - 1


def kill_all_redis_clients() -> int:
    """CLIENT KILL every Redis client but the one asking; returns how many."""
    import socket as _socket

    from tests.services import REDIS_HOST, REDIS_PORT

    with _socket.create_connection((REDIS_HOST, REDIS_PORT), timeout=5) as s:
        s.sendall(b"CLIENT KILL TYPE normal SKIPME yes\r\nCLIENT KILL TYPE pubsub SKIPME yes\r\n")
        data = b""
        while data.count(b"\r\n") < 2:
            data += s.recv(1024)
    return sum(int(line[1:]) for line in data.split(b"\r\n") if line.startswith(b":"))


def committed_facts(cluster: Cluster) -> dict[str, list[tuple[int, str]]]:
    """(stream_id, event_id) per writer, from the database itself."""
    facts: dict[str, list[tuple[int, str]]] = {}
    for instance, sid, event_id in cluster.query(
        "SELECT instance_name, stream_ordering, event_id FROM events ORDER BY stream_ordering"
    ):
        facts.setdefault(instance, []).append((sid, event_id))
    return facts


def check_reader_log(testcase, log: list[dict], facts: dict[str, list[tuple[int, str]]]) -> None:
    """Every committed fact applied once, in order, never behind a position advance.

    Facts at or below the position the reader started from (loaded from
    stream_positions) are not expected: a fresh reader starts there.
    """
    applied: dict[str, list[tuple[int, str]]] = {}
    start = next(r["positions"] for r in log if r["t"] == "ready")
    facts = {w: [(sid, e) for sid, e in fs if sid > start.get(w, 0)] for w, fs in facts.items()}
    for rec in log:
        if rec["t"] == "rows":
            for event_id in rec["ids"]:
                applied.setdefault(rec["w"], []).append((rec["tok"], event_id))
        elif rec["t"] == "pos":
            seen = {e for _, e in applied.get(rec["w"], [])}
            missing = [e for sid, e in facts.get(rec["w"], []) if sid <= rec["p"] and e not in seen]
            testcase.assertEqual(missing, [], f"position of {rec['w']} advanced to {rec['p']} before these facts")
    for writer, expected in facts.items():
        got = applied.get(writer, [])
        testcase.assertEqual(len(got), len({e for _, e in got}), f"{writer}: a fact was applied twice")
        testcase.assertEqual(got, expected, f"{writer}: applied facts differ from the committed ones")


def check_audit_log(testcase, cluster: Cluster, facts: dict[str, list[tuple[int, str]]],
                    killed: str | None = None) -> None:
    """The writers' audit logs record every committed fact as ok, and exactly the rolled-back ones as aborted.

    A writer SIGKILLed mid-run (``killed``) may lose audit records it had not
    flushed, so its recorded rollbacks may be missing from its log. Its log
    may also hold aborted events of transactions that were in flight at the
    kill: the audit record is written through when a batch completes, before
    the worker's callback records the outcome. Each such event must be one
    the database does not hold and the killed run recorded no outcome for,
    from at most :data:`CONCURRENCY` transactions (the writer's transactions
    in flight).
    """
    import glob

    for writer in WRITERS:
        records = []
        for path in glob.glob(os.path.join(cluster.shared["audit"]["dir"], "writer_logs", writer, "*.jsonl")):
            records += read_jsonl(path)
        ok = sorted((r["stream_id"], r["event_id"]) for r in records
                    if r.get("kind") is None and r["stream"] == "events" and r["outcome"] == "ok")
        testcase.assertEqual(ok, sorted(facts[writer]), f"{writer}: audit log differs from the database")
        aborted = [r["event_id"] for r in records
                   if r.get("kind") is None and r["stream"] == "events" and r["outcome"] == "aborted"]
        testcase.assertEqual(len(aborted), len(set(aborted)), f"{writer}: an event recorded as aborted twice")
        outs = [cluster.out_path(writer), cluster.out_path(writer) + ".2"]  # .2: a restarted writer's
        lines = {p: read_jsonl(p) for p in outs if os.path.exists(p)}
        rolled_back = {e for recs in lines.values() for r in recs if r["t"] == "rollback" for e in r["events"]}
        if writer != killed:
            testcase.assertEqual(sorted(aborted), sorted(rolled_back),
                                 f"{writer}: aborted audit records differ from the recorded rollbacks")
        else:
            first_run = lines.get(cluster.out_path(writer), [])
            outcome = ({r["event_id"] for r in first_run if r["t"] == "fact"}
                       | {e for r in first_run if r["t"] == "rollback" for e in r["events"]})
            committed = {e for _, e in facts[writer]}
            unrecorded = [e for e in aborted if e not in rolled_back]
            for event_id in unrecorded:
                testcase.assertNotIn(event_id, committed, f"{writer}: {event_id} recorded as aborted but committed")
                testcase.assertNotIn(event_id, outcome,
                                     f"{writer}: {event_id} recorded as aborted but its outcome was a fact")
            # Event IDs are $<writer>-<seed>-<transaction>-<index>:test
            in_flight = {e.rsplit("-", 1)[0] for e in unrecorded}
            testcase.assertLessEqual(len(in_flight), CONCURRENCY,
                                     f"{writer}: aborted events without a recorded rollback: {sorted(unrecorded)}")
        for r in records:
            if r.get("kind") is None:
                testcase.assertLessEqual(r["reserved_at"], r["completed_at"])
        testcase.assertTrue(any(r.get("kind") == "position" for r in records))


class MultiWriterMixin:
    engine = "sqlite"
    transport = "tcp"
    timeout = 300
    COUNT = 700  # transactions per writer, 1-3 facts each

    @inlineCallbacks
    def _scenario(self, *, disconnect_reader=False, kill_writer=False, kill_redis_clients=False):
        cluster = Cluster(self, engine=self.engine, transport=self.transport, writers=WRITERS,
                          extra_instances=READERS)
        yield cluster.start_master()
        reader_extra = {}
        proxy = None
        if disconnect_reader:
            proxy = DroppingProxy("127.0.0.1", cluster.hub_port)
            port = proxy.listen()
            self.addCleanup(proxy.close)
            reader_extra = {"replication": {"hub": {"host": "127.0.0.1", "port": port}}}
        for reader in READERS:
            cluster.start_script(reader, "cache_invalidator", WORKER, "--role", "reader",
                                 "--out", cluster.out_path(reader), **(reader_extra if reader == "reader1" else {}))
        for reader in READERS:
            yield wait_until(lambda r=reader: (cluster.check_alive(r), read_jsonl(cluster.out_path(r)))[1],
                             60, f"{reader} to start")
        hold_path = cluster.out_path("persister2") + ".hold"
        for i, name in enumerate(WRITERS):
            hold = ["--hold-at", str(self.COUNT // 3)] if kill_writer and name == "persister2" else []
            cluster.start_script(name, "event_persister", WORKER, "--role", "writer", "--seed", str(i + 1),
                                 "--count", str(self.COUNT), "--rollback", "0.15", "--concurrency", str(CONCURRENCY),
                                 "--out", cluster.out_path(name), *hold)

        def facts_written(name):
            return sum(1 for r in read_jsonl(cluster.out_path(name)) if r["t"] == "fact")

        if kill_redis_clients:
            processes = 1 + len(WRITERS) + len(READERS)
            for fraction in (3, 2):
                yield wait_until(lambda f=fraction: facts_written("persister1") > self.COUNT // f, 120, "more writes")
                yield wait_until(lambda: redis_client_count() >= 2 * processes, 30,
                                 "every process to have both Redis connections")
                killed = kill_all_redis_clients()
                self.assertGreaterEqual(killed, 2 * processes)
        if disconnect_reader:
            yield wait_until(lambda: facts_written("persister1") > self.COUNT // 2, 120, "half the writes")
            dropped = proxy.drop_all()
            self.assertGreaterEqual(dropped, 1)
            yield sleep(1.0)
        if kill_writer:
            # The writer holds its (COUNT // 3)-th transaction open once its
            # rows are inserted: the SIGKILL lands inside that transaction.
            yield wait_until(lambda: os.path.exists(hold_path), 120, "persister2 to hold a transaction open")
            cluster.kill("persister2")
            with open(hold_path, encoding="utf-8") as f:
                held = json.load(f)
            before = read_jsonl(cluster.out_path("persister2"))
            yield sleep(0.5)
            cluster.start_script("persister2", "event_persister", WORKER, "--role", "writer", "--seed", "9",
                                 "--count", "200", "--rollback", "0.15", "--concurrency", str(CONCURRENCY),
                                 "--out", cluster.out_path("persister2") + ".2")

        def all_done():
            cluster.check_alive()
            outs = [cluster.out_path("persister1"),
                    cluster.out_path("persister2") + (".2" if kill_writer else "")]
            return all(any(r["t"] == "done" for r in read_jsonl(p)) for p in outs)

        yield wait_until(all_done, 240, "the writers to finish")
        facts = committed_facts(cluster)
        final = {w: max(s for s, _ in facts[w]) for w in WRITERS}

        def reader_caught_up(reader):
            cluster.check_alive(reader)
            pos = {}
            for rec in read_jsonl(cluster.out_path(reader)):
                if rec["t"] == "pos":
                    pos[rec["w"]] = rec["p"]
            return all(pos.get(w, 0) >= final[w] for w in WRITERS)

        for reader in READERS:
            yield wait_until(lambda r=reader: reader_caught_up(r), 120, f"{reader} to reach every writer's last fact")
        yield sleep(0.5)
        for reader in READERS:
            check_reader_log(self, read_jsonl(cluster.out_path(reader)), facts)
        yield sleep(1.0)  # the audit log flushes every 0.5 s
        # A SIGKILL loses the killed writer's unflushed audit records; its
        # restart re-records the committed facts among them, but not rollbacks.
        check_audit_log(self, cluster, facts, killed="persister2" if kill_writer else None)
        # Once quiet, the readers' vector clock is the writers' own final
        # positions: equal, neither behind nor ahead (idle writers leap to the
        # highest ID allocated, so the writers settle on the same value).
        def writer_out(w):
            return cluster.out_path(w) + (".2" if kill_writer and w == "persister2" else "")

        def writer_positions():
            return {w: [r["position"] for r in read_jsonl(writer_out(w)) if r["t"] == "wpos"][-1] for w in WRITERS}

        def reader_clock(reader):
            pos = {}
            for rec in read_jsonl(cluster.out_path(reader)):
                if rec["t"] == "pos":
                    pos[rec["w"]] = rec["p"]
            return {w: pos.get(w) for w in WRITERS}

        yield wait_until(lambda: all(reader_clock(r) == writer_positions() for r in READERS), 30,
                         "the readers' vector clocks to equal the writers' positions")
        yield sleep(1.0)  # several idle ticks: nothing may move any more
        for name in WRITERS:
            yield cluster.stop(name)
        for name in READERS:
            yield cluster.stop(name)
        final_positions = writer_positions()  # the last record is written at shutdown
        self.assertGreaterEqual(min(final_positions.values()), max(s for fs in facts.values() for s, _ in fs))
        for reader in READERS:
            self.assertEqual(reader_clock(reader), final_positions, f"{reader}'s final vector clock")
        if disconnect_reader:
            (stats,) = [r for r in read_jsonl(cluster.out_path("reader1")) if r["t"] == "stats"]
            self.assertGreaterEqual(stats["catch_ups"], 1, "reader1 reconnected without catching up")
        self.assertGreater(sum(len(v) for v in facts.values()), self.COUNT)
        if kill_writer:
            recorded = {r["event_id"] for r in before if r["t"] == "fact"}
            in_db = {e for _, e in facts["persister2"]}
            self.assertEqual(recorded - in_db, set(), "a fact reported committed before the kill is missing")
            after = [r["sid"] for r in read_jsonl(cluster.out_path("persister2") + ".2") if r["t"] == "fact"]
            self.assertTrue(after, "the restarted writer committed nothing")
            before_ids = [r["sid"] for r in before if r["t"] == "fact"]
            self.assertGreater(min(after), max(before_ids), "the restarted writer reused a stream ID")
            # The transaction open at the kill rolled back: none of its facts
            # exist and the positions moved past its IDs. On PostgreSQL its IDs
            # (from the sequence, outside the transaction) are never used
            # again; on SQLite the sequence bump rolled back with it, so a
            # later fact may take an ID that no fact ever had.
            all_ids = {e for fs in facts.values() for _, e in fs}
            self.assertEqual(set(held["event_ids"]) & all_ids, set(), "the held transaction's facts were committed")
            if self.engine == "postgres":
                all_sids = {sid for fs in facts.values() for sid, _ in fs}
                self.assertEqual(set(held["sids"]) & all_sids, set(), "a stream ID of the held transaction was used")
            self.assertGreater(min(final_positions.values()), max(held["sids"]))
        return cluster

    @inlineCallbacks
    def test_idle_writer_does_not_hold_back_minimum(self):
        """With one writer idle the whole run, the reader's minimum still reaches the busy writer's last fact."""
        cluster = Cluster(self, engine=self.engine, transport=self.transport, writers=WRITERS,
                          extra_instances=("reader1",))
        yield cluster.start_master()
        cluster.start_script("reader1", "cache_invalidator", WORKER, "--role", "reader",
                             "--out", cluster.out_path("reader1"))
        yield wait_until(lambda: (cluster.check_alive("reader1"), read_jsonl(cluster.out_path("reader1")))[1],
                         60, "the reader to start")
        cluster.start_script("persister2", "event_persister", WORKER, "--role", "writer", "--count", "0",
                             "--out", cluster.out_path("persister2"))
        cluster.start_script("persister1", "event_persister", WORKER, "--role", "writer", "--count", "300",
                             "--seed", "3", "--out", cluster.out_path("persister1"))
        yield wait_until(
            lambda: (cluster.check_alive(), any(r["t"] == "done" for r in read_jsonl(cluster.out_path("persister1"))))[1],
            120, "the busy writer to finish")
        last = max(s for s, _ in committed_facts(cluster)["persister1"])
        self.assertNotIn("persister2", committed_facts(cluster))

        def minimum():
            pos = {}
            for rec in read_jsonl(cluster.out_path("reader1")):
                if rec["t"] == "pos":
                    pos[rec["w"]] = rec["p"]
            return min(pos.get(w, 0) for w in WRITERS)

        yield wait_until(lambda: minimum() >= last, 30, f"the minimum position to reach {last}")
        check_reader_log(self, read_jsonl(cluster.out_path("reader1")), committed_facts(cluster))

    def test_two_writers_two_readers(self):
        """Every committed fact of two concurrent writers reaches both readers once, in per-writer order."""
        return self._scenario()

    def test_writer_killed_and_restarted(self):
        """A writer SIGKILLed mid-run restarts without reusing IDs or losing committed facts."""
        return self._scenario(kill_writer=True)


class TcpMixin(MultiWriterMixin):
    transport = "tcp"

    def test_reader_disconnected_mid_run(self):
        """A reader whose hub connection is cut mid-run catches up through the POSITION gap, losing nothing."""
        return self._scenario(disconnect_reader=True)


class SqliteTcpTest(TcpMixin, TestCase):
    engine = "sqlite"


class PostgresTcpTest(TcpMixin, TestCase):
    engine = "postgres"


class RedisMixin(MultiWriterMixin):
    transport = "redis"

    def test_redis_clients_killed_mid_run(self):
        """Every Redis connection killed twice mid-run: all processes reconnect and readers still get every fact once."""
        return self._scenario(kill_redis_clients=True)


class SqliteRedisTest(RedisMixin, TestCase):
    engine = "sqlite"


class PostgresRedisTest(RedisMixin, TestCase):
    engine = "postgres"

