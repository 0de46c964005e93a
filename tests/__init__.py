"""synflow's trial test suite.

Layers (see docs/testing.md): pure, protocol conformance, in-process cluster,
and integration against real processes and services.
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

#: Java options for the JVMs the tests start (the shared Spark session's, spark-submit's, the
#: validator command line's, the standalone cluster's daemons and executors). They live for seconds
#: to a minute on inputs of a few thousand rows, where the optimising JIT compiler and the parallel
#: garbage collectors' threads cost more CPU than they ever save: with the quick compiler only, the
#: spark-submit tests took half the CPU. With the quick compiler only, the JVM's code cache shrinks
#: to 48 MB, which a session running validator after validator fills: the sweeper then evicts and
#: recompiles (a run every few took 60% more CPU), so the cache keeps the tiered default's size.
#: Set either variable to override.
TEST_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -XX:ReservedCodeCacheSize=240m"
for _var in ("SPARK_SUBMIT_OPTS", "SPARK_DAEMON_JAVA_OPTS"):
    os.environ.setdefault(_var, TEST_JVM_OPTIONS)

# Keep synflow's stdlib log records out of the test output but on disk, in the
# trial working directory, for debugging a failure.
import logging  # noqa: E402


class _CwdFileHandler(logging.FileHandler):
    """Opens its file on first use, relative to the working directory then
    (trial's temp directory while tests run), not at import time."""

    def __init__(self, name: str) -> None:
        logging.Handler.__init__(self)
        self._name = name
        self.stream = None  # type: ignore[assignment]
        self.baseFilename = name
        self.mode = "a"
        self.encoding = "utf-8"
        self.errors = None
        self.delay = True

    def _open(self):
        return open(os.path.abspath(self._name), "a", encoding="utf-8")


_handler = _CwdFileHandler("synflow-test.log")
_handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
_root = logging.getLogger()
_root.addHandler(_handler)
_root.setLevel(logging.DEBUG if os.environ.get("SYNFLOW_TEST_DEBUG") else logging.INFO)

# SYNFLOW_TEST_TIMES=FILE: append one line per test to FILE (its id, start and end times, the
# trial worker's pid and the CPU seconds the test used), so that a run of the suite shows where
# its time goes (``scripts/run_tests.py`` prints the slowest tests from it). The CPU is the
# worker's own, its reaped children's (twistd processes, spark-submit) and its live children's
# (the shared Spark session's JVM, deployments shared between tests); not the database servers'.
if os.environ.get("SYNFLOW_TEST_TIMES"):
    import time as _time

    from twisted.trial._synctest import SynchronousTestCase as _Sync

    _times_path = os.path.abspath(os.environ["SYNFLOW_TEST_TIMES"])
    _plain_run = _Sync.run
    _ticks = os.sysconf("SC_CLK_TCK")

    def _live_children_cpu(pid: int) -> float:
        total = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii") as fh:
                    fields = fh.read().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                total += int(fields[11]) + int(fields[12])
        return total / _ticks

    def _cpu() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system + _live_children_cpu(os.getpid())

    def _timed_run(self, result):  # type: ignore[no-untyped-def]
        start, cpu = _time.time(), _cpu()
        try:
            return _plain_run(self, result)
        finally:
            with open(_times_path, "a", encoding="utf-8") as _fh:
                _fh.write(f"{self.id()}\t{start:.3f}\t{_time.time():.3f}\t{os.getpid()}\t{_cpu() - cpu:.2f}\n")

    _Sync.run = _timed_run  # type: ignore[method-assign]
