"""The main job: its report's verdict and exit status follow what was lost and what the validator found; its two deployments federate through their federation listeners."""

from __future__ import annotations

import argparse
import json
import os
import sys

import attrs
from twisted.trial.unittest import SynchronousTestCase

from scripts import demo
from synflow.tools.workload import Report, percentiles

CLEAN = {"checks": {"skipped_gap": {"count": 0, "severity": "error"}, "duplicate_stream_id": {"count": 0}}}
DIRTY = {"checks": {"skipped_gap": {"count": 2, "severity": "error"}, "duplicate_stream_id": {"count": 1}}}


def _report(**changes: object) -> Report:
    latencies = [float(i) for i in range(1, 101)]
    report = Report(users=10, rooms=12, sent=300, send_errors=0, lost=0, duplicated=0, order_mismatches=0, foreign=0,
                    sync_requests=900, federated_expected=120, federated_delivered=120, send_seconds=2.0,
                    events_per_s=150.0, send_latency_ms=percentiles(latencies), visible_latency_ms=percentiles(latencies),
                    latencies_ms=latencies)
    return attrs.evolve(report, **changes)


class WriteReportTest(SynchronousTestCase):
    def write(self, report: Report, verdicts: dict) -> tuple[int, str, dict]:
        out = os.path.abspath(self.mktemp())
        os.makedirs(out)
        args = argparse.Namespace(concurrency=24)
        self.patch(sys, "stdout", open(os.devnull, "w"))  # the report is also printed
        self.addCleanup(sys.stdout.close)
        code = demo.write_report(out, args, report, 3.5, 0.42, 42, 58, verdicts)
        with open(os.path.join(out, "report.md"), encoding="utf-8") as f:
            text = f.read()
        with open(os.path.join(out, "report.json"), encoding="utf-8") as f:
            data = json.load(f)
        return code, text, data

    def test_clean_run(self) -> None:
        """Nothing lost and clean validators: exit 0, verdict OK, with every figure the report promises."""
        code, text, data = self.write(_report(), {"localhost": (0, CLEAN), "peer.localhost": (0, CLEAN)})
        self.assertEqual(code, 0)
        self.assertTrue(data["ok"])
        self.assertIn("**Verdict: OK - nothing lost, no anomalies**", text)
        self.assertIn("| 150 events/s |", text)
        self.assertIn("| mean send latency the throughput allows (24 clients ÷ events/s) | 160.0 ms |", text)
        self.assertIn("send -> visible in sync p50 / p95 / p99 | 50.5 / 95.0 / 99.0 ms |", text)
        self.assertIn("| federation delivered / expected | 120 / 120 |", text)
        self.assertIn("| cache hit rate (localhost) | 42.0% (42 hits, 58 misses) |", text)
        self.assertIn("| token validator (localhost) | clean; violations: 0 |", text)

    def test_lost_event_fails(self) -> None:
        """One lost event: exit 1 and verdict FAILED, even with clean validators."""
        code, text, data = self.write(_report(lost=1), {"localhost": (0, CLEAN), "peer.localhost": (0, CLEAN)})
        self.assertEqual(code, 1)
        self.assertFalse(data["ok"])
        self.assertIn("**Verdict: FAILED**", text)
        self.assertNotIn("OK - nothing lost", text)
        self.assertIn("| lost / duplicated / out of order / foreign | 1 / 0 / 0 / 0 |", text)

    def test_validator_anomaly_fails(self) -> None:
        """A validator exit code 1: exit 1 and verdict FAILED, naming the server and the violations."""
        code, text, data = self.write(_report(), {"localhost": (0, CLEAN), "peer.localhost": (1, DIRTY)})
        self.assertEqual(code, 1)
        self.assertFalse(data["ok"])
        self.assertEqual(data["validator"], {"localhost": 0, "peer.localhost": 1})
        self.assertIn("**Verdict: FAILED**", text)
        self.assertIn("| token validator (peer.localhost) | FAILED (exit 1); violations: 3 |", text)

    def test_validators_not_run(self) -> None:
        """No validator verdicts (--keep-running): the report says they were not run; the rest decides the verdict."""
        code, text, data = self.write(_report(), {})
        self.assertEqual(code, 0)
        self.assertEqual(data["validator"], {})
        self.assertIn("| token validators | not run: the deployments were left running (`--keep-running`) |", text)
        self.assertNotIn("| token validator (", text)

    def test_federation_shortfall_fails(self) -> None:
        """Fewer federated deliveries than expected: exit 1 and verdict FAILED."""
        code, text, _ = self.write(_report(federated_delivered=119), {"localhost": (0, CLEAN)})
        self.assertEqual(code, 1)
        self.assertIn("**Verdict: FAILED**", text)


