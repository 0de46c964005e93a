"""Writing a run's results: ``bench.json``, the ``bench.md`` table, and the plots.

* ``bench.json`` -- everything: the machine, every repetition's raw result,
  the aggregated rows (median, min, max of value, ceiling and ratio) and
  every target with its verdict;
* ``bench.md`` -- the machine, then one table row per figure: benchmark,
  figure, measured (median and min-max), ceiling, ratio, target, met?;
* ``latency.png`` -- send -> visible-in-sync latency (percentiles per
  repetition and the distribution), from ``persist``;
* ``scaling.png`` -- events/s with 1 vs 2 persisters and RDATA/s per reader
  with 1 vs 4 readers (synflow and raw);
* ``memory.png`` -- RSS against facts replicated, and a congested writer's
  RSS and queue over time.
"""

from __future__ import annotations

import json
import os
from typing import Any

from scripts.benchmarks.common import median


def fmt(value: Any, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "—"
    if unit in ("ms", "s", "MiB"):
        return f"{value:,.1f}"
    if unit in ("×", "ratio"):
        return f"{value:.2f}"
    if unit == "ms/event":
        return f"{value:.2f}"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.2f}"


def _spread(row: dict[str, Any], field: str, unit: str) -> str:
    lo, hi = row.get(f"{field}_min"), row.get(f"{field}_max")
    if lo is None or hi is None or len([v for v in row.get(f"{field}s", []) if v is not None]) < 2:
        return ""
    return f" ({fmt(lo, unit)}–{fmt(hi, unit)})"


def _target_text(t: dict[str, Any], unit: str) -> str:
    what = "ratio " if t["field"] == "ratio" else ""
    threshold = fmt(t["threshold"], "ratio" if t["field"] == "ratio" else unit)
    return f"{what}{t['op'].replace('>=', '≥').replace('<=', '≤')} {threshold}"


def verdict(t: dict[str, Any]) -> str:
    if t["met"] is None:
        return "not measured"
    if t["met"]:
        return "yes"
    value, threshold = t["value"], t["threshold"]
    if t["op"] == ">=":
        return f"**no** ({value / threshold:.0%} of target)" if threshold else "**no**"
    return f"**no** ({value / threshold:.1f}× the limit)" if threshold else "**no**"


def markdown(report: dict[str, Any], plots: list[str] | None = None) -> str:
    m = report["machine"]
    reps = sorted({b["repetitions"] for b in report["benchmarks"]})
    lines = [
        "# synflow benchmarks",
        "",
        f"{report['mode'].capitalize()} run of {report['generated']}, {report['seconds'] / 60:.0f} min; "
        f"repetitions per benchmark: {', '.join(map(str, reps))} (median shown, min–max in brackets).",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gb']} GB RAM, Linux {m['kernel']}; "
        f"Python {m['python']}, Twisted {m.get('twisted', '?')}, PostgreSQL {m['postgresql']}, "
        f"Redis {m['redis']}, {m.get('java', 'Java ?')}. Load average {m['loadavg_at_start']:.1f} at the start, "
        f"{m.get('loadavg_at_end', 0):.1f} at the end (other work shares this machine: ratios to the ceiling "
        f"measured beside each figure are the steadier numbers).",
        "",
        "| benchmark | figure | measured | ceiling | ratio | target | met? |",
        "|---|---|---|---|---|---|---|",
    ]
    for bench in report["benchmarks"]:
        by_row: dict[str, list[dict[str, Any]]] = {}
        for t in bench["targets"]:
            by_row.setdefault(t["row"], []).append(t)
        if not bench["rows"]:
            lines.append(f"| {bench['name']} | — | failed: {'; '.join(e.splitlines()[0] for e in bench['errors'])} "
                         f"| | | {'; '.join(t['label'] for t in bench['targets'])} | not measured |")
            continue
        for row in bench["rows"]:
            unit = row.get("unit", "")
            targets = by_row.get(row["key"], [])
            measured = f"{fmt(row['value'], unit)} {unit}{_spread(row, 'value', unit)}"
            ceiling = "—" if row.get("ceiling") is None else \
                f"{fmt(row['ceiling'], unit)} ({row.get('ceiling_label', '')})"
            ratio = "—" if row.get("ratio") is None else f"{row['ratio']:.2f}{_spread(row, 'ratio', 'ratio')}"
            target = "; ".join(_target_text(t, unit) for t in targets) or "—"
            met = "; ".join(verdict(t) for t in targets) or "—"
            label = row["label"] + (f" — {row['note']}" if row.get("note") else "")
            lines.append(f"| {bench['name']} | {label} | {measured} | {ceiling} | {ratio} | {target} | {met} |")
        if bench["errors"]:
            lines.append(f"| {bench['name']} | failed repetitions: {len(bench['errors'])} | "
                         f"{'; '.join(e.splitlines()[0] for e in bench['errors'])} | | | | |")
    for name, why in report.get("skipped", {}).items():
        lines.append(f"| {name} | {why} | | | | | |")
    all_targets = [(b["name"], t) for b in report["benchmarks"] for t in b["targets"]]
    n_met = sum(1 for _, t in all_targets if t["met"])
    lines += ["", f"Targets met: {n_met} of {len(all_targets)}.", ""]
    for bench_name, t in all_targets:
        lines.append(f"- {bench_name}: {t['label']} — {verdict(t)}")
    shown = ", ".join(f"`{p}`" for p in plots or []) or "none (no benchmark with a plot ran)"
    lines += ["", f"Plots: {shown}. Every figure of every repetition: `bench.json`."]
    return "\n".join(lines) + "\n"


