"""The Spark job agrees with the brute-force reference checker on hypothesis-generated histories.

Histories are small and deliberately chaotic (colliding ids, ties in time, junk tokens,
duplicate and phantom deliveries, rooms, broken chains), drawn by hypothesis without Spark and
then validated together in one Spark run, each under its own stream name. The draw is
derandomized (the same histories on every run), so the test cannot be flaky, and it asserts
that the histories exercise every check.
"""

from __future__ import annotations

import json
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import TestCase

from spark import reference
from spark.checks import CHECK_NAMES, violation_key
from spark.generate import iso
from spark.tokens import encode
from tests.spark._session import spark, summary, validate, violations

T = 1_700_000_000_000_000
UNIT = 5_000_000  # 5 s: histories span up to ~3 minutes, so some reservations are unresolved
WRITERS = ["w1", "w2", "w3", "wx"]  # wx is not in instance_map
INSTANCES = [{"instance_id": i, "instance_name": f"w{i}"} for i in (1, 2, 3)]
EVENTS = [f"$e{i}" for i in range(1, 8)]
JUNK = ["", "x", "m", "t1-2", "m5~1", "m3~1.4~1.5", "m2~7.3", "s99999999999999999999", "12"]


@st.composite
def facts(draw):
    """One writer_logs fact row (times in UNIT steps)."""
    res = draw(st.integers(0, 30))
    rel = draw(st.one_of(st.none(), st.integers(res - 2, res + 8)))
    return {"writer": draw(st.sampled_from(WRITERS)), "stream_id": draw(st.integers(1, 9)),
            "room_id": draw(st.sampled_from([None, "!r1", "!r2"])),
            "event_id": draw(st.sampled_from([None, *EVENTS])), "reserved_at": T + res * UNIT,
            "completed_at": None if rel is None else T + rel * UNIT,
            "outcome": draw(st.sampled_from([None, "ok", "ok", "aborted"]))}


@st.composite
def token_text(draw):
    """A token: mostly well-formed (possibly non-canonical), sometimes junk."""
    kind = draw(st.sampled_from(["s", "m", "m", "enc", "junk"]))
    lo = draw(st.integers(0, 9))
    if kind == "s":
        return f"s{lo}"
    if kind == "junk":
        return draw(st.sampled_from(JUNK))
    comps = draw(st.dictionaries(st.integers(1, 3), st.integers(0, 11), max_size=3))
    if kind == "enc" and comps:
        return encode(comps)
    return f"m{lo}" + "".join(f"~{i}.{p}" for i, p in comps.items()) + draw(st.sampled_from(["", "~"]))


@st.composite
def chain(draw):
    """One reader's token rows (seq 1..n, issue times not necessarily increasing)."""
    rows, prev, older = [], None, None
    for seq in range(1, draw(st.integers(1, 5)) + 1):
        text = draw(token_text())
        at = draw(st.integers(0, 36))
        rows.append({"seq": seq, "token": text, "issued_at": iso(T + at * UNIT) if at % 2 else T + at * UNIT,
                     "delivered": draw(st.lists(st.sampled_from(["$zz", *EVENTS]), max_size=3)),
                     "rooms": draw(st.one_of(st.none(), st.lists(st.sampled_from(["!r1", "!r2"]), max_size=2))),
                     "since": draw(st.sampled_from([prev, prev, None, "s0", older]))})
        prev, older = text, prev  # a retry comes with an older since
    return rows


@st.composite
def history(draw):
    """Facts and readers' tokens of one stream."""
    return draw(st.lists(facts(), max_size=8)), draw(st.lists(chain(), min_size=1, max_size=2))


