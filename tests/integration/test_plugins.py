"""Plugin packages, installed into a fresh virtualenv beside synflow, run beside the default deployment.

Two packages: the tutorial's ``synflow-greetings``, written from the code
blocks of docs/framework.md, and the example ``examples/receipts``. Both are
``pip install``-ed with synflow into a new virtualenv, started with
``synflowctl start workers/ --config <overlay>/`` beside the default
deployment, exercised over HTTP while their processes are SIGKILLed and
restarted, and their audit logs validated with the Spark validator.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from tests.cluster import poll_until
from tests.plugins import write_tutorial_package
from tests.services import require_java

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLIENT = "http://127.0.0.1:8008/_synflow/client/v1"
RECEIPTS = ("http://127.0.0.1:8010/_synflow/client/v1", "http://127.0.0.1:8011/_synflow/client/v1")
STATS = "http://127.0.0.1:8012/_synflow/client/v1"
GREETINGS = "http://127.0.0.1:8013/_synflow/client/v1/greetings"
PLUGIN_PROCESSES = ("greeter1", "receipts1", "receipts2", "room_stats1")


def _request(method: str, url: str, body: Any = None, token: str | None = None,
             timeout: float = 10) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as e:
        raw = e.read()
        return e.code, json.loads(raw) if raw.strip() else {}


def _ok(method: str, url: str, body: Any = None, token: str | None = None) -> Any:
    code, answer = _request(method, url, body, token)
    assert code == 200, (method, url, code, answer)
    return answer


class PluginPackagesTest(SynchronousTestCase):
    def setUp(self) -> None:
        require_java()
        saved = os.environ.pop("PYTHONPATH", None)  # the fresh virtualenv sees only what is installed in it
        if saved is not None:
            self.addCleanup(os.environ.__setitem__, "PYTHONPATH", saved)
        self.dir = os.path.abspath(self.mktemp())
        os.makedirs(self.dir)
        tutorial = os.path.join(self.dir, "synflow-greetings")
        self.tutorial_files = write_tutorial_package(tutorial)
        # Built from a copy: an in-tree build would leave build/ and .egg-info in the checkout.
        example = os.path.join(self.dir, "receipts")
        shutil.copytree(os.path.join(ROOT, "examples", "receipts"), example)
        self.venv = os.path.join(self.dir, "venv")
        subprocess.run([sys.executable, "-m", "venv", self.venv], check=True)
        result = subprocess.run([self.bin("pip"), "install", "--quiet", ROOT, tutorial, example],
                                capture_output=True, text=True, timeout=600)
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        shutil.copytree(os.path.join(ROOT, "workers"), os.path.join(self.dir, "workers"))
        self.overlays = ["--config", os.path.join(tutorial, "workers"),
                         "--config", os.path.join(example, "workers")]

    def bin(self, name: str) -> str:
        return os.path.join(self.venv, "bin", name)

    def ctl(self, command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.bin("synflowctl"), command, "workers", *self.overlays], capture_output=True,
                              text=True, cwd=self.dir, timeout=300)

    def kill(self, name: str) -> None:
        with open(os.path.join(self.dir, "var", "run", f"{name}.pid"), encoding="utf-8") as f:
            os.kill(int(f.read().strip()), signal.SIGKILL)

    def test_tutorial_and_example_packages_beside_the_default_deployment(self):
        """Both packages install, start healthy beside the five default processes, replicate their streams,
        lose nothing while their writers and consumer are SIGKILLed and restarted, and validate clean."""
        listing = subprocess.run([self.bin("twistd"), "synflow", "--help"], capture_output=True, text=True,
                                 cwd=self.dir, timeout=60).stdout
        for name in ("greeter", "receipt_writer", "room_stats", "greetings", "receipts"):
            self.assertRegex(listing, rf"(?m)^  {name}\s")
        started = self.ctl("start")
        self.addCleanup(self.ctl, "stop")
        self.assertEqual(started.returncode, 0, started.stdout + started.stderr)
        status = self.ctl("status")
        self.assertEqual(status.returncode, 0, status.stdout)
        for name in PLUGIN_PROCESSES:
            self.assertRegex(status.stdout, rf"(?m)^{name}\s+\S+\s+\d+\s+healthy", status.stdout)

        token = _ok("POST", f"{CLIENT}/register", {"username": "alice"})["access_token"]
        rooms = [_ok("POST", f"{CLIENT}/rooms", {}, token)["room_id"] for _ in range(6)]
        events = {room: [_ok("PUT", f"{CLIENT}/rooms/{room}/send/m.room.message/t{n}", {"body": "hi"}, token)["event_id"]
                         for n in range(3)] for room in rooms}
        _ok("GET", f"{CLIENT}/sync?timeout=0", None, token)  # a token chain for the validator
        outsider = _ok("POST", f"{CLIENT}/register", {"username": "mallory"})["access_token"]
        for url in (f"{RECEIPTS[0]}/rooms/{rooms[0]}/receipt/{events[rooms[0]][0]}",
                    f"{RECEIPTS[1]}/rooms/{rooms[1]}/receipt/{events[rooms[1]][0]}"):
            self.assertEqual(_request("PUT", url, {}, outsider)[0], 403)  # receipts only in one's own rooms
        self.assertEqual(_request("GET", f"{RECEIPTS[0]}/rooms/{rooms[0]}/receipts", None, outsider)[0], 403)

        # The tutorial's worker type: its row replicates to the other processes.
        stream_id = _ok("POST", GREETINGS, {"text": "hello"}, token)["stream_id"]
        code, refused = _request("POST", GREETINGS, {"text": "x" * 101}, token)
        self.assertEqual((code, refused.get("errcode")), (400, "M_BAD_JSON"))  # greetings.max_length from its section
        self.assertEqual(_request("POST", GREETINGS, {"text": "hello"})[0], 401)

        def master_positions() -> dict[str, Any]:
            with urllib.request.urlopen("http://127.0.0.1:9101/health", timeout=5) as response:
                return json.load(response)["positions"]

        poll_until(lambda: master_positions().get("greetings", {}).get("greeter1", 0) >= stream_id, 30,
                   "the master to see the greeting", interval=0.2)

        # The example: receipts while a writer and the consumer are SIGKILLed and restarted.
        acknowledged: list[tuple[str, str]] = []
        errors: list[str] = []
        retries = [0]
        halfway, killed = threading.Event(), threading.Event()

        def traffic() -> None:
            try:
                for i in range(60):
                    if i == 20:
                        halfway.set()
                        killed.wait(60)
                    room = rooms[i % len(rooms)]
                    event_id = events[room][i % 3]
                    url = f"{RECEIPTS[i % 2]}/rooms/{room}/receipt/{event_id}"
                    deadline = time.monotonic() + 120
                    while True:
                        try:
                            code, _ = _request("PUT", url, {}, token)
                        except OSError:
                            code = 0  # the writer addressed is down
                        if code == 200:
                            acknowledged.append((room, event_id))
                            break
                        retries[0] += 1
                        if time.monotonic() > deadline:
                            errors.append(f"receipt {i} never acknowledged (last {code})")
                            return
                        time.sleep(0.2)
            except Exception as e:  # reported by the main thread
                errors.append(repr(e))

        thread = threading.Thread(target=traffic)
        thread.start()
        self.assertTrue(halfway.wait(120), errors)
        self.kill("receipts2")
        self.kill("room_stats1")
        killed.set()
        time.sleep(3)  # sends to the dead writer fail and are retried; the rest go on
        restarted = self.ctl("start")  # starts the killed processes again
        self.assertEqual(restarted.returncode, 0, restarted.stdout + restarted.stderr)
        self.assertIn("receipts2              starting", restarted.stdout)
        self.assertIn("room_stats1            starting", restarted.stdout)
        thread.join(timeout=240)
        self.assertEqual(errors, [])
        self.assertEqual(len(acknowledged), 60)
        self.assertGreater(retries[0], 0)  # the outage was seen

        # Nothing lost: every acknowledged receipt is stored, and room_stats counts what is stored.
        for room in rooms:
            stored = _ok("GET", f"{RECEIPTS[0]}/rooms/{room}/receipts", None, token)["receipts"]
            stored_events = [r["event_id"] for r in stored]
            for acked_room, event_id in acknowledged:
                if acked_room == room:
                    self.assertIn(event_id, stored_events)
            self.assertGreaterEqual(len(stored), sum(1 for r, _ in acknowledged if r == room))
            expected = {"room_id": room, "messages": 3, "receipts": len(stored)}
            poll_until(lambda room=room, expected=expected: _request("GET", f"{STATS}/rooms/{room}/stats", None, token)
                       == (200, expected), 60, f"room_stats of {room} to reach {expected}", interval=0.2)

        stopped = self.ctl("stop")
        self.assertEqual(stopped.returncode, 0, stopped.stdout + stopped.stderr)
        audit = os.path.join(self.dir, "var", "audit")
        streams = set()
        for path in glob.glob(os.path.join(audit, "writer_logs", "*", "*.jsonl")):
            with open(path, encoding="utf-8") as f:
                streams.update(json.loads(line)["stream"] for line in f if line.strip())
        self.assertLessEqual({"greetings", "receipts"}, streams)

        from tests.spark._session import summary, validate

        out = os.path.join(self.dir, "validation")
        self.assertEqual(validate(audit, out), 0, json.dumps(summary(out).get("violations"), indent=1))
        self.assertGreaterEqual(summary(out)["inputs"]["writer_logs"]["streams"], 4)
