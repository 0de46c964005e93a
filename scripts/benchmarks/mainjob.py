"""``mainjob``: the main job's traffic, measured.

The two deployments of ``scripts/demo`` (the default deployment as
``localhost`` and its federation peer, SQLite and the TCP hub, every process
under twistd through ``synflowctl``), on free ports, driven with the demo's
traffic shape (24 concurrent senders, every user syncing, messages in rooms
shared with the peer): send latency, send -> visible in sync latency,
events/s, and the CPU each process of both deployments spent per message
(``/proc/<pid>/stat`` from the first send until every message has reached
every sync chain; the set-up before it -- registering the users, creating
the rooms and joining them across the servers -- is a row of its own, so
the per-message figure does not depend on the run's length). Beside them:
the load driver's own CPU per message over the same span (this process: the
senders and every sync chain, on the same cores); the busy cores of the
whole machine from the first send to the last answer (``/proc/stat``
sampled every 0.1 s; each process's share is in ``bench.json``); and the
mean send latency the throughput allows (Little's law: senders ÷ events/s,
each sender waiting on its own send) -- when the cores are all busy, the
send latency is that queueing. The validator is not run (the demo does). The targets are absolute (issue "fast by default"); the
CPU row's ceiling is the persist benchmark's shape: the CPU per event of the
processes that persist.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from scripts.benchmarks.common import Progress, cpu_seconds, machine_cpu
from scripts.benchmarks.profile import from_env, paths_table

TARGETS = [
    {"row": "mainjob.send_p50", "field": "value", "op": "<=", "threshold": 25, "label": "send p50 ≤ 25 ms"},
    {"row": "mainjob.send_p99", "field": "value", "op": "<=", "threshold": 100, "label": "send p99 ≤ 100 ms"},
    {"row": "mainjob.visible_p99", "field": "value", "op": "<=", "threshold": 150,
     "label": "send → visible p99 ≤ 150 ms"},
    {"row": "mainjob.events", "field": "value", "op": ">=", "threshold": 300, "label": "≥ 300 events/s"},
    {"row": "mainjob.cpu", "field": "value", "op": "<=", "threshold": 4,
     "label": "≤ 4 ms CPU per message over both deployments"},
]


def _profile_name(process: str) -> str:
    """The name of ``process``'s profile (``localhost/master``: ``mainjob-localhost-master``)."""
    return "mainjob-" + process.replace("/", "-")


def _pids(directory: str) -> dict[str, int]:
    run = os.path.join(directory, "var", "run")
    pids = {}
    for name in sorted(os.listdir(run)) if os.path.isdir(run) else []:
        if name.endswith(".pid"):
            with open(os.path.join(run, name), encoding="ascii") as f:
                pids[name[:-4]] = int(f.read().strip())
    return pids


class _Samples:
    """The machine's and each process's CPU, every 0.1 s, to tell how busy the cores were while the senders sent."""

    def __init__(self, pids: dict[str, int]) -> None:
        from twisted.internet.task import LoopingCall

        self.pids = {**pids, "driver": os.getpid()}
        self.rows: list[tuple[float, tuple[float, float], dict[str, float]]] = []
        self.loop = LoopingCall(self.sample)

    def sample(self) -> None:
        self.rows.append((time.monotonic(), machine_cpu(), {n: cpu_seconds(p) for n, p in self.pids.items()}))

    def start(self) -> None:
        self.loop.start(0.1)

    def stop(self) -> None:
        if self.loop.running:
            self.loop.stop()
        self.sample()

    def spent(self) -> dict[str, float]:
        """CPU seconds each process (the driver too) used from the first sample to the last."""
        first, last = self.rows[0][2], self.rows[-1][2]
        return {n: last[n] - first[n] for n in self.pids}

    def cores_between(self, start: float, end: float, cores: int) -> tuple[float, dict[str, float]]:
        """Busy cores of the whole machine, and of each process, over the samples that bound ``[start, end]``."""
        first = max((r for r in self.rows if r[0] <= start), key=lambda r: r[0], default=self.rows[0])
        last = min((r for r in self.rows if r[0] >= end), key=lambda r: r[0], default=self.rows[-1])
        wall = last[0] - first[0]
        jiffies = last[1][1] - first[1][1]
        machine = (last[1][0] - first[1][0]) / jiffies * cores if jiffies else 0.0
        return machine, {n: (last[2][n] - first[2][n]) / wall if wall else 0.0 for n in self.pids}


def _ctl(directory: str, command: str) -> int:
    return subprocess.run([sys.executable, "-m", "synflow.tools.ctl", command, "."], cwd=directory,
                          stdout=subprocess.DEVNULL).returncode


