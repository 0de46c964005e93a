"""The benchmark harness runs and writes its three outputs.

Runs ``python -m scripts.benchmarks --quick --only codec,tcp`` (the two
benchmarks that need no service, about 20 s) in real processes and checks
``bench.json``, ``bench.md`` and the scaling plot. Nothing here asserts a
speed: the figures are reported, never judged by a test.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from twisted.trial import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class BenchHarnessTest(unittest.TestCase):
    def test_quick_run_writes_json_table_and_plot(self) -> None:
        out = tempfile.mkdtemp(prefix="synflow-bench-test-")
        self.addCleanup(shutil.rmtree, out, True)
        proc = subprocess.run(
            [sys.executable, "-m", "scripts.benchmarks", "--quick", "--only", "codec,tcp", "--out", out],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=600,
        )
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        # progress is shown while it runs
        self.assertIn("[bench ", proc.stderr)
        self.assertIn("==> codec [1/1]", proc.stderr)

        with open(os.path.join(out, "bench.json"), encoding="utf-8") as f:
            data = json.load(f)
        self.assertEqual(data["mode"], "quick")
        self.assertEqual(data["machine"]["cores"], os.cpu_count())
        by_name = {b["name"]: b for b in data["benchmarks"]}
        self.assertEqual(set(by_name), {"codec", "tcp"})
        for bench in by_name.values():
            self.assertEqual(bench["errors"], [])
            self.assertEqual(bench["succeeded"], 1)
            for target in bench["targets"]:
                self.assertIn(target["met"], (True, False))
        rows = {r["key"]: r for b in by_name.values() for r in b["rows"]}
        # every figure comes with the ceiling measured in the same run, and the ratio between them
        mix = rows["codec.mix"]
        self.assertGreater(mix["value"], 0)
        self.assertGreater(mix["ceiling"], 0)
        self.assertAlmostEqual(mix["ratio"], mix["value"] / mix["ceiling"], places=6)
        tcp_rows = [r for k, r in rows.items() if k.startswith("tcp.")]
        self.assertTrue(tcp_rows)
        self.assertTrue(all(r["value"] > 0 for r in tcp_rows))

        with open(os.path.join(out, "bench.md"), encoding="utf-8") as f:
            table = f.read()
        self.assertIn("| benchmark | figure | measured | ceiling | ratio | target | met? |", table)
        self.assertIn("| codec | parse + encode, mixed lines |", table)
        self.assertIn("Targets met:", table)

        with open(os.path.join(out, "scaling.png"), "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")


class MainjobSamplesTest(unittest.SynchronousTestCase):
    """The main job's busy-cores figure comes from the samples that bound the sends."""

    def test_cores_between_the_bounding_samples(self) -> None:
        sys.path.insert(0, ROOT)
        self.addCleanup(sys.path.remove, ROOT)
        from scripts.benchmarks.mainjob import _Samples

        samples = _Samples({"master": 1})
        # (time, (busy jiffies, total jiffies) of the machine, CPU seconds of each process)
        samples.rows = [
            (0.0, (0.0, 0.0), {"master": 0.0, "driver": 0.0}),
            (1.0, (50.0, 200.0), {"master": 0.2, "driver": 0.1}),   # before the first send
            (2.0, (200.0, 400.0), {"master": 0.9, "driver": 0.3}),
            (3.0, (350.0, 600.0), {"master": 1.6, "driver": 0.5}),  # after the last answer
            (4.0, (360.0, 800.0), {"master": 1.6, "driver": 0.5}),
        ]
        machine, by_process = samples.cores_between(1.5, 2.5, cores=2)
        self.assertAlmostEqual(machine, 300 / 400 * 2)  # the 1.0 and 3.0 samples, not the idle tail
        self.assertAlmostEqual(by_process["master"], 0.7)
        self.assertAlmostEqual(by_process["driver"], 0.2)
        # What each process used over the whole traffic: from the first sample to the last.
        self.assertEqual(samples.spent(), {"master": 1.6, "driver": 0.5})


