#!/usr/bin/env python3
"""The main job: run the default deployment and a federation peer, drive traffic, prove nothing was lost.

1. Copies the default deployment (``workers/``) into ``OUT/localhost/`` and a
   small peer deployment (master, one persister, one federation sender) into
   ``OUT/peer.localhost/``, each federating with the other (a server sends to
   the other's ``federation`` listener: 8448, and 18448 for the peer, whose
   ports are the defaults + 10000); starts both with ``synflowctl`` (every
   process through twistd).
2. Registers users on both servers, creates rooms shared across them, and
   sends messages through both client APIs while every user runs a sync
   chain (a progress bar shows the sends).
3. Waits until every chain has every message of its rooms, local or
   federated.
4. Runs the Spark token validator over each deployment's audit logs, in one
   Spark session.
5. Prints a report (events/s, send->sync latency, federation delivered /
   expected, cache hit rate, validator verdict), writes it as
   ``OUT/report.md`` with a latency plot ``OUT/latency.png``, stops
   everything, and exits non-zero if anything was lost or the validator
   found anomalies.

Needs only Python and Java (no PostgreSQL, no Redis): both deployments run on
SQLite and the embedded TCP hub.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from twisted.internet import reactor  # noqa: E402
from twisted.internet.defer import ensureDeferred  # noqa: E402

from scripts.prereqs import check_java, check_ports  # noqa: E402
from synflow.tools.deploy import (  # noqa: E402
    CLIENT_PORT,
    DEFAULT_PORTS,
    FEDERATION_PORT,
    free_port,
    make_deployment,
)
from synflow.tools.workload import Workload  # noqa: E402

PEER = "peer.localhost"
#: The peer deployment listens on the default ports plus this.
PEER_PORT_OFFSET = 10000


def step(msg: str) -> None:
    print(f"==> {msg}", flush=True)


def ctl(directory: str, command: str) -> int:
    return subprocess.run([sys.executable, "-m", "synflow.tools.ctl", command, "."], cwd=directory).returncode


def progress_bar(done: int, total: int) -> None:
    if done == total or done % max(1, total // 50) == 0:
        width = 40
        filled = int(width * done / total)
        end = "\n" if done == total else ""
        print(f"\r    sending [{'#' * filled}{'.' * (width - filled)}] {done}/{total}", end=end, flush=True)


def cache_hit_rate(metric_urls: list[str]) -> tuple[float, int, int]:
    hits = misses = 0.0
    for url in metric_urls:
        try:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
        except OSError:
            continue
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "synflow_cache_hits_total":
                    hits += sample.value
                elif sample.name == "synflow_cache_misses_total":
                    misses += sample.value
    total = hits + misses
    return (hits / total if total else 0.0), int(hits), int(misses)


def run_validators(jobs: list[tuple[str, str, str]]) -> dict[str, tuple[int, dict]]:
    """Validate each ``(name, logs, out)`` in one Spark session; the exit code and summary per name."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable  # Spark's Python workers run this interpreter
    from spark.cli import parse_args
    from spark.session import get_session
    from spark.validate_tokens import run

    try:
        spark = get_session(None, None, "2g", app_name="synflow-demo-validator")
    except Exception as e:  # no JVM: every verdict is an internal failure
        print(f"demo: cannot start Spark: {e}", file=sys.stderr)
        return {name: (3, {}) for name, _, _ in jobs}
    verdicts = {}
    try:
        for name, logs, out in jobs:
            step(f"validating {name}'s tokens with Spark")
            code = run(spark, parse_args(["--logs", logs, "--out", out]))
            summary = {}
            try:
                with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
                    summary = json.load(f)
            except (OSError, ValueError):
                pass
            verdicts[name] = (code, summary)
    finally:
        spark.stop()
    return verdicts


