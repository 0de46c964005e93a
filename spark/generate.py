"""Generate audit logs for the validator: clean histories with anomalies injected at recorded places.

The simulation follows synflow's rules (``DESIGN.md`` §5–6): K event persisters share one
sequence per stream starting at 2; each room has one writer at a time and is handed over only
after the old writer released its last reservation there; some reservations abort (leaving
permanent gaps) and some are still in flight at the end of the log. Each reader is given tokens
computed from the writers' persisted-up-to positions as seen ``lag`` µs before the issue time
(an idle writer leaps to the highest allocated id), and with each token the completed facts it
newly covers. A ``caches`` stream with null room and event ids and ``kind="position"`` rows are
mixed into ``writer_logs``. :mod:`spark.inject` then injects one anomaly per check (when asked)
and records the violations the validator must report.

CLI::

    python -m spark.generate --out DIR [--facts 2000] [--writers 3] [--readers 4]
        [--format jsonl|parquet|both] [--no-inject] [--seed 1]

writes ``DIR/jsonl/{writer_logs,token_logs,instance_map}`` (and ``DIR/parquet/…`` converted
with Spark) plus ``DIR/injected.json``.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import os
import random
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from .tokens import encode

T0 = 1_700_000_000_000_000
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
STREAM = "events"


@dataclass
class Config:
    """Generator parameters (see the CLI for their meaning)."""

    writers: int = 3
    readers: int = 4
    facts: int = 2000
    cache_facts: int = 200
    rooms: int = 40
    tokens_per_reader: int = 60
    handovers: int = 3
    abort_rate: float = 0.03
    mean_gap_us: int = 50_000
    rooms_readers: int = 1
    position_every: int = 50
    with_seq: bool = True
    inject: bool = True
    seed: int = 1


@dataclass
class Corpus:
    """A generated log.

    Attributes:
        facts: the ``events`` and ``caches`` fact rows (writer_logs rows).
        positions: ``kind="position"`` rows (also writer_logs rows).
        chains: per reader, the token dicts (``token``, ``comps``, ``tau``, ``delivered``, …).
        instances: ``instance_map`` rows.
        injected: what was injected: ``{"check", "primary", "key": {...}, "note"}``.
        config: the parameters.
    """

    facts: list[dict[str, Any]]
    positions: list[dict[str, Any]]
    chains: dict[str, list[dict[str, Any]]]
    instances: list[dict[str, Any]]
    config: Config
    injected: list[dict[str, Any]] = field(default_factory=list)

    @property
    def writer_names(self) -> list[str]:
        """The event persisters' names (instance ids 1..K)."""
        return [f"event_persister-{i}" for i in range(1, self.config.writers + 1)]

    def writer_rows(self) -> list[dict[str, Any]]:
        """Every ``writer_logs`` row (facts and position announcements)."""
        return self.facts + self.positions

    def token_rows(self) -> list[dict[str, Any]]:
        """Every ``token_logs`` row, with ``since`` set to the previous token unless overridden."""
        rows = []
        with_rooms = self.config.rooms_readers > 0
        for reader, chain in sorted(self.chains.items()):
            prev = None
            for t in chain:
                row: dict[str, Any] = {"reader": reader, "stream": STREAM}
                if self.config.with_seq:
                    row["seq"] = t["seq"]
                row.update({"token": t["token"], "issued_at": iso(t["tau"]),
                            "delivered": list(t["delivered"]),
                            "since": t.get("since_override", prev),
                            "issued_by": t["issued_by"]})
                if with_rooms:
                    row["rooms"] = t["rooms"]
                rows.append(row)
                prev = t["token"]
        return rows


