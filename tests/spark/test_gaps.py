"""Gap records: history the logs say they lost is unverifiable, not a violation.

A clean generated corpus loses some facts of one writer and some tokens of one reader, as a full
disk would make synflow lose them. Without gap records the validator reports what the loss
causes; with the gap records synflow writes it passes, reports the gaps in ``summary.json`` and
counts the unverifiable rows instead. A loss outside the reported window is still a violation.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

from twisted.trial.unittest import TestCase

from spark.generate import Config, generate, write_jsonl
from tests.spark._session import summary, validate, violations


def _us(value: Any) -> int:
    if isinstance(value, int):
        return value
    return int(datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() * 1_000_000)


def _read(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _write(path: str, rows: list[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


class GapTest(TestCase):
    timeout = 600

    def _corpus(self) -> str:
        logs = os.path.abspath(self.mktemp())
        write_jsonl(generate(Config(facts=400, cache_facts=20, readers=3, tokens_per_reader=30,
                                    rooms_readers=1, inject=False, seed=7)), logs)
        return logs

    def _lose(self, logs: str, with_gaps: bool, gap_names_another_reader: bool = False) -> dict[str, Any]:
        """Drop delivered facts of one writer and a delivering token of one reader; maybe add gap records."""
        wpath = os.path.join(logs, "writer_logs", "part-00000.jsonl")
        tpath = os.path.join(logs, "token_logs", "stream=events", "part-00000.jsonl")
        facts, tokens = _read(wpath), _read(tpath)
        delivered = {e for t in tokens for e in t["delivered"]}
        events = [f for f in facts if f.get("kind") in (None, "fact") and f["stream"] == "events"
                  and f["event_id"] in delivered and f["outcome"] == "ok"]
        writer = events[0]["writer"]
        mine = [f for f in events if f["writer"] == writer]
        lost = mine[len(mine) // 2: len(mine) // 2 + 4]
        lost_ids = {f["stream_id"] for f in lost}
        facts = [f for f in facts if not (f.get("writer") == writer and f.get("stream_id") in lost_ids)]
        reader = tokens[0]["reader"]
        chain = [t for t in tokens if t["reader"] == reader]
        lost_token = next(t for t in chain[len(chain) // 2:] if t["delivered"])
        tokens = [t for t in tokens if t is not lost_token]
        if with_gaps:
            facts.append({"kind": "gap", "stream": "events", "writer": writer,
                          "from_stream_id": min(lost_ids), "to_stream_id": max(lost_ids),
                          "lost_from": min(_us(f["reserved_at"]) for f in lost),
                          "lost_until": max(_us(f["completed_at"]) for f in lost),
                          "records": len(lost), "facts": len(lost), "error": "No space left on device"})
            issued = _us(lost_token["issued_at"])
            others = sorted({t["reader"] for t in tokens} - {reader})
            tokens.append({"kind": "gap", "issued_by": lost_token["issued_by"],
                           "readers": others[:1] if gap_names_another_reader else [reader],
                           "lost_from": issued, "lost_until": issued, "records": 1,
                           "error": "No space left on device"})
        _write(wpath, facts)
        _write(tpath, tokens)
        return {"writer": writer, "lost_ids": lost_ids, "reader": reader, "token": lost_token}

    def test_losses_without_gap_records_are_violations(self) -> None:
        """Facts and tokens missing without a gap record are phantom deliveries, broken chains, undelivered."""
        logs = self._corpus()
        lost = self._lose(logs, with_gaps=False)
        out = self.mktemp()
        self.assertEqual(validate(logs, out), 1)
        found = {r["check"] for r in violations(out)}
        self.assertIn("phantom_delivery", found)
        self.assertIn("broken_chain", found)
        self.assertIn("undelivered", found)
        self.assertTrue(all(r["reader"] == lost["reader"] for r in violations(out) if r["check"] == "undelivered"))

    def test_losses_inside_reported_gaps_are_unverifiable(self) -> None:
        """With synflow's gap records the run passes, lists the gaps and counts what they make unverifiable."""
        logs = self._corpus()
        lost = self._lose(logs, with_gaps=True)
        out = self.mktemp()
        self.assertEqual(validate(logs, out, "--fail-on", "warning"), 0, violations(out))
        s = summary(out)
        (wgap,) = s["gaps"]["writer_logs"]
        self.assertEqual((wgap["writer"], wgap["from_stream_id"], wgap["to_stream_id"]),
                         (lost["writer"], min(lost["lost_ids"]), max(lost["lost_ids"])))
        (tgap,) = s["gaps"]["token_logs"]
        self.assertEqual(tgap["readers"], 1)
        unverifiable = s["gaps"]["unverifiable"]
        self.assertGreater(unverifiable.get("phantom_delivery", 0), 0)
        self.assertEqual(unverifiable.get("broken_chain"), 1)
        self.assertGreater(unverifiable.get("undelivered", 0), 0)
        with open(os.path.join(out, "report.md"), encoding="utf-8") as f:
            self.assertIn("Gaps (the logs could not record part of the history)", f.read())

    def test_a_gap_of_another_reader_leaves_the_loss_a_violation(self) -> None:
        """A token gap naming another reader does not excuse this reader's broken chain and undelivered facts."""
        logs = self._corpus()
        lost = self._lose(logs, with_gaps=True, gap_names_another_reader=True)
        out = self.mktemp()
        self.assertEqual(validate(logs, out), 1)
        rows = violations(out)
        self.assertEqual({r["check"] for r in rows}, {"broken_chain", "undelivered"})
        self.assertEqual({r["reader"] for r in rows}, {lost["reader"]})
