"""``redis``: RDATA/s through the Redis transport, against one message per PUBLISH.

synflow: the writer and each reader are separate processes, each running
:class:`~synflow.replication.redis.RedisTransportService` (one subscribing and
one publishing connection) on a unique channel prefix; the writer announces
committed facts as in the ``tcp`` benchmark, and lines sent in one reactor
turn share a PUBLISH. Same window flow control, same rows.

Ceilings, measured beside it on the same server:

* one message per PUBLISH: a txredisapi writer publishing each of the same
  lines as its own message (pipelined, without waiting for replies) to a
  txredisapi subscriber counting them -- what a transport without batching
  achieves;
* ``redis-benchmark`` running ``PUBLISH`` of one such line on a channel (no
  subscriber), 1 connection pipelining 16 commands: what the server itself
  does per message.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from typing import Any

from scripts.benchmarks.common import REDIS_HOST, REDIS_PORT, BenchError, Progress, redis_prefix
from scripts.benchmarks.rawproc import raw_line
from scripts.benchmarks.tcp import run_pipeline

TARGETS = [
    {"row": "redis.1", "field": "ratio", "op": ">=", "threshold": 5.0,
     "label": "≥ 5× one-message-per-PUBLISH (txredisapi)"},
]


def redis_benchmark(requests: int, prefix: str) -> dict[str, float]:
    """PUBLISH requests/s by ``redis-benchmark`` (1 client, pipeline 16, and 50 clients)."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        raise BenchError("redis-benchmark is not installed (Debian: apt-get install redis-tools)")
    payload = raw_line(123456).decode()
    out = {}
    for label, extra in (("1 client, pipeline 16", ["-c", "1", "-P", "16"]), ("50 clients", ["-c", "50"])):
        proc = subprocess.run([exe, "-h", REDIS_HOST, "-p", str(REDIS_PORT), "-n", str(requests), "--csv", *extra,
                               "PUBLISH", f"{prefix}:redis-benchmark", payload],
                              capture_output=True, text=True, timeout=300)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('"PUBLISH')]
        if not lines:
            raise BenchError(f"redis-benchmark printed no result: {proc.stdout[-500:]} {proc.stderr[-500:]}")
        # "test","rps","avg_latency_ms",... five more latency columns; the test
        # name holds the payload (commas included), so count from the end.
        out[label] = float(lines[-1].split(",")[-7].strip('"'))
    return out


def run(quick: bool, progress: Progress) -> dict[str, Any]:
    facts = 50_000 if quick else 300_000
    raw_facts = 20_000 if quick else 100_000
    rows = []
    extra: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-redis-") as tmp:
        for readers in ((1,) if quick else (1, 4)):
            prefix = redis_prefix()
            progress(f"synflow Redis transport: 1 writer -> Redis -> {readers} reader(s), {facts:,} rows")
            syn = run_pipeline(os.path.join(tmp, f"syn-{readers}"), raw=False, transport="redis", readers=readers,
                               facts=facts, timeout=600, redis_prefix=prefix, profile_as=f"redis{readers}")
            progress(f"synflow: {syn['rows_per_s']:,.0f} rows/s per reader (CPU µs per row: {syn['cpu_us_per_row']})")
            prefix = redis_prefix()
            progress(f"one message per PUBLISH (txredisapi): {raw_facts:,} rows")
            raw = run_pipeline(os.path.join(tmp, f"raw-{readers}"), raw=True, transport="redis", readers=readers,
                               facts=raw_facts, timeout=600, redis_prefix=prefix)
            progress(f"one message per PUBLISH: {raw['rows_per_s']:,.0f} rows/s per reader "
                     f"(CPU µs per row: {raw['cpu_us_per_row']})")
            rows.append({"key": f"redis.{readers}",
                         "label": f"RDATA/s end to end through Redis, 1 writer → {readers} reader(s)",
                         "unit": "RDATA/s", "value": syn["rows_per_s"], "ceiling": raw["rows_per_s"],
                         "ceiling_label": "one message per PUBLISH (txredisapi)",
                         "ratio": syn["rows_per_s"] / raw["rows_per_s"]})
            syn_cpu, raw_cpu = sum(syn["cpu_us_per_row"].values()), sum(raw["cpu_us_per_row"].values())
            rows.append({"key": f"redis.cpu{readers}", "unit": "µs/RDATA",
                         "label": f"CPU per RDATA, writer + {readers} reader(s); ratio = one-per-PUBLISH ÷ synflow",
                         "value": syn_cpu, "ceiling": raw_cpu, "ceiling_label": "one message per PUBLISH",
                         "ratio": raw_cpu / syn_cpu})
            extra[f"readers_{readers}"] = {"synflow": syn, "one_per_publish": raw}
        progress("redis-benchmark PUBLISH on the same server")
        bench = redis_benchmark(50_000 if quick else 200_000, redis_prefix())
        progress(f"redis-benchmark: {bench}")
    extra["redis_benchmark_publish_per_s"] = bench
    best = max(bench.values())
    one = next(r for r in rows if r["key"] == "redis.1")
    rows.append({"key": "redis.server", "label": "RDATA/s vs redis-benchmark PUBLISH/s (server ceiling per message)",
                 "unit": "msg/s", "value": one["value"], "ceiling": best,
                 "ceiling_label": "redis-benchmark PUBLISH, best of 1×P16 and 50 clients",
                 "ratio": one["value"] / best})
    return {"rows": rows, "targets": TARGETS, "extra": extra}