class PersistWorkCountsTest(unittest.SynchronousTestCase):
    """The persist benchmark's work rows come from the processes' own counters, summed and differenced."""

    PAGES = {
        "master": ('synflow_rpc_calls_total{name="persist_events",outcome="ok"} 7.0\n'
                   'synflow_http_request_seconds_count{code="200",route="on_send"} {sends}\n'
                   'synflow_http_request_seconds_count{code="200",route="on_sync"} 99.0\n'),
        "persister1": ("synflow_events_persisted_total {events}\n"
                       "synflow_persist_batch_events_count {txns}\n"
                       "synflow_persist_batch_events_sum {events}\n"
                       'synflow_rpc_served_total{name="persist_events",outcome="ok"} {rpcs}\n'
                       'synflow_rpc_served_total{name="other_method",outcome="ok"} 50.0\n'
                       'synflow_http_request_seconds_count{code="200",route="on_send"} 3.0\n'),
    }

    def test_counts_sum_the_named_series_and_the_phase_is_their_difference(self) -> None:
        sys.path.insert(0, ROOT)
        self.addCleanup(sys.path.remove, ROOT)
        from scripts.benchmarks.persist import work_counts, work_done

        class Deployment:
            writers = ["persister1"]
            values = {"sends": 10, "events": 100, "txns": 10, "rpcs": 4}

            def metrics(self, name: str) -> str:
                page = PersistWorkCountsTest.PAGES[name]
                for key, value in self.values.items():
                    page = page.replace("{" + key + "}", f"{value}.0")
                return page

        dep = Deployment()
        before = work_counts(dep)  # type: ignore[arg-type]
        self.assertEqual(before, {"events": 100, "transactions": 10, "rpcs": 4, "client_sends": 13})
        dep.values = {"sends": 60, "events": 500, "txns": 30, "rpcs": 24}
        done = work_done(before, work_counts(dep))  # type: ignore[arg-type]
        self.assertEqual(done["events"], 400)
        self.assertEqual(done["client_sends"], 50)
        self.assertEqual(done["events_per_transaction"], 20.0)  # 400 events in 20 transactions
        self.assertEqual(done["rpcs_per_100_events"], 5.0)  # 20 persist_events RPCs, other methods left out


class PersistInProcessTest(unittest.TestCase):
    """The persist transaction measured in one process: real PostgreSQL, a JSON result whose split adds up."""

    def test_sizes_and_the_fixed_and_per_event_split(self) -> None:
        sys.path.insert(0, ROOT)
        self.addCleanup(sys.path.remove, ROOT)
        from scripts.benchmarks.persistproc import PARTS, SIZES
        from tests.services import create_pg_database, drop_pg_database, require_postgres

        require_postgres()
        dbname = create_pg_database()
        self.addCleanup(drop_pg_database, dbname)
        proc = subprocess.run(
            [sys.executable, "-m", "scripts.benchmarks.persistproc", "--dbname", dbname, "--batches", "20",
             "--passes", "1"],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=300,
        )
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        result = json.loads(proc.stdout)
        self.assertEqual(sorted(result["sizes"]), sorted(str(s) for s in SIZES))
        small, large = (result["sizes"][str(s)] for s in SIZES)
        for part in PARTS:  # the fixed part and the per-event part reproduce both sizes
            fixed, per_event = result["split"][part]["per_transaction_ms"], result["split"][part]["per_event_ms"]
            self.assertAlmostEqual(fixed + SIZES[0] * per_event, small[part], places=3)
            self.assertAlmostEqual(fixed + SIZES[1] * per_event, large[part], places=3)
        self.assertAlmostEqual(result["fixed_ms_per_transaction"],
                               sum(result["split"][p]["per_transaction_ms"] for p in PARTS), places=3)
        self.assertGreater(large["wall"], 0)
        # every event of the run was persisted: the warm-up's, then 20 batches of each size
        import psycopg2

        from scripts.benchmarks.common import PG_HOST, PG_PORT, PG_USER

        conn = psycopg2.connect(host=PG_HOST, port=PG_PORT, user=PG_USER, dbname=dbname)
        try:
            cur = conn.cursor()
            cur.execute("SELECT count(*) FROM events WHERE type = 'm.room.message'")
            self.assertEqual(cur.fetchone()[0], sum(50 * s + 20 * s for s in SIZES))
        finally:
            conn.close()


