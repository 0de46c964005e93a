"""The job as a command: ``python -m spark.validate_tokens``, a plain script, and end to end under spark-submit.

Every test here starts its own Spark, as an operator would; none uses the shared in-process
session, so the module runs in the suite's main lane.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig

from twisted.trial.unittest import SkipTest, SynchronousTestCase, TestCase

from spark.checks import violation_key
from spark.generate import Config, generate, write_jsonl
from spark.inject import expected_keys
from spark.session import DEFAULT_LOCAL_SHUFFLE_PARTITIONS
from tests.services import require_java

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class CommandLineTests(TestCase):
    """The module and the script run with their own Spark, as an operator would run them."""

    def test_module_runs(self):
        """`python -m spark.validate_tokens` runs the job's command line (its options, before any Spark starts)."""
        proc = subprocess.run([sys.executable, "-m", "spark.validate_tokens", "--help"],
                              cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                              timeout=120)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertIn("--fail-on", proc.stdout)

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


def bare_python(directory: str) -> str:
    """A ``python`` for Spark's Python processes that sees the virtualenv's packages but skips site processing.

    Without ``.pth`` files the editable install of this checkout is not on ``sys.path``, as it would
    not be on a cluster: the code under test must come from the script's own path handling or
    from ``--py-files``.
    """
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "bare-python")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(f'#!/bin/sh\nPYTHONPATH={sysconfig.get_paths()["purelib"]}"${{PYTHONPATH:+:$PYTHONPATH}}" '
                 f'exec {sys.executable} -S "$@"\n')
    os.chmod(path, 0o755)
    return path


def _spark_submit(logs: str, out: str, tmp: str) -> subprocess.CompletedProcess:
    """Run the venv's ``spark-submit --master local[1] spark/validate_tokens.py`` from ``/``.

    No ``PYTHONPATH`` and no job option but ``--logs``/``--out``: the script must find its own
    package, and the job must take spark-submit's master and its local defaults. The driver
    Python sees the virtualenv's packages but not its ``.pth`` entries (``python -S`` with
    site-packages on its path), so the editable install cannot put the checkout on ``sys.path``
    as it would not be on a cluster: the script's own path handling has to.
    """
    require_java()
    submit = os.path.join(os.path.dirname(sys.executable), "spark-submit")
    if not os.path.exists(submit):
        if os.environ.get("CI"):
            raise AssertionError(f"{submit} is missing")
        raise SkipTest(f"{submit} is missing")
    driver = bare_python(tmp)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPARK_MASTER")}
    env.update(SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=driver)
    return subprocess.run(
        [submit, "--master", "local[1]", "--driver-memory", "1g",
         os.path.join(ROOT, "spark", "validate_tokens.py"), "--logs", logs, "--out", out],
        cwd="/", env=env, capture_output=True, text=True, timeout=900)


def _read_out(out: str) -> tuple[dict, set]:
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as fh:
        summary = json.load(fh)
    keys = set()
    vdir = os.path.join(out, "violations")
    for name in os.listdir(vdir) if os.path.isdir(vdir) else []:
        if name.endswith(".json"):
            with open(os.path.join(vdir, name), encoding="utf-8") as fh:
                keys |= {violation_key(r["check"], r) for r in map(json.loads, fh)}
    return summary, keys


class SparkSubmitTests(TestCase):
    """The unchanged script under the virtualenv's own `spark-submit`, as on a cluster."""

    def test_injected_logs_exit_one(self):
        """spark-submit --master local[1] on a corpus with every anomaly injected exits 1, reporting exactly the injections.

        The summary records spark-submit's master and the job's local shuffle default. (Exit 0 on
        clean logs is shown in the shared session by ``test_validate``, and from a process of its
        own by the main job's test, whose validator starts its own Spark.)
        """
        logs, out = os.path.abspath(self.mktemp()), os.path.abspath(self.mktemp())
        corpus = generate(Config(facts=200, cache_facts=40, readers=4, tokens_per_reader=25, seed=3))
        write_jsonl(corpus, logs)
        proc = _spark_submit(logs, out, os.path.abspath(self.mktemp()))
        self.assertEqual(proc.returncode, 1, (proc.stdout + proc.stderr)[-3000:])
        summary, keys = _read_out(out)
        self.assertEqual(summary["spark"]["master"], "local[1]")
        # spark-submit's local master gets the job's local shuffle default, not Spark's 200.
        self.assertEqual(summary["spark"]["shuffle_partitions"], str(DEFAULT_LOCAL_SHUFFLE_PARTITIONS))
        self.assertIn("stage load", proc.stdout + proc.stderr)  # the progress lines, relayed by spark-submit
        self.assertEqual(summary["exit_code"], 1)
        self.assertEqual(keys, expected_keys(corpus.injected))


class MasterChoiceTests(SynchronousTestCase):
    """Which master a new session gets (a pure function, no Spark)."""

    def test_collector_chosen_in_options(self):
        """A collector named in the JVM options is kept: the session adds its own only without one."""
        from spark.session import chooses_collector

        self.assertTrue(chooses_collector("-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"))
        self.assertTrue(chooses_collector("-XX:+UseG1GC"))
        self.assertFalse(chooses_collector("-XX:TieredStopAtLevel=1 -Xmx2g"))
        self.assertFalse(chooses_collector(""))

    def test_local_star_by_default(self):
        """Without --master, spark-submit or SPARK_MASTER, the job runs in local[*]."""
        from spark.session import choose_master

        self.assertEqual(choose_master(None, False, {}), "local[*]")
        self.assertEqual(choose_master("", False, {"SPARK_MASTER": ""}), "local[*]")

    def test_overrides(self):
        """--master wins; under spark-submit its master is kept; else SPARK_MASTER is used."""
        from spark.session import choose_master

        self.assertEqual(choose_master("local[2]", True, {"SPARK_MASTER": "yarn"}), "local[2]")
        self.assertIsNone(choose_master(None, True, {"SPARK_MASTER": "yarn"}))
        self.assertEqual(choose_master(None, False, {"SPARK_MASTER": "spark://h:7077"}), "spark://h:7077")