# -- plots ---------------------------------------------------------------------------------


def _bench(report: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((b for b in report["benchmarks"] if b["name"] == name and b["succeeded"]), None)


def _ok_raw(bench: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in bench["raw"] if "error" not in r]


def plot_latency(report: dict[str, Any], path: str) -> bool:
    bench = _bench(report, "persist")
    if bench is None:
        return False
    import matplotlib.pyplot as plt

    runs = [r["latency"] for r in _ok_raw(bench) if r.get("latency")]
    rates = sorted({rate for r in runs for rate in r}, key=lambda x: -int(x))
    fig, (bars, cdf) = plt.subplots(1, 2, figsize=(11, 4.2))
    qs = ["p50", "p95", "p99"]
    width = 0.8 / max(1, len(rates))
    colors = ["#d8553b", "#3b7dd8", "#2a9d8f"]
    for k, rate in enumerate(rates):
        per = [r[rate]["percentiles"] for r in runs if rate in r]
        meds = [median(p[q] for p in per) for q in qs]
        lo = [m - min(p[q] for p in per) for m, q in zip(meds, qs, strict=True)]
        hi = [max(p[q] for p in per) - m for m, q in zip(meds, qs, strict=True)]
        xs = [i + (k - (len(rates) - 1) / 2) * width for i in range(len(qs))]
        bars.bar(xs, meds, width=width, yerr=[lo, hi], capsize=4, color=colors[k % 3],
                 label=f"{int(rate):,} events/s offered")
        for x, v in zip(xs, meds, strict=True):
            bars.text(x, v, f"{v:,.0f}" if v >= 100 else f"{v:.1f}", ha="center", va="bottom", fontsize=8)
        for i, r in enumerate(r for r in runs if rate in r):
            sample = sorted(r[rate]["sample_ms"])
            if sample:
                cdf.plot(sample, [j / len(sample) for j in range(len(sample))], color=colors[k % 3],
                         alpha=0.9 if i == 0 else 0.5, label=f"{int(rate):,}/s" if i == 0 else None)
    bars.axhline(50, color="grey", linestyle="--", linewidth=1)
    bars.text(len(qs) - 0.6, 50, "target p99 50 ms", va="bottom", ha="right", fontsize=8, color="grey")
    bars.set_xticks(range(len(qs)), qs)
    bars.set_yscale("log")
    bars.set_ylabel("ms (log)")
    bars.set_title("send → visible in another process's sync\n(median of runs, min–max)")
    bars.legend(fontsize=8)
    cdf.set_xscale("log")
    cdf.set_xlabel("ms (log)")
    cdf.set_ylabel("fraction of events")
    cdf.set_title("distribution (each run)")
    cdf.grid(True, alpha=0.3)
    cdf.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_scaling(report: dict[str, Any], path: str) -> bool:
    persist, tcp = _bench(report, "persist"), _bench(report, "tcp")
    if persist is None and tcp is None:
        return False
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    if persist is not None:
        ax = axes[0]
        runs = [r["scaling"]["events_per_s"] for r in _ok_raw(persist)]
        meds = [median(r[i] for r in runs) for i in range(2)]
        ax.bar(["1 persister", "2 persisters"], meds, color=["#3b7dd8", "#2a9d8f"],
               yerr=[[m - min(r[i] for r in runs) for i, m in enumerate(meds)],
                     [max(r[i] for r in runs) - m for i, m in enumerate(meds)]], capsize=6)
        ax.plot([0, 1], [meds[0], 2 * meds[0]], color="grey", linestyle="--", linewidth=1, label="linear scaling")
        for i, v in enumerate(meds):
            ax.text(i, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=9)
        ax.set_ylabel("events/s")
        ax.set_title("persist: events/s through the client API")
        ax.legend(fontsize=8)
    else:
        axes[0].set_visible(False)
    if tcp is not None:
        ax = axes[1]
        runs = [r["scaling"] for r in _ok_raw(tcp)]
        syn = [median(r["per_reader"][i] for r in runs) for i in range(2)]
        raw = [median(r["raw_per_reader"][i] for r in runs) for i in range(2)]
        x = [0, 1]
        ax.bar([i - 0.2 for i in x], syn, width=0.4, label="synflow (hub)", color="#3b7dd8")
        ax.bar([i + 0.2 for i in x], raw, width=0.4, label="raw LineOnlyReceiver", color="#bbbbbb")
        for i in x:
            ax.text(i - 0.2, syn[i], f"{syn[i]:,.0f}", ha="center", va="bottom", fontsize=8)
            ax.text(i + 0.2, raw[i], f"{raw[i]:,.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x, ["1 reader", "4 readers"])
        ax.set_ylabel("RDATA/s applied per reader")
        ax.set_title("tcp: 1 writer → hub → readers")
        ax.legend(fontsize=8)
    else:
        axes[1].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_memory(report: dict[str, Any], path: str) -> bool:
    bench = _bench(report, "memory")
    if bench is None:
        return False
    import matplotlib.pyplot as plt

    run = _ok_raw(bench)[-1]["memory"]
    fig, (flat, cong) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label in (("hub", "master (hub + handler)"), ("writer", "writer"), ("reader1", "reader")):
        xy = [(p["facts"], p[key]) for p in run["flat"] if p.get(key) is not None]
        flat.plot([a for a, _ in xy], [b for _, b in xy], label=label)
    flat.set_xlabel("facts replicated")
    flat.set_ylabel("RSS (MiB)")
    top = max((p[k] for p in run["flat"] for k in ("hub", "writer", "reader1") if p.get(k)), default=1)
    flat.set_ylim(0, top * 1.3)
    flat.set_title("RSS while facts flow end to end")
    flat.legend(fontsize=8)
    pts = [p for p in run["congested"] if p.get("writer") is not None]
    cong.plot([p["t"] for p in pts], [p["writer"] for p in pts], color="#d8553b", label="writer RSS (MiB)")
    cong.set_xlabel("seconds since the reader stopped reading")
    cong.set_ylabel("MiB")
    cong.set_ylim(0, max(p["writer"] for p in pts) * 1.3)
    queued = [(p["t"], p["pending_bytes"] / 2**20) for p in pts if p.get("pending_bytes") is not None]
    if queued:
        cong.plot([a for a, _ in queued], [b for _, b in queued], color="#3b7dd8", label="queued for the reader (MiB)")
    cong.axhline(8, color="grey", linestyle="--", linewidth=1)
    cong.text(0, 8, " high-water 8 MiB", va="bottom", fontsize=8, color="grey")
    cong.set_title("writer serving a reader that stopped reading")
    cong.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_outputs(report: dict[str, Any], out: str) -> list[str]:
    """Write bench.json, bench.md and whichever plots the run has data for; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    paths = []
    path = os.path.join(out, "bench.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, default=str)
    paths.append(path)
    plots = []
    for name, fn in (("latency.png", plot_latency), ("scaling.png", plot_scaling), ("memory.png", plot_memory)):
        target = os.path.join(out, name)
        try:
            if fn(report, target):
                plots.append(name)
                paths.append(target)
        except Exception as e:  # a plot must never lose the figures
            print(f"could not draw {name}: {type(e).__name__}: {e}")
    path = os.path.join(out, "bench.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write(markdown(report, plots))
    paths.insert(1, path)
    return paths
