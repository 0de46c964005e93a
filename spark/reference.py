"""A brute-force, pure-Python reference checker for small logs.

It implements every check of ``docs/validator.md`` straight from the definitions, with nested
loops and no cleverness, so that the Spark job (which must be near-linear) can be compared with
it on generated histories. Rows are dicts shaped like the input tables, timestamps already in
integer microseconds (see :func:`to_micros`). Use it only for a few thousand rows.
"""

from __future__ import annotations

import glob
import json
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from .checks import (
    BY_NAME,
    DEFAULT_FIRST_ID,
    DEFAULT_UNRESOLVED_AFTER_S,
    MAX_LONG,
    violation_key,
)
from .tokens import ParsedToken, parse

Row = dict[str, Any]


@dataclass
class Result:
    """What the reference checker found.

    Attributes:
        violations: one dict per violation (``check`` plus the key columns and some context).
        pending: ``in_flight_facts`` and ``above_reader_watermark`` counts.
        retried_redeliveries: re-deliveries that are not ``duplicate_delivery`` because the
            client retried from an older ``since`` (see :func:`_retried`).
    """

    violations: list[Row] = field(default_factory=list)
    pending: dict[str, int] = field(default_factory=dict)
    retried_redeliveries: int = 0

    def keys(self) -> set[tuple]:
        """The set of violation keys (see :func:`spark.checks.violation_key`)."""
        return {violation_key(v["check"], v) for v in self.violations}