class DeploymentsTest(SynchronousTestCase):
    def test_peers_send_to_each_others_federation_listener(self) -> None:
        """The demo's two servers send federation traffic to each other's federation listener (8448, and 18448 for the peer at +10000), clients use 8008 and 18008."""
        from synflow.config import load_config
        from synflow.listeners import serving
        from synflow.tools.deploy import DEFAULT_PORTS

        out = os.path.abspath(self.mktemp())
        home_dir, peer_dir = os.path.join(out, "localhost"), os.path.join(out, demo.PEER)
        home_ports = {p: p for p in DEFAULT_PORTS}
        peer_ports = {p: p + demo.PEER_PORT_OFFSET for p in DEFAULT_PORTS}
        servers = demo.make_deployments(home_dir, peer_dir, home_ports, peer_ports)
        self.assertEqual(servers, {"localhost": ["http://127.0.0.1:8008"], demo.PEER: ["http://127.0.0.1:18008"]})

        def master(directory: str):
            return load_config([os.path.join(directory, "shared.yaml"), os.path.join(directory, "master.yaml")])

        home, peer = master(home_dir), master(peer_dir)
        for config, port in ((home, 8448), (peer, 18448)):
            listener = serving(config, "federation")
            self.assertEqual(listener.endpoint, f"tcp:{port}:interface=127.0.0.1")
            self.assertEqual(listener.resources, ("federation",))
        self.assertEqual(serving(home, "client").resources, ("client",))
        self.assertEqual(home.federation.destinations, {demo.PEER: "http://127.0.0.1:18448"})
        self.assertEqual(peer.federation.destinations, {"localhost": "http://127.0.0.1:8448"})


class QuantileTest(SynchronousTestCase):
    def test_percentiles_interpolate(self) -> None:
        """percentiles() are statistics.quantiles' inclusive cut points, with the maximum; empty and single inputs are defined."""
        self.assertEqual(percentiles([float(i) for i in range(1, 11)]), {"p50": 5.5, "p95": 9.55, "p99": 9.91, "max": 10.0})
        self.assertEqual(percentiles([7.0]), {"p50": 7.0, "p95": 7.0, "p99": 7.0, "max": 7.0})
        self.assertEqual(percentiles([]), {"p50": 0.0, "p95": 0.0, "p99": 0.0, "max": 0.0})


class FreePortTest(SynchronousTestCase):
    def test_never_hands_out_a_port_twice(self):
        """free_port never returns a port it returned before in this process, though the kernel may offer one again."""
        from synflow.tools.deploy import free_port

        ports = [free_port() for _ in range(300)]
        self.assertEqual(len(set(ports)), len(ports))

    def test_ports_below_the_ephemeral_range(self):
        """Below the kernel's ephemeral range, free_port picks from FREE_PORT_RANGE: ports no outgoing
        connection can take between the probe and the bind; a port someone listens on is skipped."""
        import socket

        from synflow.tools import deploy

        low, high = deploy.FREE_PORT_RANGE
        ephemeral = deploy._ephemeral_low()
        if ephemeral is None or ephemeral < high:
            self.fail(f"this machine's ephemeral range starts at {ephemeral}, below {high}")
        # Two neighbouring ports of the range, the first taken here: other test processes use the range too.
        busy = socket.socket()
        self.addCleanup(busy.close)
        for port in range(high - 2, low, -2):
            try:
                busy.bind(("127.0.0.1", port))
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port + 1))
            except OSError:
                busy.close()
                busy = socket.socket()
                continue
            break
        else:
            self.fail(f"no two neighbouring free ports in {deploy.FREE_PORT_RANGE}")
        busy.listen()
        taken = busy.getsockname()[1]
        # Another process's mark on a port is tested in tests/test_free_port.py; here every port is unmarked.
        self.patch(deploy, "_reserve", lambda port: True)
        self.patch(deploy, "FREE_PORT_RANGE", (taken, taken + 2))
        self.patch(deploy, "_HANDED_OUT", set())
        self.assertEqual(deploy.free_port(), taken + 1)  # the first is taken
        # The range is used up: the kernel's ephemeral ports are the fallback.
        self.assertGreaterEqual(deploy.free_port(), ephemeral)
