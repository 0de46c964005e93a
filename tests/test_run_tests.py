"""scripts/run_tests.py: the closing line and exit code it derives from trial's output."""

from __future__ import annotations

import importlib.util
import os

from twisted.trial.unittest import SynchronousTestCase

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
_PATH = os.path.join(ROOT, "scripts", "run_tests.py")
_spec = importlib.util.spec_from_file_location("synflow_run_tests", _PATH)
assert _spec is not None and _spec.loader is not None
run_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_tests)


def _output(*tail: str) -> list[str]:
    """trial-like output ending with the given lines."""
    return ["tests.test_x", "  XTest", "    test_a ...   [OK]", "", "-" * 79, "Ran 3 tests in 0.1s", "", *tail]


class SummarizeTest(SynchronousTestCase):
    def test_all_passed(self):
        """A passing run with skips and expected failures reports them and exits 0."""
        lines, code = run_tests.summarize(_output("PASSED (skips=2, expectedFailures=1, successes=40)\n"), 0)
        self.assertEqual(lines, ["41 passed, 0 failed, 2 skipped"])
        self.assertEqual(code, 0)

    def test_failures_and_errors(self):
        """Failures, errors and unexpected successes all count as failed and exit non-zero."""
        lines, code = run_tests.summarize(
            _output("FAILED (failures=2, errors=1, unexpectedSuccesses=1, successes=7)"), 1
        )
        self.assertEqual(lines, ["7 passed, 4 failed, 0 skipped"])
        self.assertEqual(code, 1)

    def test_no_test_ran(self):
        """trial's bare PASSED after running nothing exits non-zero, saying so."""
        lines, code = run_tests.summarize(["", "-" * 79, "Ran 0 tests in 0.000s", "", "PASSED"], 0)
        self.assertEqual(lines, ["no test ran", "0 passed, 0 failed, 0 skipped"])
        self.assertEqual(code, 1)

    def test_only_skips(self):
        """A run where every test skipped ran nothing and exits non-zero."""
        lines, code = run_tests.summarize(_output("PASSED (skips=5)"), 0)
        self.assertEqual(lines[-1], "0 passed, 0 failed, 5 skipped")
        self.assertEqual(code, 1)

    def test_no_summary(self):
        """Output without trial's summary (trial crashed) exits non-zero with a failure counted."""
        lines, code = run_tests.summarize(["Traceback (most recent call last):", "ImportError: boom"], 1)
        self.assertEqual(lines, ["trial printed no summary (exit code 1)", "0 passed, 1 failed"])
        self.assertEqual(code, 1)

    def test_last_summary_wins(self):
        """A test printing a summary-like line does not hide trial's real summary after it."""
        lines, code = run_tests.summarize(_output("PASSED (successes=1)", "FAILED (errors=1, successes=2)"), 1)
        self.assertEqual(lines, ["2 passed, 1 failed, 0 skipped"])
        self.assertEqual(code, 1)

    def test_trial_exit_code_counts(self):
        """A PASSED summary with a non-zero trial exit code still fails the run."""
        _, code = run_tests.summarize(_output("PASSED (successes=3)"), 1)
        self.assertEqual(code, 1)


