"""End-to-end runs of the Spark job on generated logs: recall and precision for every check.

One corpus with every anomaly injected is generated once and validated once per format (JSON
Lines and Parquet); the tests then inspect those two runs. Clean logs are validated end to end
by ``test_cli``.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from collections import defaultdict

from twisted.trial.unittest import TestCase

from spark.checks import BY_NAME, CHECK_NAMES, violation_key
from spark.generate import Config, generate, write_jsonl
from spark.inject import expected_keys
from tests.spark._session import spark, summary, validate, violations

_ROOT = tempfile.mkdtemp(prefix="synflow-spark-tests-")
atexit.register(shutil.rmtree, _ROOT, True)
CORPUS = Config(facts=1000, cache_facts=100, readers=4, tokens_per_reader=50, seed=7)


@functools.cache
def _corpus():
    corpus = generate(CORPUS)
    base = os.path.join(_ROOT, "injected")
    write_jsonl(corpus, os.path.join(base, "jsonl"))
    return corpus, base


@functools.cache
def _run(fmt: str):
    corpus, base = _corpus()
    logs = os.path.join(base, fmt)
    if fmt == "parquet":
        from spark.inputs import convert_to_parquet

        convert_to_parquet(spark(), os.path.join(base, "jsonl"), logs)
    out = os.path.join(base, f"out-{fmt}")
    code = validate(logs, out)
    return corpus, code, violations(out), summary(out), out


class InjectedCorpusTests(TestCase):
    """Every injected anomaly is reported, and nothing else, in both input formats."""

    def setUp(self):
        spark()

    def _by_check(self, keys):
        out = defaultdict(set)
        for k in keys:
            out[k[0]].add(k)
        return out

    def _assert_exact(self, fmt):
        corpus, code, rows, _, _ = _run(fmt)
        expected = self._by_check(expected_keys(corpus.injected))
        got = self._by_check(violation_key(r["check"], r) for r in rows)
        for check in CHECK_NAMES:
            self.assertTrue(expected[check], f"no {check} injected")
            missing, extra = expected[check] - got[check], got[check] - expected[check]
            self.assertEqual((missing, extra), (set(), set()), f"{fmt} {check}: recall/precision")
        self.assertEqual(code, 1)

    def test_jsonl_recall_and_precision(self):
        """On JSON Lines, each check reports exactly its injected violations (recall and precision 1.0)."""
        self._assert_exact("jsonl")

    def test_parquet_recall_and_precision(self):
        """On Parquet (with a stream= partition level), each check reports exactly its injected violations."""
        self._assert_exact("parquet")

    def test_rows_are_complete_and_explained(self):
        """Every violation row has the output columns, its severity and an explanation naming the witness."""
        _, _, rows, _, _ = _run("jsonl")
        for r in rows:
            self.assertEqual(r["severity"], BY_NAME[r["check"]].severity.value)
            self.assertGreater(len(r.get("explanation", "")), 40)
            for col in BY_NAME[r["check"]].key:
                self.assertIsNotNone(r.get(col), f"{r['check']}: {col} missing")
        gap = [r for r in rows if r["check"] == "gap_skip"][0]
        self.assertIn(gap["token"], gap["explanation"])
        self.assertIn(gap["writer"], gap["explanation"])

    def test_summary_and_report(self):
        """summary.json has input counts, per-check counts, pending counts and timings; report.md lists examples."""
        corpus, _, rows, s, out = _run("jsonl")
        self.assertEqual(set(s["checks"]), set(CHECK_NAMES))
        self.assertEqual(sum(c["count"] for c in s["checks"].values()), len(rows))
        self.assertEqual(s["inputs"]["token_logs"]["rows"], sum(len(c) for c in corpus.chains.values()))
        self.assertGreater(s["pending"]["in_flight_facts"], 0)
        self.assertIn("total", s["timings"])
        self.assertEqual(s["exit_code"], 1)
        with open(os.path.join(out, "report.md"), encoding="utf-8") as fh:
            report = fh.read()
        self.assertIn("FAILED", report)
        for check in CHECK_NAMES:
            self.assertIn(f"## {check} (", report)