class ProcessGroupCleanupTest(unittest.SynchronousTestCase):
    """A child leading its own process group is recorded, so the runner kills it if the benchmark dies.

    The runner kills a repetition's process group when it is interrupted or
    times out; a child the benchmark started in a group of its own (the
    Spark sizes) is outside it, and used to keep running.
    """

    def setUp(self) -> None:
        sys.path.insert(0, ROOT)
        self.addCleanup(sys.path.remove, ROOT)
        self.tmp = tempfile.mkdtemp(prefix="synflow-bench-cleanup-")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.record = os.path.join(self.tmp, "cleanup")
        os.environ["SYNFLOW_BENCH_CLEANUP"] = self.record
        self.addCleanup(os.environ.pop, "SYNFLOW_BENCH_CLEANUP", None)

    def _group_alive(self, pgid: int) -> bool:
        """Whether a process of group ``pgid`` is running (a zombie, dead but not yet reaped, does not count)."""
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
                return True
        return False

    def _group_gone(self, pgid: int) -> bool:
        """Whether the group's processes are gone within 5 s."""
        for _ in range(100):
            if not self._group_alive(pgid):
                return True
            time.sleep(0.05)
        return False

    def test_an_orphaned_group_is_killed_by_the_cleanup(self) -> None:
        from scripts.benchmarks.common import Children, run_cleanups

        children = Children(self.tmp)
        # A leader and a grandchild of its own, as a Spark size's validator and its JVM.
        child = children.spawn("group", ["sh", "-c", "sleep 300 & sleep 300"], group=True)
        self.addCleanup(lambda: self._group_alive(child.pid) and os.killpg(child.pid, signal.SIGKILL))
        self.assertTrue(self._group_alive(child.pid))
        # The benchmark process dies without stopping its children (SIGKILL from the runner).
        done = run_cleanups(self.record)
        self.assertEqual(done, [f"process_group {child.pid}"])
        child.proc.wait(10)
        self.assertTrue(self._group_gone(child.pid), "the grandchild survived")
        self.assertFalse(os.path.exists(self.record))

    def test_a_group_stopped_normally_is_not_killed_again(self) -> None:
        from scripts.benchmarks.common import Children, run_cleanups

        with Children(self.tmp) as children:
            child = children.spawn("group", ["sh", "-c", "sleep 300"], group=True)
        self.assertTrue(self._group_gone(child.pid))
        # Its ID may belong to another group by now: the record says it is done.
        self.assertEqual(run_cleanups(self.record), [])


class ProfilePathsTest(unittest.SynchronousTestCase):
    """``paths_table``: each process's samples share its measured CPU and go to the first path their stack
    enters; waits count for nothing."""

    def _file(self, lines: list[str]) -> str:
        fd, path = tempfile.mkstemp(suffix=".txt")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        self.addCleanup(os.remove, path)
        return path

    def test_samples_share_the_process_cpu_by_first_path(self) -> None:
        sys.path.insert(0, ROOT)
        self.addCleanup(sys.path.remove, ROOT)
        from scripts.benchmarks.profile import OTHER, path_of, paths_table

        loop = "ReactorBase.mainLoop (twisted/internet/base.py:697)"
        sync = ";".join([loop, "JsonResource._dispatch (synflow/http/server.py:493)",
                         "ClientApi.on_sync (synflow/http/client_api.py:280)", "f (x.py:1)"])
        head = ";".join([loop, "HTTPChannel.lineReceived (twisted/web/http.py:2400)"])
        master = self._file([f"{sync} 3", f"{head} 1", f"{loop};EPollReactor.doPoll (twisted/internet/epollreactor.py:238) 50"])
        persister = self._file([f"{loop};Thread.run (threading.py:1);ThreadWorker.work (twisted/_threads/_threadworker.py:1) 2",
                                f"{loop};DelayedCall.__lt__ (twisted/internet/base.py:1) 2"])
        self.assertEqual(path_of(sync), "sync")  # on the sync path, though the dispatch comes first in the stack
        self.assertEqual(path_of(head), "twisted.web outside the handlers")
        table = paths_table({"master": (master, 0.4), "persister": (persister, 0.2)})
        # The master's 0.4 ms over its 4 working samples (the epoll wait left out): 300 µs sync, 100 µs head.
        self.assertIn("| sync | 300 | 50.0% |", table)
        self.assertIn("| twisted.web outside the handlers | 100 | 16.7% |", table)
        self.assertIn("| database threads | 100 | 16.7% |", table)
        self.assertIn(f"| {OTHER} | 100 | 16.7% |", table)
        self.assertIn("| master | 400 | sync 300, twisted.web outside the handlers 100 |", table)
        self.assertIn("over 2 processes, 600 µs", table)