def iso(micros: int) -> str:
    """ISO-8601 UTC text with microseconds for an epoch-µs integer."""
    return (EPOCH + timedelta(microseconds=micros)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _simulate_events(cfg: Config, rng: random.Random) -> tuple[list[dict], int]:
    writers = [f"event_persister-{i}" for i in range(1, cfg.writers + 1)]
    owner = {r: writers[r % cfg.writers] for r in range(cfg.rooms)}
    last_rel: dict[int, int] = defaultdict(int)
    frozen: dict[int, int] = {}
    handover_at = set(rng.sample(range(cfg.facts // 5, cfg.facts * 4 // 5 or 1),
                                 min(cfg.handovers, max(0, cfg.facts * 3 // 5))))
    facts = []
    t = T0
    inf = 2**62
    for i in range(cfg.facts):
        # Even times for real facts: injected facts use odd times, so they never tie.
        t += 2 * (1 + int(rng.expovariate(2.0 / cfg.mean_gap_us)))
        if i in handover_at:
            room = rng.randrange(cfg.rooms)
            others = [w for w in writers if w != owner[room]]
            if others:
                frozen[room] = last_rel[room]
                owner[room] = rng.choice(others)
        room = rng.randrange(cfg.rooms)
        if frozen.get(room, 0) > t:
            free = [r for r in range(cfg.rooms) if frozen.get(r, 0) <= t]
            room = rng.choice(free)
        long = rng.random() < 0.1 or i >= cfg.facts - 3  # the last few are still in flight at the end
        dur = 2 * (rng.randint(60_000, 100_000) if i >= cfg.facts - 3
                   else rng.randint(1000, 100_000) if long else rng.randint(1, 500))
        aborted = rng.random() < cfg.abort_rate
        sid = i + 2
        facts.append({"stream": STREAM, "writer": owner[room], "stream_id": sid,
                      "room_id": f"!room{room}:synflow", "event_id": f"$ev{sid}",
                      "reserved_at": t, "completed_at": t + dur,
                      "outcome": "aborted" if aborted else "ok", "kind": "fact"})
        last_rel[room] = max(last_rel[room], t + dur)
    end = t + 100_000
    for f in facts:
        if f["completed_at"] > end:
            f["completed_at"] = None
            f["outcome"] = None
            last_rel[int(f["room_id"][5:].split(":")[0])] = inf
    return facts, end


def _simulate_caches(cfg: Config, rng: random.Random, end: int) -> list[dict]:
    writers = [f"event_persister-{i}" for i in range(1, cfg.writers + 1)] + ["master"]
    times = sorted(2 * rng.randint(T0 // 2, end // 2) for _ in range(cfg.cache_facts))
    rows = []
    for i, t in enumerate(times):
        rel = t + 2 * rng.randint(1, 200)
        rows.append({"stream": "caches", "writer": rng.choice(writers), "stream_id": i + 2,
                     "room_id": None, "event_id": None, "reserved_at": t,
                     "completed_at": rel if rel <= end else None,
                     "outcome": "ok" if rel <= end else None, "kind": None})
    return rows


def positions_at(facts: list[dict], writers: list[str], times: list[int]) -> list[dict[str, int]]:
    """Every writer's persisted-up-to position at each of ``times`` (sorted ascending).

    A writer with reservations in flight is at its lowest in-flight id minus one; an idle writer
    leaps to the highest id allocated so far (1 before the first).
    """
    events = []
    for f in facts:
        events.append((f["reserved_at"], 0, f["stream_id"], f["writer"]))
        if f["completed_at"] is not None:
            events.append((f["completed_at"], 1, f["stream_id"], f["writer"]))
    events.sort()
    heaps: dict[str, list[int]] = {w: [] for w in writers}
    released: set[tuple[str, int]] = set()
    top = 1
    out = []
    i = 0
    for x in times:
        while i < len(events) and events[i][0] <= x:
            _, kind, sid, w = events[i]
            if kind == 0:
                heapq.heappush(heaps.setdefault(w, []), sid)
                top = max(top, sid)
            else:
                released.add((w, sid))
            i += 1
        pos = {}
        for w in writers:
            h = heaps[w]
            while h and (w, h[0]) in released:
                heapq.heappop(h)
            pos[w] = h[0] - 1 if h else top
        out.append(pos)
    return out


def _tokens(cfg: Config, rng: random.Random, facts: list[dict], end: int) -> dict[str, list[dict]]:
    writers = [f"event_persister-{i}" for i in range(1, cfg.writers + 1)]
    ids = {w: i for i, w in enumerate(writers, 1)}
    span = end - T0
    queries = []
    for r in range(cfg.readers):
        lag = 2 * rng.randint(5_000, 50_000)
        taus = sorted(rng.sample(range(T0 + span // 50, end + 1), cfg.tokens_per_reader))
        for j, tau in enumerate(taus):
            queries.append((tau - lag, r, j, tau))
    queries.sort()
    positions = positions_at([f for f in facts if f["stream"] == STREAM], writers,
                             [q[0] for q in queries])
    chains: dict[str, list[dict]] = {}
    for (x, r, j, tau), pos in zip(queries, positions):
        comps = {ids[w]: p for w, p in pos.items()}
        chains.setdefault(f"@reader{r}:synflow", [None] * cfg.tokens_per_reader)[j] = {
            "seq": j + 1, "tau": tau, "x": x, "comps": comps, "token": encode(comps),
            "delivered": [], "issued_by": f"client_reader-{r % 2 + 1}", "rooms": None}
    room_names = sorted({f["room_id"] for f in facts})
    for r, (_reader, chain) in enumerate(sorted(chains.items())):
        if r < cfg.rooms_readers:
            base = set(rng.sample(room_names, max(1, len(room_names) * 2 // 5)))
            extra = rng.choice(room_names)
            for t in chain:
                t["rooms"] = sorted(base | ({extra} if t["seq"] >= 3 else set()))
        _deliver(chain, facts, ids)
    return chains


def _deliver(chain: list[dict], facts: list[dict], ids: dict[str, int]) -> None:
    effs = {iid: [max(min(t["comps"].values()), t["comps"].get(iid, 0)) for t in chain]
            for iid in ids.values()}
    for f in facts:
        if f["stream"] != STREAM or f["outcome"] != "ok" or f["completed_at"] is None:
            continue
        j = bisect.bisect_left(effs[ids[f["writer"]]], f["stream_id"])
        if j < len(chain) and (chain[j]["rooms"] is None or f["room_id"] in chain[j]["rooms"]):
            chain[j]["delivered"].append(f["event_id"])


def generate(cfg: Config) -> Corpus:
    """Simulate a clean history and, when ``cfg.inject``, inject one anomaly per check."""
    rng = random.Random(cfg.seed)
    facts, end = _simulate_events(cfg, rng)
    caches = _simulate_caches(cfg, rng, end)
    chains = _tokens(cfg, rng, facts, end)
    writers = [f"event_persister-{i}" for i in range(1, cfg.writers + 1)]
    positions = []
    if cfg.position_every:
        times = [f["reserved_at"] + 1 for f in facts[:: cfg.position_every]]
        for t, pos in zip(times, positions_at(facts, writers, times)):
            for w, p in pos.items():
                positions.append({"stream": STREAM, "writer": w, "position": p,
                                  "announced_at": t, "kind": "position"})
    instances = [{"instance_id": i, "instance_name": w} for i, w in enumerate(writers, 1)]
    instances.append({"instance_id": cfg.writers + 1, "instance_name": "master"})
    corpus = Corpus(facts + caches, positions, chains, instances, cfg)
    if cfg.inject:
        from .inject import inject_all

        inject_all(corpus, random.Random(cfg.seed + 1))
    return corpus


def _write_jsonl(path: str, rows: list[dict[str, Any]]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, separators=(",", ":")))
            fh.write("\n")


def write_jsonl(corpus: Corpus, out: str) -> None:
    """Write the corpus as JSON Lines under ``out`` (token logs under ``stream=events/``)."""
    _write_jsonl(os.path.join(out, "writer_logs", "part-00000.jsonl"), corpus.writer_rows())
    tokens = [{k: v for k, v in r.items() if k != "stream"} for r in corpus.token_rows()]
    _write_jsonl(os.path.join(out, "token_logs", f"stream={STREAM}", "part-00000.jsonl"), tokens)
    _write_jsonl(os.path.join(out, "instance_map", "part-00000.jsonl"), corpus.instances)


def write_injected(corpus: Corpus, path: str) -> None:
    """Write the injection record and the parameters as JSON."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({"config": asdict(corpus.config), "injected": corpus.injected}, fh, indent=1)


def main(argv: list[str] | None = None) -> int:
    """Command line: generate a corpus and write it as JSONL and/or Parquet."""
    p = argparse.ArgumentParser(prog="python -m spark.generate", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--facts", type=int, default=Config.facts, help="events-stream facts")
    p.add_argument("--cache-facts", type=int, default=Config.cache_facts)
    p.add_argument("--writers", type=int, default=Config.writers)
    p.add_argument("--readers", type=int, default=Config.readers)
    p.add_argument("--tokens-per-reader", type=int, default=Config.tokens_per_reader)
    p.add_argument("--rooms", type=int, default=Config.rooms)
    p.add_argument("--rooms-readers", type=int, default=Config.rooms_readers,
                   help="readers whose tokens carry a `rooms` list")
    p.add_argument("--mean-gap-us", type=int, default=Config.mean_gap_us)
    p.add_argument("--no-seq", action="store_true", help="omit the seq column")
    p.add_argument("--no-inject", action="store_true", help="write a clean log")
    p.add_argument("--seed", type=int, default=Config.seed)
    p.add_argument("--format", choices=("jsonl", "parquet", "both"), default="jsonl")
    a = p.parse_args(argv)
    cfg = Config(writers=a.writers, readers=a.readers, facts=a.facts, cache_facts=a.cache_facts,
                 rooms=a.rooms, tokens_per_reader=a.tokens_per_reader, rooms_readers=a.rooms_readers,
                 mean_gap_us=a.mean_gap_us, with_seq=not a.no_seq, inject=not a.no_inject,
                 seed=a.seed)
    print(f"generating {cfg.facts} facts, {cfg.readers} readers ...", file=sys.stderr)
    corpus = generate(cfg)
    os.makedirs(a.out, exist_ok=True)
    jsonl_dir = os.path.join(a.out, "jsonl")
    write_jsonl(corpus, jsonl_dir)
    write_injected(corpus, os.path.join(a.out, "injected.json"))
    if a.format in ("parquet", "both"):
        from .inputs import convert_to_parquet
        from .session import get_session

        convert_to_parquet(get_session(), jsonl_dir, os.path.join(a.out, "parquet"))
    print(f"wrote {a.out} ({len(corpus.injected)} injected violations)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