def run(quick: bool, progress: Progress) -> dict[str, Any]:
    from twisted.internet import reactor
    from twisted.internet.defer import ensureDeferred

    from scripts import demo
    from synflow.tools.deploy import DEFAULT_PORTS, free_port

    args = argparse.Namespace(messages=600 if quick else 3000, users=40, rooms=60, members=3, concurrency=24,
                              seed=1, drain_timeout=180.0)
    with tempfile.TemporaryDirectory(prefix="bench-mainjob-") as out:
        home_ports = {p: free_port() for p in DEFAULT_PORTS}
        peer_ports = {p: free_port() for p in DEFAULT_PORTS}
        home, peer = os.path.join(out, "localhost"), os.path.join(out, demo.PEER)
        servers = demo.make_deployments(home, peer, home_ports, peer_ports)
        started = []
        try:
            for directory in (home, peer):
                if _ctl(directory, "start") != 0:
                    raise RuntimeError(f"could not start the deployment in {directory}")
                started.append(directory)
            pids = {f"{server}/{name}": pid for server, directory in (("localhost", home), (demo.PEER, peer))
                    for name, pid in _pids(directory).items()}
            cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
            # Sampled from the first send; "driver" is this process, which drives the traffic (the
            # senders and every sync chain) on the same cores.
            samples = _Samples(pids)
            profiler = from_env()
            progress(f"sending {args.messages} messages with {args.concurrency} concurrent senders")
            result: dict[str, Any] = {}
            demo.progress_bar = lambda done, total: None  # quiet: the runner shows progress lines
            demo_step = demo.step

            def step(msg: str) -> None:
                demo_step(msg)
                if msg.startswith("sending"):  # the CPU figure and the profiles cover the messages, not the set-up
                    samples.start()  # its first sample is the CPU at the first send
                    for name, pid in pids.items():
                        profiler.attach(_profile_name(name), pid, 2 if quick else 10)

            demo.step = step

            def go() -> None:
                d = ensureDeferred(demo.traffic(args, servers))
                d.addCallbacks(lambda w: result.update(workload=w), lambda f: result.update(error=f))
                d.addBoth(lambda _: reactor.stop())

            t0 = time.monotonic()
            reactor.callWhenRunning(go)
            reactor.run(installSignalHandlers=False)
            if "error" in result:
                raise RuntimeError(result["error"].getTraceback())
            samples.stop()  # the traffic's CPU: not the check of what was delivered, next
            report = result["workload"].verify()
            setup_cpu = sum(samples.rows[0][2][name] - cpu_before[name] for name in pids)
            cpu = samples.spent()
            driver_cpu = cpu.pop("driver")
            traffic_s = time.monotonic() - t0
            profiler.finish()
        finally:
            for directory in reversed(started):
                _ctl(directory, "stop")
    if not report.ok:
        raise RuntimeError(f"the traffic lost or reordered messages: {report.as_dict()}")
    send, visible = report.send_latency_ms, report.visible_latency_ms
    per_message = {name: used * 1000 / report.sent for name, used in sorted(cpu.items())}
    persisting = sum(v for k, v in per_message.items() if k.split("/")[1].startswith(("master", "persister")))
    total_cpu = sum(per_message.values())
    driver_ms = driver_cpu * 1000 / report.sent
    # From the first send to the last answer: the machine's busy cores, and each process's.
    log = result["workload"].send_log
    cores = os.cpu_count() or 1
    cores_busy, by_process = samples.cores_between(min(t for t, _ in log), max(t + ms / 1000 for t, ms in log), cores)
    # Little's law: with every sender waiting on its own send, the mean send takes senders ÷ throughput.
    little_ms = args.concurrency / report.events_per_s * 1000 if report.events_per_s else None
    rows = [
        {"key": "mainjob.send_p50", "label": "main job: send latency p50", "unit": "ms", "value": send["p50"]},
        {"key": "mainjob.send_p99", "label": "main job: send latency p99", "unit": "ms", "value": send["p99"]},
        {"key": "mainjob.visible_p50", "label": "main job: send → visible in sync p50", "unit": "ms",
         "value": visible["p50"]},
        {"key": "mainjob.visible_p99", "label": "main job: send → visible in sync p99", "unit": "ms",
         "value": visible["p99"]},
        {"key": "mainjob.events", "label": f"main job: events/s ({args.concurrency} concurrent senders)",
         "unit": "events/s", "value": report.events_per_s},
        {"key": "mainjob.cpu", "label": "main job: CPU per message, every process of both deployments",
         "unit": "ms/event", "value": total_cpu, "ceiling": persisting,
         "ceiling_label": "of which masters and persisters", "ratio": total_cpu / persisting if persisting else None},
        {"key": "mainjob.driver_cpu",
         "label": "main job: CPU per message, the load driver (the senders and every sync chain, same cores)",
         "unit": "ms/event", "value": driver_ms},
        {"key": "mainjob.cores_busy", "label": "main job: cores busy while the senders send, whole machine",
         "unit": "cores", "value": cores_busy, "ceiling": cores, "ceiling_label": "cores", "ratio": cores_busy / cores},
        {"key": "mainjob.little", "unit": "ms", "value": little_ms,
         "label": f"main job: mean send latency the throughput allows ({args.concurrency} senders ÷ events/s)"},
        {"key": "mainjob.setup_cpu",
         "label": f"main job: CPU of the set-up ({args.users} users, {args.rooms} shared rooms), every process",
         "unit": "s", "value": setup_cpu},
    ]
    syncs_per_message = report.sync_requests / report.sent if report.sent else None
    if profiler.enabled and profiler.directory:
        files = {name: (os.path.join(profiler.directory, _profile_name(name) + ".txt"), ms)
                 for name, ms in per_message.items()}
        with open(os.path.join(profiler.directory, "mainjob-paths.md"), "w", encoding="utf-8") as f:
            f.write(paths_table(files))
    progress(f"send p50/p99 {send['p50']:.1f}/{send['p99']:.1f} ms, visible p50/p99 {visible['p50']:.1f}/"
             f"{visible['p99']:.1f} ms, {report.events_per_s:,.0f} events/s, {total_cpu:.2f} ms CPU/message "
             f"(+ {driver_ms:.2f} the driver), {cores_busy:.2f} of {cores} cores busy, "
             f"{report.sync_requests:,} sync responses ({syncs_per_message or 0:.2f} a message)")
    return {"rows": rows, "targets": TARGETS,
            "extra": {"cpu_ms_per_message": per_message, "driver_cpu_ms_per_message": driver_ms,
                      "cores_while_sending": by_process,
                      "cores_busy": cores_busy, "setup_cpu_s": setup_cpu, "traffic_s": traffic_s,
                      "sent": report.sent, "sync_responses_per_message": syncs_per_message}}
