"""``codec``: parse and encode of replication lines, ops/s, against bare ``str.split`` + ``json``.

The lines are those a busy deployment carries: RDATA of the events stream
(numeric and ``batch`` tokens), RDATA of the caches stream (keyed and whole-
cache invalidations), POSITION and PING.

* synflow, parse: :func:`~synflow.replication.commands.parse_line` on the
  UTF-8 bytes, then, for RDATA, the stream's ``Row.from_wire`` (what a reader
  does with every row);
* synflow, encode: build the command from a row object (``row.to_wire()``)
  and :func:`~synflow.replication.commands.encode_line_bytes`;
* ceiling, parse: ``bytes.decode``, ``str.split`` into the same fields,
  ``json.loads`` of the row and ``int`` of the tokens;
* ceiling, encode: ``json.dumps`` (compact) of the same wire list, an
  f-string and ``str.encode``.

Beside the ceiling, the same lines go through **Synapse's own codec**
(``synapse.replication.tcp.commands``, when matrix-synapse is importable: it
is in the ``test`` extra), codec against codec, in the same process and in
alternating rounds:

* parse: ``bytes.decode`` and ``parse_command_from_line`` (what Synapse's
  ``lineReceived`` does) against :func:`parse_line` on the bytes;
* encode: build the command from its fields (the row as its wire list) and
  turn it into bytes as Synapse's ``send_command`` does (``"%s %s" % (NAME,
  to_line())``, the newline check, ``str.encode``, the length check) against
  the same command classes of synflow's and :func:`encode_line_bytes`.

Neither side builds row objects here: Synapse's streams define other row
shapes, so the comparison stops at the codec.

Each side runs over the same 20,000-line mix; timings interleave the two and
keep the best of several passes (standard for micro-benchmarks: the minimum
is the least disturbed by other load), measured in this thread's CPU time so
that time spent descheduled on a busy machine does not count.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from typing import Any

from scripts.benchmarks.common import Progress
from synflow import registry
from synflow.replication.commands import (
    PingCommand,
    PositionCommand,
    RdataCommand,
    encode_line_bytes,
    parse_line,
)
from synflow.streams import CachesRow, EventsRow

TARGETS = [
    {"row": "codec.mix", "field": "ratio", "op": ">=", "threshold": 0.8,
     "label": "≥ 0.8 of bare split + json (parse + encode, mixed lines)"},
    {"row": "codec.synapse", "field": "ratio", "op": ">=", "threshold": 1.5,
     "label": "≥ 1.5× Synapse's codec (parse + encode, mixed lines)"},
]

KINDS = ("rdata_events", "rdata_caches", "position", "ping")
MIX = {"rdata_events": 0.5, "rdata_caches": 0.2, "position": 0.2, "ping": 0.1}


def make_commands(n: int, seed: int = 1) -> list[tuple[str, Any, Any]]:
    """``n`` (kind, command, row object or None) in the mixed proportions."""
    rng = random.Random(seed)
    out: list[tuple[str, Any, Any]] = []
    for i in range(n):
        kind = rng.choices(list(MIX), weights=list(MIX.values()))[0]
        token = 1_000_000 + i
        row: Any
        cmd: Any
        if kind == "rdata_events":
            member = rng.random() < 0.1
            row = EventsRow(f"$ev{i}AbCdEf:example.com", f"!room{i % 97}:example.com",
                            "m.room.member" if member else "m.room.message",
                            f"@user{i % 50}:example.com" if member else None,
                            f"@user{i % 50}:example.com", "join" if member else None)
            cmd = RdataCommand("events", "event_persister1", None if rng.random() < 0.1 else token, row.to_wire())
        elif kind == "rdata_caches":
            keys = None if rng.random() < 0.1 else (f"!room{i % 97}:example.com", f"@user{i % 50}:example.com")
            row = CachesRow("get_current_state", keys, 1_700_000_000_000 + i)
            cmd = RdataCommand("caches", "master", token, row.to_wire())
        elif kind == "position":
            row = None
            cmd = PositionCommand("events", "event_persister2", token - 5, token)
        else:
            row = None
            cmd = PingCommand(str(1_700_000_000_000 + i))
        out.append((kind, cmd, row))
    return out


# -- synflow --------------------------------------------------------------------------------


def synflow_parse(lines: list[bytes]) -> None:
    streams: dict[str, Any] = registry.streams()
    for line in lines:
        cmd = parse_line(line)
        if type(cmd) is RdataCommand:
            streams[cmd.stream_name].row_type.from_wire(cmd.row)


def synflow_encode(items: list[tuple[str, Any, Any]]) -> None:
    for _kind, cmd, row in items:
        if row is not None:
            cmd = RdataCommand(cmd.stream_name, cmd.instance_name, cmd.token, row.to_wire())
        encode_line_bytes(cmd)


# -- ceiling --------------------------------------------------------------------------------


def bare_parse(lines: list[bytes]) -> None:
    loads = json.loads
    for raw in lines:
        text = raw.decode("utf-8")
        name, _, args = text.partition(" ")
        if name == "RDATA":
            stream, instance, token, row = args.split(" ", 3)
            loads(row)
            if token != "batch":
                int(token)
        elif name == "POSITION":
            stream, instance, prev, new = args.split(" ")
            int(prev)
            int(new)


def bare_encode(items: list[tuple[str, Any, Any]]) -> None:
    dumps = json.dumps
    for _kind, cmd, row in items:
        if row is not None:
            token = "batch" if cmd.token is None else cmd.token
            f"RDATA {cmd.stream_name} {cmd.instance_name} {token} {dumps(cmd.row, separators=(',', ':'))}".encode()
        elif type(cmd) is PositionCommand:
            f"POSITION {cmd.stream_name} {cmd.instance_name} {cmd.prev_token} {cmd.new_token}".encode()
        else:
            f"PING {cmd.data}".encode()


# -- Synapse's codec ---------------------------------------------------------------------------


def import_synapse() -> tuple[Any, str]:
    """Synapse's replication commands module, or None and why it cannot be imported."""
    try:
        from synapse.util import check_dependencies

        # Importing Synapse checks its optional dependencies' pins and exits on a
        # mismatch (synflow needs txredisapi 1.6, Synapse pins < 1.6); the codec
        # needs none of them.
        check_dependencies.check_requirements = lambda extra=None: None
        import synapse.replication.tcp.commands as synapse_commands
    except Exception as e:  # not installed, or an import-time failure of its own
        return None, f"Synapse is not importable ({type(e).__name__}: {e}); install the test extra"
    return synapse_commands, ""