class TrialArgsTest(SynchronousTestCase):
    def test_parallel_by_default(self):
        """Unset SYNFLOW_TEST_JOBS (or auto) runs two trial workers per CPU, at most MAX_JOBS."""
        self.assertEqual(run_tests.trial_args([], None, 1), ["-j", "2", "tests"])
        self.assertEqual(run_tests.trial_args([], "auto", 2), ["-j", "4", "tests"])
        self.assertEqual(run_tests.trial_args(["tests.replication"], "", 64),
                         ["-j", str(run_tests.MAX_JOBS), "tests.replication"])

    def test_one_process(self):
        """SYNFLOW_TEST_JOBS=1 runs the suite in one process, as it is named."""
        self.assertEqual(run_tests.trial_args([], "1", 8, ["tests.test_a", "tests.test_b"]), ["tests"])
        self.assertEqual(run_tests.trial_args(["tests.replication"], "1", 8), ["tests.replication"])

    def test_explicit_jobs(self):
        """A count is used as it is; a -j given on the command line is left alone; 0 is refused."""
        self.assertEqual(run_tests.trial_args([], "3", 8), ["-j", "3", "tests"])
        self.assertEqual(run_tests.trial_args(["-j3", "tests"], "1", 8), ["-j3", "tests"])
        self.assertEqual(run_tests.trial_args(["--jobs=4", "tests"], None, 8), ["--jobs=4", "tests"])
        with self.assertRaises(ValueError):
            run_tests.trial_args([], "0", 8)

    def test_whole_suite_in_parallel_starts_the_slowest_modules(self):
        """Run whole and in parallel, the suite is named module by module, the known slow ones first in their
        order, then every other module sorted; a named subset is passed as it is."""
        slow = list(run_tests.SLOW_FIRST[:2])
        modules = ["tests.test_b", slow[1], "tests.test_a", slow[0]]
        self.assertEqual(run_tests.trial_args([], "2", 2, modules), ["-j", "2", *slow, "tests.test_a", "tests.test_b"])
        self.assertEqual(run_tests.trial_args(["tests.http"], "2", 2, modules), ["-j", "2", "tests.http"])

    def test_modules_found_are_the_suite(self):
        """Every test module of the suite is found, and every slow module named exists."""
        modules = run_tests.test_modules(os.path.join(ROOT, "tests"))
        self.assertIn("tests.integration.test_faults", modules)
        self.assertIn("tests.test_run_tests", modules)
        self.assertNotIn("tests.cluster", modules)
        for slow in run_tests.SLOW_FIRST:
            self.assertIn(slow, modules)


