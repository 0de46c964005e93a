"""A full audit disk under real processes: sends and syncs go on, and the log reports its gap.

The deployment's audit directory is a small tmpfs mounted by the test. Once the workload's users
and rooms exist, a filler file takes every free byte; sends then go on through two client APIs
while every user's sync chain runs. Every acknowledged send must reach every member's chain,
positions must keep moving, and ``/health`` must say the audit log is failing (200,
``degraded``). Once the filler is deleted the logs resume with gap records, and the real Spark
validator accepts the logs, listing the gaps.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import subprocess
import urllib.request
from typing import Any

from twisted.internet.defer import ensureDeferred, inlineCallbacks
from twisted.trial.unittest import SkipTest, TestCase

from synflow.tools.workload import Workload
from tests.cluster import Cluster, free_port, wait_until
from tests.spark._session import summary, validate, violations

WRITERS = ("persister1", "persister2")
#: The tmpfs holding the audit logs: room for the set-up, then filled by the test.
TMPFS_SIZE = "8m"
#: Messages sent while the audit disk is full (60 before and 60 after).
DURING_MESSAGES = 240


def mount_tmpfs(testcase: TestCase, path: str) -> None:
    """Mount a small tmpfs on ``path`` (skip if impossible, except under CI)."""
    os.makedirs(path, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", path],
                            capture_output=True, text=True)
    if result.returncode != 0:
        reason = f"cannot mount a tmpfs for the audit directory: {result.stderr.strip()}"
        if os.environ.get("CI"):
            raise AssertionError(reason)
        raise SkipTest(reason)


def fill(path: str) -> str:
    """Write a filler file under ``path`` until the file system is full; returns its path."""
    filler = os.path.join(path, "filler")
    with open(filler, "wb", buffering=0) as f:
        chunk = b"\0" * 65536
        while True:
            try:
                f.write(chunk)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                if len(chunk) == 1:
                    return filler
                chunk = chunk[: len(chunk) // 2]


def health(port: int) -> dict[str, Any]:
    """``/health`` of the process whose internal listener is ``port`` (its body, with ``code``)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return {**json.loads(r.read()), "code": r.status}
    except urllib.error.HTTPError as e:
        return {**json.loads(e.read()), "code": e.code}


def gap_records(audit_dir: str, log: str) -> list[dict[str, Any]]:
    """The gap records under ``audit_dir/log``."""
    out = []
    for path in glob.glob(os.path.join(audit_dir, log, "*", "part-*.jsonl")):
        with open(path, encoding="utf-8") as f:
            out += [r for r in (json.loads(line) for line in f if line.strip()) if r.get("kind") == "gap"]
    return out


class AuditDiskFullTest(TestCase):
    timeout = 600

    @inlineCallbacks
    def test_full_audit_disk_during_sends(self):
        """Sends during a full audit disk are acknowledged and synced; the log resumes with a gap the validator accepts."""
        cluster = Cluster(self, writers=WRITERS)
        audit_dir = cluster.shared["audit"]["dir"]
        mount_tmpfs(self, audit_dir)

        def unmount() -> None:
            cluster.kill_all()
            subprocess.run(["umount", "-l", audit_dir], capture_output=True)

        self.addCleanup(unmount)
        ports = {"master": free_port(), "persister1": free_port()}
        listeners = {n: [{"resources": ["client"], "endpoint": f"tcp:{p}:interface=127.0.0.1"}] for n, p in ports.items()}
        yield cluster.start_master(listeners=listeners["master"])
        cluster.start_twistd("persister1", "event_persister", listeners=listeners["persister1"])
        cluster.start_twistd("persister2", "event_persister")
        for name in ("persister1", "persister2"):
            yield wait_until(lambda name=name: cluster.healthy(name), 120, f"{name} healthy")
        urls = [f"http://127.0.0.1:{p}" for p in ports.values()]
        workload = Workload(urls, users=8, rooms=12, members_per_room=3, messages=60, concurrency=8, seed=5,
                            room_shards=WRITERS, name_prefix="a")
        self.addCleanup(lambda: ensureDeferred(workload.close()))
        yield ensureDeferred(workload.setup())
        chains = ensureDeferred(workload.sync_chains())
        yield ensureDeferred(workload.send_messages())  # before: logged normally

        filler = fill(audit_dir)
        positions_before = health(cluster.instance_ports["master"])["positions"]["events"]
        workload.name_prefix = "b"  # new txn_ids for the next sends
        # Enough records for each writer to outrun what its open part file's last page still holds (a full
        # tmpfs takes writes into a page a file already has): a few KiB, whatever the batches were.
        workload.n_messages = DURING_MESSAGES
        yield ensureDeferred(workload.send_messages())  # during: the audit disk is full
        workload.n_messages = 60
        self.assertEqual(workload.send_errors, 0)
        for name in WRITERS:
            # The sends are acknowledged before the audit log's next flush meets the full disk.
            yield wait_until(lambda name=name: health(cluster.instance_ports[name])["status"] != "ok", 30,
                             f"{name}'s audit log to meet the full disk")
            body = health(cluster.instance_ports[name])
            self.assertEqual((body["code"], body["status"]), (200, "degraded"), body)
            self.assertIn("No space left on device", " ".join(body["degraded"]))
            self.assertGreater(cluster.metrics(name).get('synflow_audit_write_errors_total{log="writer"}', 0), 0)
        positions_during = health(cluster.instance_ports["master"])["positions"]["events"]
        for name in WRITERS:
            self.assertGreater(positions_during[name], positions_before[name])

        os.unlink(filler)  # space returns
        workload.name_prefix = "c"
        yield ensureDeferred(workload.send_messages())  # after
        yield wait_until(lambda: {g["writer"] for g in gap_records(audit_dir, "writer_logs")} >= set(WRITERS),
                         60, "gap records in both persisters' writer logs")
        yield wait_until(lambda: gap_records(audit_dir, "token_logs"), 60, "a gap record in a token log")
        for name in ("master", *WRITERS):
            yield wait_until(lambda name=name: health(cluster.instance_ports[name])["status"] == "ok", 60,
                             f"{name}'s /health back to ok")
        workload.stop_syncing()
        yield chains
        yield ensureDeferred(workload.drain())
        report = workload.verify()
        self.assertEqual((report.sent, report.send_errors), (120 + DURING_MESSAGES, 0), report.as_dict())
        self.assertEqual((report.lost, report.duplicated, report.order_mismatches, report.foreign), (0, 0, 0, 0),
                         report.as_dict())
        gaps = gap_records(audit_dir, "writer_logs")
        self.assertTrue(all(g["to_stream_id"] is None or g["from_stream_id"] <= g["to_stream_id"] for g in gaps))
        self.assertGreater(sum(g["facts"] for g in gaps), 0)

        for name in ("persister2", "persister1", "master"):
            yield cluster.stop(name)
        out = self.mktemp()
        code = validate(audit_dir, out)
        self.assertEqual(code, 0, violations(out))
        s = summary(out)
        self.assertTrue({g["writer"] for g in s["gaps"]["writer_logs"]} >= set(WRITERS), s["gaps"])
        self.assertTrue(s["gaps"]["token_logs"], s["gaps"])
        print(f"audit-disk-full: sent={report.sent} lost={report.lost} writer_gaps={len(s['gaps']['writer_logs'])} "
              f"facts_lost={sum(g['facts'] for g in gaps)} token_gaps={len(s['gaps']['token_logs'])} "
              f"unverifiable={s['gaps']['unverifiable']} validator_exit={code}")