def draw_histories(n: int) -> list:
    """Draw ``n`` histories with hypothesis (no Spark involved), the same ones on every run."""
    drawn: list = []

    @settings(max_examples=n, database=None, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(history())
    def collect(h):
        drawn.append(h)

    collect()
    return drawn[:n]


def to_rows(histories):
    """Namespace each history under its own stream (and a writer-only companion stream)."""
    writers, tokens = [], []
    for i, (fs, chains) in enumerate(histories):
        for j, f in enumerate(fs):
            writers.append(dict(f, stream=f"h{i}c" if j % 5 == 4 else f"h{i}"))
        for r, rows in enumerate(chains):
            tokens += [dict(row, reader=f"reader{r}", stream=f"h{i}") for row in rows]
    return writers, tokens


class AgreementTests(TestCase):
    """Spark and the reference checker report the same violations and pending counts."""

    def test_spark_matches_reference(self):
        """On 60 hypothesis-drawn histories (derandomized) validated in one Spark job, every violation key agrees."""
        spark()
        writers, tokens = to_rows(draw_histories(60))
        logs, out = self._write_logs(writers, tokens), self.mktemp()
        code = validate(logs, out, "--bucket-s", "7", "--fail-on", "never")
        self.assertEqual(code, 0, summary(out).get("error"))
        expected = reference.check(writers, tokens, INSTANCES)
        got = {violation_key(r["check"], r) for r in violations(out)}
        self.assertEqual(sorted(got - expected.keys()), [], "reported by Spark only")
        self.assertEqual(sorted(expected.keys() - got), [], "reported by the reference only")
        self.assertEqual(summary(out)["pending"], expected.pending)
        # The histories exercise every check: each one is expected somewhere.
        self.assertEqual(set(CHECK_NAMES) - {k[0] for k in expected.keys()}, set())
        # ... and both sides of the retry rule: re-deliveries after a chain break that are
        # retries (the since does not cover the fact) and that are still duplicates.
        self.assertGreater(expected.retried_redeliveries, 0)
        breaks = {(v["stream"], v["reader"], v["seq"]) for v in expected.violations if v["check"] == "broken_chain"}
        self.assertTrue([v for v in expected.violations if v["check"] == "duplicate_delivery" and any(
            (v["stream"], v["reader"], s) in breaks for s in range(v["prev_seq"] + 1, v["seq"] + 1))])

    def test_retry_from_an_older_since(self):
        """A re-delivery after a retry whose since does not cover the fact is no duplicate; other repeats are.

        Each case is its own stream: $a (stream id 2) then $b (3) are delivered with s2 and s3 at
        seq 1 and 2; what follows differs.
        """
        spark()
        cases = {
            # The master was killed after issuing s3 with $b: the client retries with since=s2.
            "retry": [("s2", ["$b"])],
            # The retried request's since covers the re-delivered fact.
            "covered": [("s2", ["$a"])],
            # A re-delivery without a chain break.
            "unbroken": [("s3", ["$b"])],
            # A retry (fine), then a third delivery repeating the retry's without a new break.
            "third": [("s2", ["$b"]), ("s3", ["$b"])],
        }
        writers, tokens = [], []
        for stream, rest in cases.items():
            writers += [{"stream": stream, "writer": "w1", "stream_id": sid, "room_id": "!r", "event_id": ev,
                         "reserved_at": T + sid, "completed_at": T + sid + 1, "outcome": "ok"}
                        for sid, ev in ((2, "$a"), (3, "$b"))]
            rows = [("s2", None, ["$a"]), ("s3", "s2", ["$b"])] + [("s3", since, d) for since, d in rest]
            tokens += [{"reader": "r", "stream": stream, "seq": seq, "token": text, "issued_at": T + UNIT + seq,
                        "delivered": d, "since": since} for seq, (text, since, d) in enumerate(rows, 1)]
        logs, out = self._write_logs(writers, tokens), self.mktemp()
        self.assertEqual(validate(logs, out, "--fail-on", "never"), 0, summary(out).get("error"))
        got = sorted((r["check"], r["stream"], r["seq"], r["event_id"], r["prev_seq"]) for r in violations(out))
        self.assertEqual(got, [
            ("broken_chain", "covered", 3, None, 2),
            ("broken_chain", "retry", 3, None, 2),
            ("broken_chain", "third", 3, None, 2),
            ("duplicate_delivery", "covered", 3, "$a", 1),
            ("duplicate_delivery", "third", 4, "$b", 3),
            ("duplicate_delivery", "unbroken", 3, "$b", 2),
        ])
        expected = reference.check(writers, tokens, INSTANCES)
        self.assertEqual({violation_key(r["check"], r) for r in violations(out)}, set(expected.keys()))

    def test_duplicate_delivery_does_not_hide_an_undelivered_fact(self):
        """One fact delivered twice and its neighbour never: both the duplicate and the loss are reported."""
        spark()
        writers = [{"stream": "s", "writer": "w1", "stream_id": sid, "room_id": "!r", "event_id": ev,
                    "reserved_at": T + sid, "completed_at": T + sid + 1, "outcome": "ok"}
                   for sid, ev in ((1, "$a"), (2, "$b"))]
        tokens = [{"reader": "r", "stream": "s", "seq": seq, "token": "s2", "issued_at": T + UNIT,
                   "delivered": ["$a"]} for seq in (1, 2)]
        logs, out = self._write_logs(writers, tokens), self.mktemp()
        self.assertEqual(validate(logs, out, "--fail-on", "never"), 0, summary(out).get("error"))
        got = sorted((r["check"], r["event_id"]) for r in violations(out))
        self.assertEqual(got, [("duplicate_delivery", "$a"), ("undelivered", "$b")])
        expected = reference.check(writers, tokens, INSTANCES)
        self.assertEqual({violation_key(r["check"], r) for r in violations(out)}, set(expected.keys()))

    def _write_logs(self, writers: list, tokens: list) -> str:
        """Write the rows as JSONL audit logs (with the instance map); return the directory."""
        logs = self.mktemp()
        for name, rows in (("writer_logs", writers), ("token_logs", tokens), ("instance_map", INSTANCES)):
            os.makedirs(os.path.join(logs, name))
            with open(os.path.join(logs, name, "part-0.jsonl"), "w", encoding="utf-8") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in rows)
        return logs