def synapse_parse(syn: Any) -> Callable[[list[bytes]], None]:
    parse = syn.parse_command_from_line

    def run(lines: list[bytes]) -> None:
        for line in lines:
            parse(line.decode("utf-8"))

    return run


def synapse_encode(syn: Any) -> Callable[[list[tuple[str, Any, Any]]], None]:
    rdata, position, ping = syn.RdataCommand, syn.PositionCommand, syn.PingCommand

    def run(items: list[tuple[str, Any, Any]]) -> None:
        for kind, cmd, _row in items:
            if kind == "position":
                c = position(cmd.stream_name, cmd.instance_name, cmd.prev_token, cmd.new_token)
            elif kind == "ping":
                c = ping(cmd.data)
            else:
                c = rdata(cmd.stream_name, cmd.instance_name, cmd.token, cmd.row)
            string = "%s %s" % (c.NAME, c.to_line())  # noqa: UP031 -- Synapse's own formatting
            if "\n" in string:
                raise ValueError(string)
            data = string.encode("utf-8")
            if len(data) > 16384:
                raise ValueError(string)

    return run


def synflow_codec_parse(lines: list[bytes]) -> None:
    for line in lines:
        parse_line(line)


def synflow_codec_encode(items: list[tuple[str, Any, Any]]) -> None:
    for kind, cmd, _row in items:
        if kind == "position":
            c: Any = PositionCommand(cmd.stream_name, cmd.instance_name, cmd.prev_token, cmd.new_token)
        elif kind == "ping":
            c = PingCommand(cmd.data)
        else:
            c = RdataCommand(cmd.stream_name, cmd.instance_name, cmd.token, cmd.row)
        encode_line_bytes(c)