def to_micros(value: Any) -> int | None:
    """Microseconds since the epoch from an integer or an ISO-8601 string (None stays None)."""
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    dt = datetime.fromisoformat(str(value))
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    delta = dt - datetime(1970, 1, 1, tzinfo=UTC)
    return (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds


def _emit(out: list[Row], check: str, **fields: Any) -> None:
    out.append({"check": check, "severity": BY_NAME[check].severity.value, **fields})


def _facts(writer_rows: list[Row]) -> list[Row]:
    facts = []
    for r in writer_rows:
        if r.get("kind") not in (None, "fact"):
            continue
        facts.append({
            "stream": r["stream"], "writer": r["writer"], "sid": r["stream_id"],
            "room": r.get("room_id"), "ev": r.get("event_id"), "res": to_micros(r["reserved_at"]),
            "rel": to_micros(r.get("completed_at")), "aborted": r.get("outcome") == "aborted",
        })
    return facts


def _tokens(token_rows: list[Row], known: dict[int, str]) -> dict[tuple, list[Row]]:
    """Token rows per (stream, reader), ordered, with ``parsed``/``reason``/``seq``/``issued``."""
    has_seq = any("seq" in r for r in token_rows)
    chains: dict[tuple, list[Row]] = defaultdict(list)
    for r in token_rows:
        t = dict(r)
        t["issued"] = to_micros(r["issued_at"])
        t["delivered"] = r.get("delivered") or []
        t["parsed"], t["reason"] = parse(r.get("token"), known)
        t["since_parsed"], _ = parse(r.get("since"), known)
        chains[(r["stream"], r["reader"])].append(t)
    for chain in chains.values():
        if has_seq:
            chain.sort(key=lambda t: (t["seq"], t["issued"], t.get("token") is not None, t.get("token") or ""))
        else:
            chain.sort(key=lambda t: (t["issued"], t.get("token") is not None, t.get("token") or ""))
            for i, t in enumerate(chain, 1):
                t["seq"] = i
    return chains


def check(
    writer_rows: list[Row],
    token_rows: list[Row],
    instance_rows: list[Row],
    *,
    first_id: int = DEFAULT_FIRST_ID,
    unresolved_after_s: float = DEFAULT_UNRESOLVED_AFTER_S,
    clock_skew_us: int = 0,
    end_of_log: int | None = None,
) -> Result:
    """Run every check on the given rows.

    Args:
        writer_rows: ``writer_logs`` rows.
        token_rows: ``token_logs`` rows.
        instance_rows: ``instance_map`` rows.
        first_id: stream ids below this are never in the future.
        unresolved_after_s: how old an open reservation must be to be reported.
        clock_skew_us: allowance subtracted from completion times compared with issue times.
        end_of_log: the end of the log in µs (default: the latest timestamp in the input).

    Returns:
        The violations and pending counts.
    """
    known = {r["instance_id"]: r["instance_name"] for r in instance_rows}
    id_of = {name: iid for iid, name in known.items()}
    facts = _facts(writer_rows)
    chains = _tokens(token_rows, known)
    if end_of_log is None:
        times = [f["res"] for f in facts] + [f["rel"] for f in facts if f["rel"] is not None]
        times += [t["issued"] for c in chains.values() for t in c]
        end_of_log = max(times)
    res = Result()
    out = res.violations
    _syntax_checks(chains, out)
    _writer_checks(facts, out, end_of_log - int(unresolved_after_s * 1_000_000))
    by_stream: dict[str, list[Row]] = defaultdict(list)
    for f in facts:
        by_stream[f["stream"]].append(f)
    pending_above = 0
    for (stream, reader), chain in sorted(chains.items()):
        sfacts = by_stream.get(stream, [])
        valid = [t for t in chain if t["parsed"] is not None]
        _token_checks(stream, reader, chain, valid, sfacts, id_of, first_id, clock_skew_us, out)
        res.retried_redeliveries += _delivery_checks(stream, reader, chain, valid, sfacts, id_of,
                                                     clock_skew_us, out)
        pending_above += _undelivered(stream, reader, chain, valid, sfacts, id_of, out)
    res.pending = {
        "in_flight_facts": sum(1 for f in facts if f["rel"] is None),
        "above_reader_watermark": pending_above,
    }
    return res


def _syntax_checks(chains: dict[tuple, list[Row]], out: list[Row]) -> None:
    for (stream, reader), chain in chains.items():
        for i, t in enumerate(chain):
            common = {"stream": stream, "reader": reader, "seq": t["seq"], "token": t.get("token")}
            p: ParsedToken | None = t["parsed"]
            if p is None:
                _emit(out, "malformed_token", reason=t["reason"], **common)
            elif any(pos <= p.min for _, pos in p.components):
                _emit(out, "noncanonical_component", **common)
            if _breaks(chain, i):
                _emit(out, "broken_chain", prev_seq=chain[i - 1]["seq"], **common)


def _writer_checks(facts: list[Row], out: list[Row], unresolved_before: int) -> None:
    by_sid: dict[tuple, list[Row]] = defaultdict(list)
    by_ev: dict[tuple, list[Row]] = defaultdict(list)
    by_writer: dict[tuple, list[Row]] = defaultdict(list)
    by_room: dict[tuple, list[Row]] = defaultdict(list)
    for f in facts:
        by_sid[(f["stream"], f["sid"])].append(f)
        if f["ev"] is not None:
            by_ev[(f["stream"], f["ev"])].append(f)
        by_writer[(f["stream"], f["writer"])].append(f)
        if f["room"] is not None:
            by_room[(f["stream"], f["room"])].append(f)
        common = {"stream": f["stream"], "writer": f["writer"], "stream_id": f["sid"]}
        if f["rel"] is not None and f["rel"] < f["res"]:
            _emit(out, "invalid_interval", **common)
        if f["rel"] is None and f["res"] < unresolved_before:
            _emit(out, "unresolved_reservation", **common)
    for (stream, sid), group in by_sid.items():
        if len(group) > 1:
            _emit(out, "duplicate_stream_id", stream=stream, stream_id=sid)
    for (stream, ev), group in by_ev.items():
        if len(group) > 1:
            _emit(out, "duplicate_event_id", stream=stream, event_id=ev)
    for (stream, writer), group in by_writer.items():
        group = sorted(group, key=lambda f: (f["res"], f["sid"]))
        for a, b in zip(group, group[1:]):
            if b["sid"] < a["sid"]:
                _emit(out, "writer_sid_regression", stream=stream, writer=writer, stream_id=b["sid"])
    for (stream, room), group in by_room.items():
        for f2 in group:
            for f1 in group:
                earlier = (f1["res"], f1["sid"]) < (f2["res"], f2["sid"])
                rel1 = MAX_LONG if f1["rel"] is None else f1["rel"]
                if earlier and f1["writer"] != f2["writer"] and rel1 > f2["res"]:
                    _emit(out, "sharding_violation", stream=stream, room_id=room,
                          writer=f2["writer"], stream_id=f2["sid"])
                    break


def _token_checks(stream: str, reader: str, chain: list[Row], valid: list[Row], sfacts: list[Row],
                  id_of: dict[str, int], first_id: int, skew: int, out: list[Row]) -> None:
    common = {"stream": stream, "reader": reader}
    # gap_skip: the earliest token (by issue time, then seq) that covers the fact.
    for f in sfacts:
        wid = id_of.get(f["writer"])
        covering = [t for t in valid if t["parsed"].eff(wid) >= f["sid"]]
        if not covering:
            continue
        w = min(covering, key=lambda t: (t["issued"], t["seq"]))
        if f["rel"] is None or w["issued"] < f["rel"] - skew:
            _emit(out, "gap_skip", writer=f["writer"], stream_id=f["sid"], seq=w["seq"],
                  token=w["token"], **common)
    # future_position: the claim against the highest id allocated by the issue time.
    base = first_id - 1
    if sfacts:
        base = min(base, min(f["sid"] for f in sfacts) - 1)
    for t in valid:
        g = max([base] + [f["sid"] for f in sfacts if f["res"] <= t["issued"]])
        if t["parsed"].claim > g:
            _emit(out, "future_position", seq=t["seq"], token=t["token"], claimed_pos=t["parsed"].claim,
                  **common)
    # non_monotonic: against the previous valid token.
    for k, j in zip(valid, valid[1:]):
        pk, pj = k["parsed"], j["parsed"]
        if pj.min < pk.min or any(pj.eff(i) < pk.eff(i) for i, _ in pk.components):
            _emit(out, "non_monotonic", seq=j["seq"], token=j["token"], prev_seq=k["seq"], **common)


def _fstar(sfacts: list[Row], ev: str) -> Row | None:
    cands = [f for f in sfacts if f["ev"] == ev]
    if not cands:
        return None
    return min(cands, key=lambda f: (f["sid"], f["writer"], f["res"],
                                     MAX_LONG if f["rel"] is None else f["rel"], f["aborted"]))


def _retried(chain: list[Row], k: int, j: int, f: Row | None, id_of: dict[str, int]) -> bool:
    """Whether re-delivering fact ``f`` at chain index ``j``, last delivered at ``k``, is a retry.

    It is when some request after ``k`` up to ``j`` broke the chain and the ``since`` of the
    request at ``j`` is a valid token that does not cover ``f``: the client resumed from a token
    older than the delivery, so it never saw it.
    """
    if f is None or not any(_breaks(chain, i) for i in range(k + 1, j + 1)):
        return False
    since: ParsedToken | None = chain[j]["since_parsed"]
    return since is not None and since.eff(id_of.get(f["writer"])) < f["sid"]


def _breaks(chain: list[Row], i: int) -> bool:
    """Whether the request at chain index ``i`` broke the chain (``broken_chain``)."""
    since = chain[i].get("since")
    return i > 0 and since is not None and since != chain[i - 1].get("token")


def _delivery_checks(stream: str, reader: str, chain: list[Row], valid: list[Row], sfacts: list[Row],
                     id_of: dict[str, int], skew: int, out: list[Row]) -> int:
    """The delivery checks but ``undelivered``; returns how many re-deliveries were retries."""
    retries = 0
    last: dict[str, int] = {}  # event id -> chain index of its latest delivery
    for j, t in enumerate(chain):
        for ev in t["delivered"]:
            if ev is None:
                continue
            common = {"stream": stream, "reader": reader, "seq": t["seq"], "event_id": ev}
            f = _fstar(sfacts, ev)
            if ev in last:
                if _retried(chain, last[ev], j, f, id_of):
                    retries += 1
                else:
                    _emit(out, "duplicate_delivery", prev_seq=chain[last[ev]]["seq"], **common)
            last[ev] = j
            if f is None:
                _emit(out, "phantom_delivery", **common)
                continue
            if f["aborted"]:
                _emit(out, "aborted_delivery", **common)
            if f["rel"] is None or f["rel"] - skew > t["issued"]:
                _emit(out, "premature_delivery", **common)
            if t["parsed"] is not None:
                wid = id_of.get(f["writer"])
                wm = max(k["parsed"].eff(wid) for k in valid if k["seq"] <= t["seq"])
                if f["sid"] > wm:
                    _emit(out, "delivered_beyond_token", **common)
    return retries


def _undelivered(stream: str, reader: str, chain: list[Row], valid: list[Row], sfacts: list[Row],
                 id_of: dict[str, int], out: list[Row]) -> int:
    if not valid:
        return 0
    delivered = {ev for t in chain for ev in t["delivered"]}
    pending = 0
    for f in sfacts:
        if f["ev"] is None or f["rel"] is None or f["aborted"]:
            continue
        wid = id_of.get(f["writer"])
        covering = [t for t in valid if t["parsed"].eff(wid) >= f["sid"]]
        if not covering:
            pending += 1
            continue
        if f["ev"] in delivered:
            continue
        first = covering[0]
        rooms = first.get("rooms")
        if rooms is None or f["room"] in rooms:
            _emit(out, "undelivered", stream=stream, reader=reader, writer=f["writer"],
                  stream_id=f["sid"], event_id=f["ev"], expected_seq=first["seq"])
    return pending


def load_jsonl(directory: str) -> list[Row]:
    """Read every ``*.json``/``*.jsonl`` file under ``directory`` (with ``stream=`` directories)."""
    rows = []
    for path in sorted(glob.glob(os.path.join(directory, "**", "*.json*"), recursive=True)):
        extra = {}
        for part in os.path.relpath(path, directory).split(os.sep)[:-1]:
            if "=" in part:
                k, v = part.split("=", 1)
                extra[k] = v
        with open(path, encoding="utf-8") as fh:
            rows.extend({**extra, **json.loads(line)} for line in fh if line.strip())
    return rows


def main(argv: list[str] | None = None) -> int:
    """Check a small JSONL log directory and print the violation counts per check."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m spark.reference LOGS_DIR", file=sys.stderr)
        return 2
    logs = argv[0]
    result = check(load_jsonl(os.path.join(logs, "writer_logs")),
                   load_jsonl(os.path.join(logs, "token_logs")),
                   load_jsonl(os.path.join(logs, "instance_map")))
    counts: dict[str, int] = defaultdict(int)
    for v in result.violations:
        counts[v["check"]] += 1
    print(json.dumps({"checks": counts, "pending": result.pending}, indent=2, sort_keys=True))
    return 1 if result.violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
