"""The validator on the audit logs of a real synflow run: clean, and a planted gap_skip is found exactly."""

from __future__ import annotations

import glob
import json
import os
import shutil

from twisted.internet.defer import ensureDeferred, inlineCallbacks
from twisted.trial.unittest import TestCase

from synflow.tokens import StreamToken
from synflow.tools.workload import Workload
from tests import services
from tests.cluster import Cluster, free_port, sleep
from tests.spark._session import validate, violations


def _read(pattern: str) -> list[dict]:
    out = []
    for path in sorted(glob.glob(pattern)):
        with open(path) as f:
            out += [json.loads(line) for line in f if line.strip()]
    return out


def plant_gap_skip(audit: str) -> tuple[str, int]:
    """Move one fact's completion after the one token that covers it first.

    Picks a fact that exactly one token covers before the moved time and no
    token delivers before it, so the only consequence is one gap_skip.
    Returns the fact's (writer, stream_id).
    """
    ids = {r["instance_id"]: r["instance_name"] for r in _read(f"{audit}/instance_map/*.jsonl")}
    names = {v: k for k, v in ids.items()}
    facts = [r for r in _read(f"{audit}/writer_logs/*/*.jsonl")
             if r.get("kind") is None and r["stream"] == "events" and r["outcome"] == "ok"]
    tokens = sorted(_read(f"{audit}/token_logs/*/*.jsonl"), key=lambda t: t["issued_at"])
    parsed = [(t, StreamToken.parse(t["token"])) for t in tokens]
    delivered_at: dict[str, int] = {}
    for t in tokens:
        for e in t["delivered"]:
            delivered_at.setdefault(e, t["issued_at"])
    for fact in sorted(facts, key=lambda f: -f["stream_id"]):
        iid = names[fact["writer"]]
        covering = [t for t, tok in parsed if tok.get(iid) >= fact["stream_id"] and t["issued_at"] >= fact["completed_at"]]
        if len(covering) < 2:
            continue
        first, second = covering[0], covering[1]
        moved = first["issued_at"] + 1
        if second["issued_at"] <= moved + 1 or fact["event_id"] in first["delivered"]:
            continue
        if delivered_at.get(fact["event_id"], moved + 2) <= moved:
            continue
        # Rewrite the fact's record in its writer log.
        for path in glob.glob(f"{audit}/writer_logs/{fact['writer']}/*.jsonl"):
            with open(path) as f:
                lines = f.readlines()
            changed = False
            for i, line in enumerate(lines):
                rec = json.loads(line)
                if rec.get("kind") is None and rec.get("stream_id") == fact["stream_id"] and rec["stream"] == "events":
                    rec["completed_at"] = moved
                    lines[i] = json.dumps(rec) + "\n"
                    changed = True
            if changed:
                with open(path, "w") as f:
                    f.writelines(lines)
                return fact["writer"], fact["stream_id"]
    raise AssertionError("no fact suitable for planting a lone gap_skip")


class RealLogsTest(TestCase):
    timeout = 900

    @inlineCallbacks
    def setUp(self):
        services.require_java()
        cluster = Cluster(self, engine="sqlite", writers=("persister1", "persister2"))
        port = free_port()
        yield cluster.start_master(listeners=[{"resources": ["client"], "endpoint": f"tcp:{port}:interface=127.0.0.1"}])
        for name in ("persister1", "persister2"):
            cluster.start_twistd(name, "event_persister")
            yield cluster.wait_for_port(cluster.instance_ports[name], name)
        workload = Workload([f"http://127.0.0.1:{port}"], users=8, rooms=12, members_per_room=3, messages=200,
                            concurrency=8, seed=4, sync_timeout_ms=500)
        yield ensureDeferred(workload.setup())
        chains = ensureDeferred(workload.sync_chains())
        yield ensureDeferred(workload.send_messages())
        workload.stop_syncing()
        yield chains
        yield ensureDeferred(workload.drain())
        yield ensureDeferred(workload.close())
        self.assertTrue(workload.verify().ok)
        for name in ("persister1", "persister2", "master"):
            yield cluster.stop(name)  # flushes the audit logs
        yield sleep(0.1)
        self.audit = cluster.shared["audit"]["dir"]

    def test_clean_then_planted_gap_skip(self):
        """A real run's logs validate clean; with one completion moved past a covering token, exactly that gap_skip is reported."""
        out = os.path.abspath(self.mktemp())
        self.assertEqual(validate(self.audit, out), 0)
        self.assertEqual(violations(out), [])
        tampered = os.path.abspath(self.mktemp())
        shutil.copytree(self.audit, tampered)
        writer, sid = plant_gap_skip(tampered)
        out2 = os.path.abspath(self.mktemp())
        self.assertEqual(validate(tampered, out2), 1)
        found = violations(out2)
        self.assertEqual([(v["check"], v["writer"], v["stream_id"]) for v in found], [("gap_skip", writer, sid)], found)
