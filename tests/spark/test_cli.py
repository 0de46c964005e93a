"""The job as a command: ``python -m spark.validate_tokens`` end to end and as a plain script."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from twisted.trial.unittest import TestCase

from spark.generate import Config, generate, write_jsonl
from tests.services import require_java

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class CommandLineTests(TestCase):
    """The module and the script run with their own Spark, as an operator would run them."""

    def test_module_end_to_end_on_clean_logs(self):
        """`python -m spark.validate_tokens` in a subprocess exits 0 on clean logs, counting pending facts.

        The clean logs have no `seq` column, so each reader's tokens are ordered by `issued_at`;
        they include idle-writer leaps, aborted gaps, room hand-overs and facts in flight.
        """
        require_java()
        logs, out = os.path.abspath(self.mktemp()), os.path.abspath(self.mktemp())
        write_jsonl(generate(Config(facts=500, cache_facts=60, readers=3, tokens_per_reader=40,
                                    with_seq=False, inject=False, seed=5)), logs)
        env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYTHONPATH=ROOT)
        proc = subprocess.run(
            [sys.executable, "-m", "spark.validate_tokens", "--logs", logs, "--out", out,
             "--master", "local[2]", "--shuffle-partitions", "2", "--driver-memory", "1g"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        self.assertIn("stage load", proc.stderr)
        self.assertIn("done: exit 0, 0 violation(s)", proc.stderr)
        with open(os.path.join(out, "summary.json"), encoding="utf-8") as fh:
            summary = json.load(fh)
        self.assertEqual(summary["inputs"]["token_logs"]["seq"], "derived")
        self.assertGreater(summary["pending"]["in_flight_facts"], 0)
        self.assertGreater(summary["pending"]["above_reader_watermark"], 0)
        with open(os.path.join(out, "report.md"), encoding="utf-8") as fh:
            self.assertIn("PASSED", fh.read())

    def test_script_imports_itself(self):
        """`spark/validate_tokens.py` run as a plain script (as spark-submit does) finds its package."""
        require_java()
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "spark", "validate_tokens.py"), "--help"],
                              cwd="/", capture_output=True, text=True, timeout=120)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertIn("--fail-on", proc.stdout)

    def test_generator_cli(self):
        """`python -m spark.generate` writes the three tables and the injection record."""
        out = os.path.abspath(self.mktemp())
        proc = subprocess.run([sys.executable, "-m", "spark.generate", "--out", out, "--facts", "300",
                               "--readers", "2", "--tokens-per-reader", "40"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        for table in ("writer_logs", "token_logs", "instance_map"):
            self.assertTrue(os.listdir(os.path.join(out, "jsonl", table)))
        with open(os.path.join(out, "injected.json"), encoding="utf-8") as fh:
            self.assertTrue(json.load(fh)["injected"])


class SessionSettingsTests(TestCase):
    def test_session_broadcasts_only_hinted_joins(self):
        """The job's session never broadcasts a join on a size estimate (at 10M rows that exhausted the driver)."""
        from spark.session import get_session
        from tests.spark._session import spark

        session = get_session(shuffle_partitions=2) if spark() else None
        assert session is not None
        self.assertEqual(session.conf.get("spark.sql.autoBroadcastJoinThreshold"), "-1")
        self.assertEqual(session.conf.get("spark.sql.adaptive.autoBroadcastJoinThreshold"), "-1")
        self.assertEqual(session.conf.get("spark.sql.session.timeZone"), "UTC")
