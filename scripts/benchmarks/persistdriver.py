"""The client load of the persist benchmarks: a child process running :class:`~synflow.tools.workload.Workload`.

``python -m scripts.benchmarks.persistdriver MODE --send URL... [--sync URL...]``

* ``throughput`` -- registers users, creates rooms and joins them, then sends
  ``--messages`` events with ``--concurrency`` requests in flight through the
  ``--send`` client APIs (no syncs running), and reports events/s;
* ``latency`` -- the same set-up, then every user runs a sync chain against
  the ``--sync`` processes (not the ones sent to) while messages go out at a
  fixed offered ``--rate``; reports send and send -> visible-in-sync latency
  percentiles, and checks nothing was lost.

Phases are announced as events (``phase``) so the parent can read CPU use.
"""

from __future__ import annotations

import argparse
import random
import sys
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred

from scripts.benchmarks.common import emit, percentile
from synflow.tools.workload import UserState, Workload


class SplitWorkload(Workload):
    """A workload whose sync chains run against other processes than the sends."""

    def __init__(self, send_urls: list[str], sync_urls: list[str], **kwargs: Any) -> None:
        super().__init__(send_urls, **kwargs)
        self.sync_urls = sync_urls
        self._sync_rng = random.Random(kwargs.get("seed", 1) + 1)

    def sync_url(self, user: UserState) -> str:
        return self._sync_rng.choice(self.sync_urls)


async def throughput(args: argparse.Namespace) -> None:
    w = Workload(args.send, users=args.users, rooms=args.rooms, members_per_room=args.members,
                 messages=args.warmup, concurrency=args.concurrency, seed=args.seed, name_prefix=args.prefix)
    emit("phase", name="setup")
    await w.setup()
    if args.warmup:
        await w.send_messages()  # warm caches, connection pools and the JIT-less hot paths
    w.n_messages = args.messages
    w.send_latencies = []
    emit("phase", name="send")
    await w.send_messages()
    emit("phase", name="sent")
    await w.close()
    sent = args.messages - w.send_errors
    emit("result", sent=sent, send_errors=w.send_errors, seconds=round(w.send_seconds, 3),
         events_per_s=round(sent / w.send_seconds, 1),
         send_latency_ms={q: round(percentile(w.send_latencies, v), 2)
                          for q, v in (("p50", .5), ("p95", .95), ("p99", .99))})


async def latency(args: argparse.Namespace) -> None:
    w = SplitWorkload(args.send, args.sync, users=args.users, rooms=args.rooms, members_per_room=args.members,
                      messages=args.messages, concurrency=args.concurrency, seed=args.seed, name_prefix=args.prefix,
                      sync_timeout_ms=5000)
    emit("phase", name="setup")
    await w.setup()
    chains = ensureDeferred(w.sync_chains())
    await w.syncing()  # every chain has its first token
    emit("phase", name="send")
    await w.send_messages(rate_per_s=args.rate)
    emit("phase", name="sent")
    await w.drain(timeout_s=60)
    w.stop_syncing()
    await chains
    await w.close()
    report = w.verify()
    lat = sorted(report.latencies_ms)
    step = max(1, len(lat) // 2000)
    emit("result", offered_rate=args.rate, achieved_rate=round(report.sent / report.send_seconds, 1),
         sent=report.sent, send_errors=report.send_errors, lost=report.lost, duplicated=report.duplicated,
         sync_requests=report.sync_requests, send_latency_ms=report.send_latency_ms,
         visible_latency_ms=report.visible_latency_ms, latencies_sample=lat[::step])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=["throughput", "latency"])
    p.add_argument("--send", nargs="+", required=True)
    p.add_argument("--sync", nargs="*", default=[])
    p.add_argument("--users", type=int, default=20)
    p.add_argument("--rooms", type=int, default=40)
    p.add_argument("--members", type=int, default=2)
    p.add_argument("--messages", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--rate", type=float, default=1000.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--prefix", default="u", help="user name prefix (unique per driver on one deployment)")
    args = p.parse_args()
    fn = throughput if args.mode == "throughput" else latency
    result: dict[str, Any] = {}

    def go() -> None:
        d = ensureDeferred(fn(args))
        d.addErrback(lambda f: result.update(error=f.getTraceback()))
        d.addBoth(lambda _: reactor.stop())

    reactor.callWhenRunning(go)
    reactor.run()
    if "error" in result:
        sys.stderr.write(result["error"])
        emit("error", traceback=result["error"])
        raise SystemExit(1)


if __name__ == "__main__":
    main()