def compare_synapse(syn: Any, items: list[tuple[str, Any, Any]], passes: int) -> dict[str, Any]:
    """synflow's codec against Synapse's on the same lines, alternating rounds; lines/s of each."""
    lines = [encode_line_bytes(cmd) for _k, cmd, _r in items]
    for line in lines[:200]:  # the same text on both sides
        back = syn.parse_command_from_line(line.decode("utf-8"))
        assert f"{back.NAME} {back.to_line()}".encode() == line, line
    fns = {"syn_parse": (synflow_codec_parse, lines), "synapse_parse": (synapse_parse(syn), lines),
           "syn_encode": (synflow_codec_encode, items), "synapse_encode": (synapse_encode(syn), items)}
    t = dict.fromkeys(fns, float("inf"))
    for _ in range(3):
        for key, (fn, arg) in fns.items():
            t[key] = min(t[key], _best(fn, arg, passes // 3 + 1))
    n = len(items)
    return {"synflow": n / (t["syn_parse"] + t["syn_encode"]), "synapse": n / (t["synapse_parse"] + t["synapse_encode"]),
            **{k: n / v for k, v in t.items()}}


def _best(fn: Callable[[Any], None], arg: Any, passes: int) -> float:
    # CPU time of this thread, not wall time: on a shared machine the wall
    # clock also counts the time other processes held the core.
    best = float("inf")
    for _ in range(passes):
        t = time.thread_time()
        fn(arg)
        best = min(best, time.thread_time() - t)
    return best


def check_equivalent(items: list[tuple[str, Any, Any]]) -> None:
    """The ceiling's encoder produces exactly synflow's bytes (so the work compared is the same)."""
    for _kind, cmd, row in items[:200]:
        expected = encode_line_bytes(cmd)
        if row is not None:
            token = "batch" if cmd.token is None else cmd.token
            got = f"RDATA {cmd.stream_name} {cmd.instance_name} {token} {json.dumps(cmd.row, separators=(',', ':'))}"
        elif type(cmd) is PositionCommand:
            got = f"POSITION {cmd.stream_name} {cmd.instance_name} {cmd.prev_token} {cmd.new_token}"
        else:
            got = f"PING {cmd.data}"
        assert got.encode() == expected, (got, expected)


def run(quick: bool, progress: Progress) -> dict[str, Any]:
    n = 20_000
    passes = 5 if quick else 9
    items = make_commands(n)
    check_equivalent(items)
    rows = []
    timings: dict[str, dict[str, float]] = {}
    groups = {"mix": items, **{k: [it for it in items if it[0] == k] for k in KINDS}}
    for name, group in groups.items():
        lines = [encode_line_bytes(cmd) for _k, cmd, _r in group]
        t: dict[str, float] = {"syn_parse": float("inf"), "syn_encode": float("inf"),
                               "bare_parse": float("inf"), "bare_encode": float("inf")}
        for _ in range(3):  # interleave synflow and the ceiling
            t["syn_parse"] = min(t["syn_parse"], _best(synflow_parse, lines, passes // 3 + 1))
            t["bare_parse"] = min(t["bare_parse"], _best(bare_parse, lines, passes // 3 + 1))
            t["syn_encode"] = min(t["syn_encode"], _best(synflow_encode, group, passes // 3 + 1))
            t["bare_encode"] = min(t["bare_encode"], _best(bare_encode, group, passes // 3 + 1))
        count = len(group)
        timings[name] = {k: count / v for k, v in t.items()}
        syn = count / (t["syn_parse"] + t["syn_encode"])
        bare = count / (t["bare_parse"] + t["bare_encode"])
        label = "mixed lines" if name == "mix" else name.replace("_", " ")
        rows.append({"key": f"codec.{name}", "label": f"parse + encode, {label}", "unit": "lines/s",
                     "value": syn, "ceiling": bare, "ceiling_label": "str.split + json.loads/dumps",
                     "ratio": syn / bare})
        for op in (("parse", "encode") if name == "mix" else ()):
            rows.append({"key": f"codec.{name}.{op}", "label": f"{op}, {label}", "unit": "lines/s",
                         "value": timings[name][f"syn_{op}"], "ceiling": timings[name][f"bare_{op}"],
                         "ceiling_label": "bare", "ratio": timings[name][f"syn_{op}"] / timings[name][f"bare_{op}"]})
        progress(f"{label}: synflow {syn:,.0f} lines/s, bare {bare:,.0f} lines/s, ratio {syn / bare:.2f}")
    extra: dict[str, Any] = {"ops_per_s": timings, "lines": n}
    synapse, why = import_synapse()
    label = "parse + encode, mixed lines, codec only: synflow vs Synapse's replication codec"
    if synapse is None:
        progress(f"Synapse's codec: skipped: {why}")
        rows.append({"key": "codec.synapse", "label": label, "unit": "lines/s", "value": None, "ceiling": None,
                     "ratio": None, "note": f"skipped: {why}"})
    else:
        got = compare_synapse(synapse, items, passes)
        extra["synapse"] = got
        rows.append({"key": "codec.synapse", "label": label, "unit": "lines/s", "value": got["synflow"],
                     "ceiling": got["synapse"], "ceiling_label": "Synapse, same lines", "ratio": got["synflow"] / got["synapse"]})
        progress(f"Synapse's codec: synflow {got['synflow']:,.0f} lines/s, Synapse {got['synapse']:,.0f} lines/s, "
                 f"ratio {got['synflow'] / got['synapse']:.2f}")
    return {"rows": rows, "targets": TARGETS, "extra": extra}
