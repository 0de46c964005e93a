"""The validator archive submitted with spark-submit to a real Spark standalone cluster on loopback, from outside the checkout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

from twisted.trial.unittest import TestCase

from spark.generate import Config, generate, write_jsonl
from spark.inject import expected_keys
from tests import TEST_JVM_OPTIONS
from tests.cluster import free_port
from tests.services import require_java
from tests.spark._session import validate
from tests.spark.test_cli import _read_out, bare_python

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.join(ROOT, "scripts", "build_validator_zip")


def _spark_home() -> str:
    import pyspark

    return os.path.dirname(pyspark.__file__)


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _alive_workers(ui_port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/json/", timeout=5) as response:
            state = json.load(response)
    except (OSError, ValueError):
        # Not listening yet, or the web UI is up but answers an empty or partial page while the
        # master is still starting: not ready, ask again.
        return 0
    return sum(1 for w in state.get("workers", []) if w.get("state") == "ALIVE")


class StandaloneClusterTest(TestCase):
    timeout = 900

    def daemon(self, *args: str, log: str) -> subprocess.Popen:
        """Start a Spark daemon in its own process group, stopped (with its children) at cleanup."""
        env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", SPARK_HOME=_spark_home(), SPARK_DAEMON_MEMORY="512m")
        out = open(log, "w")
        self.addCleanup(out.close)
        proc = subprocess.Popen([os.path.join(_spark_home(), "bin", "spark-class"), *args], env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

        def stop() -> None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()

        self.addCleanup(stop)
        return proc

    def test_archive_on_standalone_cluster_matches_local(self):
        """spark-submit of the built archive to a master and two workers gives local mode's exit code, verdict and violations."""
        require_java()
        tmp = os.path.abspath(self.mktemp())
        os.makedirs(tmp)
        logs = os.path.join(tmp, "logs")
        corpus = generate(Config(facts=200, cache_facts=40, readers=4, tokens_per_reader=25, seed=3))
        write_jsonl(corpus, logs)

        local_out = os.path.join(tmp, "local")
        self.assertEqual(validate(logs, local_out), 1)
        local_summary, local_keys = _read_out(local_out)
        self.assertEqual(local_keys, expected_keys(corpus.injected))

        dist = os.path.join(tmp, "dist")
        build = subprocess.run([sys.executable, BUILD, "--out", dist], capture_output=True, text=True, timeout=60)
        self.assertEqual(build.returncode, 0, build.stderr)
        archive, driver = build.stdout.split()

        port, ui_port = free_port(), free_port()
        self.daemon("org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
                    "--webui-port", str(ui_port), log=os.path.join(tmp, "master.log"))
        for i in (1, 2):
            work = os.path.join(tmp, f"worker{i}")
            os.makedirs(work)
            self.daemon("org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1", "--cores", "1",
                        "--memory", "1g", "--webui-port", str(free_port()), "--work-dir", work,
                        f"spark://127.0.0.1:{port}", log=os.path.join(tmp, f"worker{i}.log"))
        _wait_for(lambda: _alive_workers(ui_port) == 2, 180, "two workers registered with the master")

        # Driver and executors run Python without site processing: the editable install of this
        # checkout is not on their path, so synflow_spark can only come from the archive.
        python = bare_python(tmp)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPARK_MASTER")}
        env.update(SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=python, PYSPARK_DRIVER_PYTHON=python)
        cluster_out = os.path.join(tmp, "cluster")
        submit = subprocess.run(
            [os.path.join(_spark_home(), "bin", "spark-submit"), "--master", f"spark://127.0.0.1:{port}",
             "--deploy-mode", "client", "--driver-memory", "1g", "--executor-memory", "512m",
             "--conf", f"spark.executor.extraJavaOptions={TEST_JVM_OPTIONS}",
             "--total-executor-cores", "2", "--py-files", archive, driver,
             "--logs", f"file://{logs}", "--out", f"file://{cluster_out}", "--shuffle-partitions", "4"],
            cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
        self.assertEqual(submit.returncode, 1, (submit.stdout + submit.stderr)[-4000:])
        summary, keys = _read_out(cluster_out)
        self.assertEqual(summary["spark"]["master"], f"spark://127.0.0.1:{port}")
        self.assertEqual(keys, local_keys)
        self.assertEqual(summary["exit_code"], local_summary["exit_code"])
        self.assertEqual(summary["violations"], local_summary["violations"])