def plot(latencies: list[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (hist, cdf) = plt.subplots(1, 2, figsize=(10, 4))
    hist.hist(latencies, bins=50, color="#3b7dd8")
    hist.set_xlabel("send -> visible in sync (ms)")
    hist.set_ylabel("messages")
    hist.set_title("Latency distribution")
    ordered = sorted(latencies)
    cdf.plot(ordered, [i / len(ordered) for i in range(len(ordered))], color="#d8553b")
    cdf.set_xlabel("send -> visible in sync (ms)")
    cdf.set_ylabel("fraction of messages")
    cdf.set_title("Cumulative")
    cdf.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def traffic(args: argparse.Namespace, servers: dict[str, list[str]]) -> Workload:
    workload = Workload(servers, users=args.users, rooms=args.rooms, members_per_room=args.members,
                        messages=args.messages, concurrency=args.concurrency, seed=args.seed,
                        progress=progress_bar, name_prefix="demo", remote_members=1)
    step(f"registering {args.users} users on both servers and creating {args.rooms} shared rooms")
    await workload.setup()
    step(f"sending {args.messages} messages through both servers while every user syncs")
    chains = ensureDeferred(workload.sync_chains())
    await workload.syncing()
    await workload.send_messages()
    workload.stop_syncing()
    await chains
    step("waiting until every sync chain has every message of its rooms (local and federated)")
    await workload.drain(timeout_s=args.drain_timeout)
    await workload.close()
    return workload


def make_deployments(home_dir: str, peer_dir: str, home_ports: dict[int, int],
                     peer_ports: dict[int, int]) -> dict[str, list[str]]:
    """Write the two deployments: ``workers/`` as localhost, and the small peer.

    Each server sends federation traffic to the other's federation listener
    (``FEDERATION_PORT`` through its port map); clients use the client
    listeners.

    Returns:
        server name -> the URLs of its client API.
    """
    make_deployment(home_dir, "localhost", home_ports, peer=PEER,
                    peer_url=f"http://127.0.0.1:{peer_ports[FEDERATION_PORT]}")
    make_deployment(peer_dir, PEER, peer_ports, peer="localhost",
                    peer_url=f"http://127.0.0.1:{home_ports[FEDERATION_PORT]}",
                    processes=["master", "persister1", "federation_sender1"], writers=["persister1"])
    return {"localhost": [f"http://127.0.0.1:{home_ports[CLIENT_PORT]}"],
            PEER: [f"http://127.0.0.1:{peer_ports[CLIENT_PORT]}"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--users", type=int, default=40)
    parser.add_argument("--rooms", type=int, default=60)
    parser.add_argument("--members", type=int, default=3, help="local members per room (plus one remote)")
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=os.path.join(ROOT, "demo-out"))
    parser.add_argument("--free-ports", action="store_true", help="remap every port to a free one (for tests)")
    parser.add_argument("--drain-timeout", type=float, default=180.0)
    parser.add_argument("--keep-running", action="store_true",
                        help="leave both deployments running (the token validators, which need them stopped, are skipped)")
    args = parser.parse_args()

    problems = check_java() + ([] if args.free_ports else check_ports(p + off for p in DEFAULT_PORTS for off in (0, PEER_PORT_OFFSET)))
    if problems:
        for problem in problems:
            print(f"demo: {problem}", file=sys.stderr)
        return 1
    out = os.path.abspath(args.out)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    home_ports = {p: (free_port() if args.free_ports else p) for p in DEFAULT_PORTS}
    peer_ports = {p: (free_port() if args.free_ports else p + PEER_PORT_OFFSET) for p in DEFAULT_PORTS}
    home_dir, peer_dir = os.path.join(out, "localhost"), os.path.join(out, PEER)
    servers = make_deployments(home_dir, peer_dir, home_ports, peer_ports)

    started = []
    code = 1
    try:
        for name, directory in (("localhost (workers/)", home_dir), (PEER, peer_dir)):
            step(f"starting the {name} deployment")
            if ctl(directory, "start") != 0:
                print(f"could not start {name}; logs are under {directory}/var/log")
                return 1
            started.append(directory)
        for directory in started:
            ctl(directory, "status")
        result: dict = {}

        def run() -> None:
            d = ensureDeferred(traffic(args, servers))
            d.addCallbacks(lambda w: result.update(workload=w), lambda f: result.update(error=f))
            d.addBoth(lambda _: reactor.stop())

        t0 = time.monotonic()
        reactor.callWhenRunning(run)
        reactor.run()
        if "error" in result:
            print(result["error"].getTraceback())
            return 1
        workload: Workload = result["workload"]
        report = workload.verify()
        traffic_s = time.monotonic() - t0
        metric_urls = [f"http://127.0.0.1:{home_ports[p]}/metrics" for p in (9101, 9102, 9103, 9104, 9105)]
        hit_rate, hits, misses = cache_hit_rate(metric_urls)
        verdicts: dict[str, tuple[int, dict]] = {}
        if args.keep_running:
            # Their audit logs are still open (flushed on stop): the validators need them whole.
            print(f"demo: both deployments left running; the token validators need them stopped first: "
                  f"`python -m synflow.tools.ctl stop .` in {home_dir} and in {peer_dir}", flush=True)
            started = []
        else:
            step("stopping the deployments (audit logs are flushed on stop)")
            for directory in reversed(started):
                ctl(directory, "stop")
            started = []
            verdicts = run_validators([(name, os.path.join(directory, "var", "audit"),
                                        os.path.join(out, f"validator-{name}"))
                                       for name, directory in (("localhost", home_dir), (PEER, peer_dir))])
        plot(report.latencies_ms, os.path.join(out, "latency.png"))
        code = write_report(out, args, report, traffic_s, hit_rate, hits, misses, verdicts)
        return code
    finally:
        for directory in reversed(started):
            ctl(directory, "stop")


def validator_violations(summary: dict) -> int | None:
    """Violations the validator counted over all checks (its ``summary.json``), or None if it has none."""
    checks = summary.get("checks")
    if not isinstance(checks, dict):
        return None
    return sum(c.get("count", 0) for c in checks.values() if isinstance(c, dict))


def write_report(out: str, args: argparse.Namespace, report, traffic_s: float, hit_rate: float, hits: int,
                 misses: int, verdicts: dict) -> int:
    """Write ``report.md`` and ``report.json`` under ``out`` and print the report.

    Args:
        report: the workload's :class:`~synflow.tools.workload.Report`.
        verdicts: server name -> (validator exit code, its summary.json); empty when
            the validators were not run (``--keep-running``).

    Returns:
        0 if nothing was lost, duplicated or reordered, every send succeeded,
        federation delivered everything and every validator run was clean;
        else 1 (the report's verdict then reads FAILED).
    """
    lat = report.visible_latency_ms
    send = report.send_latency_ms
    fed_ok = report.federated_delivered == report.federated_expected
    validator_ok = all(code == 0 for code, _ in verdicts.values())
    ok = report.ok and report.send_errors == 0 and fed_ok and validator_ok
    lines = [
        "# synflow main job report",
        "",
        f"Two deployments on SQLite and the TCP hub: `localhost` (the default deployment in `workers/`: master, "
        f"2 event persisters, a federation sender, a cache invalidator) and `{PEER}` (master, persister, sender).",
        "",
        "| measure | value |",
        "|---|---|",
        f"| users / rooms | {report.users} / {report.rooms} |",
        f"| messages sent | {report.sent} (send errors: {report.send_errors}) |",
        f"| throughput (offered by {args.concurrency} concurrent clients) | {report.events_per_s:,.0f} events/s |",
        f"| send latency p50 / p95 / p99 | {send['p50']:.1f} / {send['p95']:.1f} / {send['p99']:.1f} ms |",
        # Each client waits for its send before the next: the mean send is clients ÷ throughput (Little's law),
        # so with the cores busy the latency is the queue the throughput makes (docs/benchmarks.md, mainjob).
        f"| mean send latency the throughput allows ({args.concurrency} clients ÷ events/s) | "
        f"{args.concurrency / report.events_per_s * 1000 if report.events_per_s else float('nan'):.1f} ms |",
        f"| send -> visible in sync p50 / p95 / p99 | {lat['p50']:.1f} / {lat['p95']:.1f} / {lat['p99']:.1f} ms |",
        f"| federation delivered / expected | {report.federated_delivered} / {report.federated_expected} |",
        f"| lost / duplicated / out of order / foreign | {report.lost} / {report.duplicated} / "
        f"{report.order_mismatches} / {report.foreign} |",
        f"| sync requests | {report.sync_requests} |",
        f"| cache hit rate (localhost) | {hit_rate:.1%} ({hits} hits, {misses} misses) |",
    ]
    for name, (code, summary) in verdicts.items():
        violations = validator_violations(summary)
        verdict = "clean" if code == 0 else f"FAILED (exit {code})"
        lines.append(f"| token validator ({name}) | {verdict}; violations: {'?' if violations is None else violations} |")
    if not verdicts:
        lines.append("| token validators | not run: the deployments were left running (`--keep-running`) |")
    lines += ["", f"Traffic phase: {traffic_s:.1f} s. Latency plot: `latency.png`.", "",
              f"**Verdict: {'OK - nothing lost, no anomalies' if ok else 'FAILED'}**"]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "report.md"), "w", encoding="utf-8") as f:
        f.write(text)
    with open(os.path.join(out, "report.json"), "w", encoding="utf-8") as f:
        json.dump({**report.as_dict(), "cache_hit_rate": hit_rate,
                   "validator": {n: c for n, (c, _) in verdicts.items()}, "ok": ok}, f, indent=2)
    print()
    print(text)
    print(f"report: {os.path.join(out, 'report.md')}  plot: {os.path.join(out, 'latency.png')}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
