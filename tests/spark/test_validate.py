"""End-to-end runs of the Spark job on generated logs: recall and precision for every check.

One corpus with every anomaly injected is generated once and validated once per input format:
JSON Lines (writing JSONL violations) and Parquet (writing Parquet violations with
``--output-format parquet``); the tests then inspect those two runs. A clean corpus without
``seq`` is validated as Parquet here; ``test_cli`` runs the job under spark-submit.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from collections import defaultdict

from twisted.trial.unittest import TestCase

from spark.checks import BY_NAME, CHECK_NAMES, OUTPUT_COLUMNS, violation_key
from spark.generate import Config, generate, write_jsonl
from spark.inject import expected_keys
from tests.spark._session import parquet_violations, spark, summary, validate, violations

_ROOT = tempfile.mkdtemp(prefix="synflow-spark-tests-")
atexit.register(shutil.rmtree, _ROOT, True)
CORPUS = Config(facts=1000, cache_facts=100, readers=4, tokens_per_reader=50, seed=7)

#: The check names and severities as the issue spells them (not taken from spark.checks).
ISSUE_CHECKS = {
    "malformed_token": "error", "noncanonical_component": "warning", "broken_chain": "warning",
    "duplicate_stream_id": "error", "duplicate_event_id": "error", "invalid_interval": "error",
    "writer_sid_regression": "error", "sharding_violation": "error",
    "unresolved_reservation": "warning", "gap_skip": "error", "future_position": "error",
    "non_monotonic": "error", "phantom_delivery": "error", "aborted_delivery": "error",
    "premature_delivery": "error", "duplicate_delivery": "error", "delivered_beyond_token": "error",
    "undelivered": "error",
}
#: The columns the issue requires in every violation row.
ISSUE_COLUMNS = ("check", "severity", "stream", "reader", "seq", "token", "writer", "stream_id",
                 "event_id", "room_id", "explanation")


@functools.cache
def _corpus():
    corpus = generate(CORPUS)
    base = os.path.join(_ROOT, "injected")
    write_jsonl(corpus, os.path.join(base, "jsonl"))
    return corpus, base


@functools.cache
def _run(fmt: str):
    """Validate the injected corpus in ``fmt``; Parquet input also writes Parquet violations."""
    corpus, base = _corpus()
    logs = os.path.join(base, fmt)
    out = os.path.join(base, f"out-{fmt}")
    if fmt == "parquet":
        from spark.inputs import convert_to_parquet

        convert_to_parquet(spark(), os.path.join(base, "jsonl"), logs)
        code = validate(logs, out, "--output-format", "parquet")
        rows, _ = parquet_violations(out)
    else:
        code = validate(logs, out)
        rows = violations(out)
    return corpus, code, rows, summary(out), out


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
        # The output spells every check and severity as the issue does.
        self.assertEqual({r["check"]: r["severity"] for r in rows}, ISSUE_CHECKS)

    def test_jsonl_recall_and_precision(self):
        """On JSON Lines, each check reports exactly its injected violations (recall and precision 1.0)."""
        self._assert_exact("jsonl")

    def test_parquet_recall_and_precision(self):
        """On Parquet (with a stream= partition level), each check reports exactly its injected violations."""
        self._assert_exact("parquet")

    def test_rows_are_complete_and_explained(self):
        """Every JSONL violation row carries every output column (nulls written), its severity and an explanation."""
        _, _, rows, _, _ = _run("jsonl")
        for r in rows:
            self.assertEqual(list(r), list(OUTPUT_COLUMNS), r["check"])
            self.assertEqual([c for c in ISSUE_COLUMNS if c not in r], [])
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

    def test_parquet_output(self):
        """`--output-format parquet` writes Parquet violation files with every output column and its type."""
        from spark.common import OUTPUT_TYPES

        _, _, rows, _, out = _run("parquet")
        files = [f for f in os.listdir(os.path.join(out, "violations")) if not f.startswith((".", "_"))]
        self.assertTrue(files)
        self.assertTrue(all(f.endswith(".parquet") for f in files), files)
        _, schema = parquet_violations(out)
        self.assertEqual([(f.name, f.dataType) for f in schema.fields],
                         [(c, OUTPUT_TYPES[c]) for c in OUTPUT_COLUMNS])
        jsonl = _run("jsonl")[2]
        self.assertEqual(sorted(violation_key(r["check"], r) for r in rows),
                         sorted(violation_key(r["check"], r) for r in jsonl))


    def test_stages_one_at_a_time_give_the_same_output(self):
        """`--parallel-stages 1` reports exactly the violations and counts of the default concurrent run."""
        corpus, _, rows, s, _ = _run("jsonl")
        out = os.path.join(_ROOT, "out-sequential")
        code = validate(os.path.join(_ROOT, "injected", "jsonl"), out, "--parallel-stages", "1")
        self.assertEqual(code, 1)
        self.assertEqual(sorted(violation_key(r["check"], r) for r in violations(out)),
                         sorted(violation_key(r["check"], r) for r in rows))
        one = summary(out)
        self.assertEqual({c: r["count"] for c, r in one["checks"].items()},
                         {c: r["count"] for c, r in s["checks"].items()})
        self.assertEqual(one["pending"], s["pending"])
        self.assertIn("events_table", s["timings"])

    def test_triage_changes_no_result(self):
        """The per-event table built for every event id (no triage) gives exactly the rows of the triaged run.

        The triaged run examines only the suspect event ids (far fewer than the facts); with the
        triage off (as with more readers than it handles) every event id gets a row, and every
        violation row, explanation included, and every count is the same.
        """
        from spark import checks_delivery

        corpus, _, rows, s, _ = _run("jsonl")
        self.assertTrue(s["events_table"]["triage"])
        examined = s["events_table"]["suspect_event_ids"]
        self.assertGreater(examined, 0)
        self.assertLess(examined, len(corpus.facts) // 10)
        self.patch(checks_delivery, "TRIAGE_MAX_READERS", 0)
        out = os.path.join(_ROOT, "out-no-triage")
        self.assertEqual(validate(os.path.join(_ROOT, "injected", "jsonl"), out), 1)
        full = summary(out)
        self.assertEqual(full["events_table"], {"triage": False, "suspect_event_ids": None})

        def key(r):
            return tuple(str(r.get(c)) for c in OUTPUT_COLUMNS)
        self.assertEqual(sorted(map(key, violations(out))), sorted(map(key, rows)))
        self.assertEqual({c: r["count"] for c, r in full["checks"].items()},
                         {c: r["count"] for c, r in s["checks"].items()})
        self.assertEqual(full["pending"], s["pending"])


class CleanParquetTests(TestCase):
    """Clean logs in Parquet, without a ``seq`` column, validate clean."""

    def test_clean_parquet_exits_zero(self):
        """A clean generated corpus without ``seq``, converted to Parquet, exits 0 with zero violations and counts pending facts.

        Without ``seq`` each reader's tokens are ordered by ``issued_at``; the corpus includes
        idle-writer leaps, aborted gaps, room hand-overs and facts in flight.
        """
        from spark.inputs import convert_to_parquet

        base = os.path.join(_ROOT, "clean")
        write_jsonl(generate(Config(facts=600, cache_facts=60, readers=3, tokens_per_reader=40,
                                    with_seq=False, inject=False, seed=9)), os.path.join(base, "jsonl"))
        convert_to_parquet(spark(), os.path.join(base, "jsonl"), os.path.join(base, "parquet"))
        out = os.path.join(base, "out")
        code = validate(os.path.join(base, "parquet"), out, "--fail-on", "warning")
        s = summary(out)
        self.assertEqual(code, 0, s.get("error"))
        self.assertEqual(s["inputs"]["writer_logs"]["format"], "parquet")
        self.assertEqual(s["inputs"]["token_logs"]["format"], "parquet")
        self.assertEqual(s["violations"]["total"], 0)
        self.assertEqual({c: r["count"] for c, r in s["checks"].items()}, dict.fromkeys(CHECK_NAMES, 0))
        self.assertEqual(violations(out), [])
        self.assertEqual(s["inputs"]["token_logs"]["seq"], "derived")
        self.assertGreater(s["pending"]["in_flight_facts"], 0)
        self.assertGreater(s["pending"]["above_reader_watermark"], 0)
        with open(os.path.join(out, "report.md"), encoding="utf-8") as fh:
            self.assertIn("PASSED", fh.read())