#: Small audit files for the retention test: rotate at 16 KiB, keep 48 KiB of rotated files per log.
RETENTION_MAX_BYTES = 16 * 1024
RETENTION_KEEP_BYTES = 48 * 1024


class RetentionUnderLoadTest(TestCase):
    timeout = 400

    @inlineCallbacks
    def test_retention_deletes_old_files_under_load(self):
        """While users send and sync, each log keeps at most retain_bytes of rotated files plus its active one."""
        cluster = Cluster(self, writers=WRITERS, shared={"audit": {"max_bytes": RETENTION_MAX_BYTES,
                                                                   "retain_bytes": RETENTION_KEEP_BYTES}})
        audit_dir = cluster.shared["audit"]["dir"]
        ports = {"master": free_port(), "persister1": free_port()}
        listeners = {n: [{"resources": ["client"], "endpoint": f"tcp:{p}:interface=127.0.0.1"}] for n, p in ports.items()}
        yield cluster.start_master(listeners=listeners["master"])
        cluster.start_twistd("persister1", "event_persister", listeners=listeners["persister1"])
        cluster.start_twistd("persister2", "event_persister")
        for name in WRITERS:
            yield wait_until(lambda name=name: cluster.healthy(name), 120, f"{name} healthy")
        workload = Workload([f"http://127.0.0.1:{p}" for p in ports.values()], users=8, rooms=12,
                            members_per_room=3, messages=300, concurrency=8, seed=9, room_shards=WRITERS)
        self.addCleanup(lambda: ensureDeferred(workload.close()))
        yield ensureDeferred(workload.setup())
        chains = ensureDeferred(workload.sync_chains())
        yield ensureDeferred(workload.send_messages())
        workload.stop_syncing()
        yield chains
        yield ensureDeferred(workload.drain())
        report = workload.verify()
        self.assertEqual((report.sent, report.send_errors, report.lost), (300, 0, 0), report.as_dict())
        deleted_logs = 0
        for directory in glob.glob(os.path.join(audit_dir, "*_logs", "*")):
            parts = sorted(glob.glob(os.path.join(directory, "part-*.jsonl")),
                           key=lambda p: int(p.rsplit("-", 1)[1].split(".")[0]))
            numbers = [int(p.rsplit("-", 1)[1].split(".")[0]) for p in parts]
            rotated = sum(os.path.getsize(p) for p in parts[:-1])
            # Files are checked at each rotation; the active file may have grown by one batch since.
            self.assertLessEqual(rotated, RETENTION_KEEP_BYTES + RETENTION_MAX_BYTES, (directory, numbers))
            if numbers and numbers[0] > 1:
                deleted_logs += 1
                self.assertEqual(numbers, list(range(numbers[0], numbers[-1] + 1)))  # only the oldest went
        self.assertGreater(deleted_logs, 0, "retention deleted nothing")
        logs = "".join(cluster.log_tail(n, 10**7) for n in ("master", *WRITERS))
        self.assertIn("audit retention deleted", logs)
