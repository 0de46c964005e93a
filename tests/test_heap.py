"""The garbage collector in synflow processes: start-up heap frozen, every collection's pause measured.

A full collection walks every tracked object and stops the reactor thread
while it does; see ``synflow/app/heap.py``. The unit tests run the functions
in this process (undoing the freeze after); the process test starts a master
under twistd and reads its log and ``/metrics``.
"""

from __future__ import annotations

import gc
import io
import urllib.request

from prometheus_client import REGISTRY
from twisted.trial.unittest import SynchronousTestCase

from synflow.app import heap
from synflow.tools import ctl
from tests.cluster import free_port
from tests.test_ctl import small_deployment


def _pauses(generation: int) -> float:
    return REGISTRY.get_sample_value("synflow_gc_pause_seconds_count", {"generation": str(generation)}) or 0.0


class WatchCollectionsTest(SynchronousTestCase):
    def setUp(self) -> None:
        self.addCleanup(lambda: heap._on_collection in gc.callbacks and gc.callbacks.remove(heap._on_collection))

    def test_each_collection_is_timed_by_generation(self) -> None:
        """After watch_collections, a collection of generation N adds one pause to generation N's histogram."""
        heap.watch_collections()
        before = [_pauses(g) for g in range(3)]
        gc.collect(0)
        gc.collect(2)
        after = [_pauses(g) for g in range(3)]
        self.assertGreaterEqual(after[0] - before[0], 1)  # automatic gen-0 collections may add more
        self.assertGreaterEqual(after[2] - before[2], 1)
        total = REGISTRY.get_sample_value("synflow_gc_pause_seconds_sum", {"generation": "2"})
        self.assertGreater(total, 0.0)

    def test_watching_twice_installs_one_callback(self) -> None:
        """A second watch_collections does not double-count: one callback, one observation per collection."""
        heap.watch_collections()
        heap.watch_collections()
        self.assertEqual(gc.callbacks.count(heap._on_collection), 1)
        gc.disable()  # no automatic collection between the two readings
        self.addCleanup(gc.enable)
        before = _pauses(1)
        gc.collect(1)
        self.assertEqual(_pauses(1) - before, 1)


class FreezeStartupHeapTest(SynchronousTestCase):
    def test_objects_alive_at_freeze_are_out_of_reach(self) -> None:
        """Everything alive when the heap is frozen is counted as frozen and reported; later objects are not."""
        self.addCleanup(gc.unfreeze)
        marker = [object()]
        count = heap.freeze_startup_heap()
        # Frozen objects may still be freed (by this thread's log call, or by another thread of
        # the test process releasing what it held), so the count can only fall, and only by a few.
        now = gc.get_freeze_count()
        self.assertLessEqual(now, count)
        self.assertGreater(now, count - 100)
        self.assertGreater(count, 1000)  # at least the modules and classes of this process
        self.assertEqual(REGISTRY.get_sample_value("synflow_gc_frozen_objects"), count)
        self.assertFalse(any(obj is marker for obj in gc.get_objects()))  # frozen: no generation lists it
        later = [object()]
        self.assertTrue(any(obj is later for obj in gc.get_objects()))


class ProcessHeapTest(SynchronousTestCase):
    def test_a_started_process_freezes_its_heap_and_reports_pauses(self) -> None:
        """A master started by twistd logs the frozen count and serves it and the pause histogram on /metrics."""
        directory = small_deployment(self, {"master": free_port(), "p1": free_port(), "p2": free_port()})
        master = next(p for p in ctl.discover(directory, []) if p.name == "master")
        out = io.StringIO()
        self.addCleanup(ctl.stop, [master], io.StringIO())
        self.assertEqual(ctl.start([master], out), 0, out.getvalue())
        assert master.metrics_url is not None
        with urllib.request.urlopen(master.metrics_url, timeout=10) as response:
            text = response.read().decode()
        frozen = [line for line in text.splitlines() if line.startswith("synflow_gc_frozen_objects ")]
        self.assertEqual(len(frozen), 1, text)
        self.assertGreater(float(frozen[0].split()[1]), 10_000)
        self.assertIn('synflow_gc_pause_seconds_count{generation="0"}', text)
        ctl.stop([master], io.StringIO())
        with open(master.log_file, encoding="utf-8") as f:
            log = f.read()
        self.assertRegex(log, r"start-up heap frozen: \d+ objects")