class LanesTest(SynchronousTestCase):
    def test_whole_suite_in_two_lanes(self):
        """Run whole by two workers or more, the Spark-session modules get half of the workers in a lane of their
        own and every other module the rest, each lane slowest first; every module is in exactly one lane."""
        slow = run_tests.SLOW_FIRST
        modules = ["tests.test_b", slow[0], "tests.spark.test_x", "tests.test_a", slow[2]]
        session = [slow[0], "tests.spark.test_x"]
        self.assertEqual(run_tests.trial_runs([], "4", 2, modules, session), [
            ("spark", ["-j", "2", slow[0], "tests.spark.test_x"]),
            ("main", ["-j", "2", slow[2], "tests.test_a", "tests.test_b"]),
        ])
        self.assertEqual(run_tests.trial_runs([], "3", 2, modules, session), [
            ("spark", ["-j", "1", slow[0], "tests.spark.test_x"]),
            ("main", ["-j", "2", slow[2], "tests.test_a", "tests.test_b"]),
        ])

    def test_one_run_otherwise(self):
        """A named subset, one process, or a suite without Spark-session modules is one trial run."""
        modules = ["tests.test_a", "tests.spark.test_x"]
        session = ["tests.spark.test_x"]
        self.assertEqual(run_tests.trial_runs(["tests.spark"], "4", 2, modules, session),
                         [("main", ["-j", "4", "tests.spark"])])
        self.assertEqual(run_tests.trial_runs([], "1", 2, modules, session), [("main", ["tests"])])
        self.assertEqual(run_tests.trial_runs([], "4", 2, modules, []),
                         [("main", ["-j", "4", "tests.spark.test_x", "tests.test_a"])])

    def test_session_modules_found(self):
        """The modules that use the in-process Spark session are recognised by their import of it."""
        self.assertTrue(run_tests.uses_spark_session("tests.spark.test_validate", ROOT))
        self.assertTrue(run_tests.uses_spark_session("tests.integration.test_federation", ROOT))
        self.assertFalse(run_tests.uses_spark_session("tests.spark.test_pure", ROOT))
        self.assertFalse(run_tests.uses_spark_session("tests.test_run_tests", ROOT))

    def test_main_lane_exceptions(self):
        """The modules kept out of the spark lane use the session (else the exception would be stale) and are not
        in the spark lane; every other session module is."""
        modules = run_tests.test_modules(os.path.join(ROOT, "tests"))
        spark_lane = run_tests.spark_lane_modules(modules, ROOT)
        self.assertIn("tests.spark.test_cluster", run_tests.MAIN_LANE)
        for module in run_tests.MAIN_LANE:
            self.assertIn(module, modules)
            self.assertTrue(run_tests.uses_spark_session(module, ROOT), module)
            self.assertNotIn(module, spark_lane)
        self.assertIn("tests.spark.test_validate", spark_lane)
        self.assertIn("tests.integration.test_faults", spark_lane)

    def test_lanes_add_up(self):
        """The closing line adds the lanes' counts; one failing or summary-less lane fails the whole run."""
        passed, failed = _output("PASSED (successes=40, skips=1)"), _output("FAILED (failures=1, successes=2)")
        self.assertEqual(run_tests.summarize_runs([(passed, 0), (_output("PASSED (successes=3)"), 0)]),
                         (["43 passed, 0 failed, 1 skipped"], 0))
        self.assertEqual(run_tests.summarize_runs([(passed, 0), (failed, 1)]), (["42 passed, 1 failed, 1 skipped"], 1))
        self.assertEqual(run_tests.summarize_runs([(passed, 0), (["Traceback"], 1)]),
                         (["trial printed no summary (exit code 1)", "40 passed, 1 failed"], 1))
        self.assertEqual(run_tests.summarize_runs([(passed, 0), (_output("PASSED (successes=3)"), 1)])[1], 1)

    def test_lanes_directory_is_trials(self):
        """The lanes' parent directory replaces an old trial directory and can itself be taken over by trial."""
        from twisted.python.filepath import FilePath
        from twisted.trial.util import _removeSafely

        temp = self.mktemp()
        os.makedirs(os.path.join(temp, "0"))
        open(os.path.join(temp, "_trial_marker"), "w").close()
        run_tests.prepare_lanes_directory(temp)
        self.assertEqual(os.listdir(temp), ["_trial_marker"])
        os.makedirs(os.path.join(temp, "main"))
        _removeSafely(FilePath(temp))  # what trial does before it reuses a temporary directory
        self.assertFalse(os.path.exists(temp))


class SlowestReportTest(SynchronousTestCase):
    def test_modules_and_tests_ranked_by_wall_time(self) -> None:
        """The report sums each module's tests and lists the slowest first; bad lines are ignored."""
        path = self.mktemp()
        with open(path, "w", encoding="utf-8") as fh:
            fh.write("tests.a.test_x.T.test_one\t100.0\t103.0\t11\t6.0\n")
            fh.write("tests.a.test_x.T.test_two\t100.0\t102.0\t12\t1.5\n")
            fh.write("tests.b.U.test_three\t50.0\t54.5\t11\t2.0\n")
            fh.write("a line cut short\n")
        lines = run_tests.slowest_report(path)
        self.assertEqual(lines[0], "slowest modules (3 tests timed, 10 CPU-s in all; wall s, CPU s):")
        self.assertEqual(lines[1:3], ["      5.0     7.5  tests.a.test_x", "      4.5     2.0  tests.b"])
        self.assertEqual(lines[4:], ["      4.5     2.0  tests.b.U.test_three", "      3.0     6.0  tests.a.test_x.T.test_one",
                                     "      2.0     1.5  tests.a.test_x.T.test_two"])

    def test_unreadable_file_is_one_line(self) -> None:
        lines = run_tests.slowest_report(os.path.join(self.mktemp(), "missing.tsv"))
        self.assertEqual(len(lines), 1)
        self.assertIn("cannot read", lines[0])
