"""Inject one anomaly per check into a clean :class:`spark.generate.Corpus`, recording each.

Every injection is built so that it causes exactly the violations it records: ``primary`` is
the check it targets; a ``primary: false`` entry is an unavoidable companion (a fact delivered
before it completed is also beyond the token that came with it). Writer-only anomalies go to
the ``caches`` stream, which no token refers to, so they cannot disturb the token checks; token
and delivery anomalies each get their own reader and region of that reader's tokens.
"""

from __future__ import annotations

import random
from typing import Any

from .checks import violation_key
from .generate import STREAM, Corpus
from .tokens import encode

HUGE_CLAIM = 10**15


class _Injector:
    def __init__(self, corpus: Corpus, rng: random.Random) -> None:
        self.c = corpus
        self.rng = rng
        self.used: set[tuple[str, int]] = set()
        self.huge = max(f["stream_id"] for f in corpus.facts) + 1000
        self.ids = {w: i for i, w in enumerate(corpus.writer_names, 1)}

    # -- helpers ----------------------------------------------------------------------------
    def record(self, check: str, primary: bool = True, note: str = "", **key: Any) -> None:
        self.c.injected.append({"check": check, "primary": primary, "key": key, "note": note})

    def facts(self, stream: str, pred=lambda f: True) -> list[dict]:
        return [f for f in self.c.facts if f["stream"] == stream
                and (f["stream"], f["stream_id"]) not in self.used and pred(f)]

    def take(self, stream: str, pred=lambda f: True) -> dict:
        cands = self.facts(stream, pred)
        f = cands[len(cands) // 2] if cands else None
        if f is None:
            raise RuntimeError(f"no fact of {stream} fits the injection")
        self.used.add((f["stream"], f["stream_id"]))
        return f

    @staticmethod
    def eff(t: dict, iid: int) -> int:
        lo = min(t["comps"].values())
        return max(lo, t["comps"].get(iid, lo))

    def next_huge(self) -> int:
        self.huge += 1
        return self.huge

    # -- writer-log anomalies (caches stream, except the two that need rooms/event ids) -------
    def writer_anomalies(self) -> None:
        done = lambda f: f["completed_at"] is not None  # noqa: E731
        f = self.take("caches", lambda f: done(f) and f["completed_at"] >= f["reserved_at"] + 2)
        self.c.facts.append(dict(f, event_id=None, reserved_at=f["reserved_at"] + 1))
        self.record("duplicate_stream_id", stream="caches", stream_id=f["stream_id"])

        f = self.take("caches", done)
        f["completed_at"] = f["reserved_at"] - 1
        self.record("invalid_interval", stream="caches", writer=f["writer"], stream_id=f["stream_id"])

        w = self.c.writer_names[0]
        mine = [f for f in self.c.facts if f["stream"] == "caches" and f["writer"] == w]
        mine.sort(key=lambda f: (f["reserved_at"], f["stream_id"]))
        f = mine[len(mine) // 2]
        t = f["reserved_at"] + 1
        later = [g for g in mine if (g["reserved_at"], g["stream_id"]) > (t, self.huge + 1)]
        nxt = min(later, key=lambda g: (g["reserved_at"], g["stream_id"]))
        self.c.facts.append({"stream": "caches", "writer": w, "stream_id": self.next_huge(),
                             "room_id": None, "event_id": None, "reserved_at": t,
                             "completed_at": t + 1, "outcome": "ok", "kind": None})
        self.record("writer_sid_regression", stream="caches", writer=w, stream_id=nxt["stream_id"])

        sid = self.next_huge()
        # Old enough to be unresolved however short the log (the default allowance is 60 s).
        end = max(max(f["reserved_at"], f["completed_at"] or 0) for f in self.c.facts)
        end = max([end, *(t["tau"] for ch in self.c.chains.values() for t in ch)])
        t0 = min(min(f["reserved_at"] for f in self.c.facts), end - 61_000_000) | 1
        self.c.facts.append({"stream": "caches", "writer": "intruder-2", "stream_id": sid,
                             "room_id": None, "event_id": None, "reserved_at": t0,
                             "completed_at": None, "outcome": None, "kind": "fact"})
        self.record("unresolved_reservation", stream="caches", writer="intruder-2", stream_id=sid)

        a = self.take(STREAM, lambda f: f["outcome"] == "aborted" and done(f))
        f = self.take(STREAM, lambda f: f["outcome"] == "ok" and f["stream_id"] < a["stream_id"])
        a["event_id"] = f["event_id"]
        self.record("duplicate_event_id", stream=STREAM, event_id=f["event_id"])

        # A foreign writer writes into a room while its owner's latest long reservation is open.
        # Done late in the log, because its fresh (huge) stream id raises the allocated maximum.
        cands = self.facts(STREAM, lambda f: f["completed_at"] is None
                           or f["completed_at"] - f["reserved_at"] >= 4)
        f1 = max(cands, key=lambda f: f["reserved_at"])
        self.used.add((STREAM, f1["stream_id"]))
        sid = self.next_huge()
        t = f1["reserved_at"] + 1
        self.c.facts.append({"stream": STREAM, "writer": "intruder-1", "stream_id": sid,
                             "room_id": f1["room_id"], "event_id": None, "reserved_at": t,
                             "completed_at": t, "outcome": "aborted", "kind": "fact"})
        self.record("sharding_violation", stream=STREAM, room_id=f1["room_id"], writer="intruder-1",
                    stream_id=sid)

    # -- token and delivery anomalies -------------------------------------------------------
    def token_anomalies(self) -> None:
        plan = [self.undelivered, self.malformed_grammar, self.malformed_duplicate,
                self.malformed_unknown, self.noncanonical, self.broken_chain, self.gap_skip,
                self.non_monotonic, self.phantom, self.aborted_delivery, self.premature,
                self.duplicate_delivery, self.beyond, self.retry]
        readers = sorted(self.c.chains)
        slots = -(-len(plan) // len(readers))
        for k, inject in enumerate(plan):
            reader = readers[k % len(readers)]
            chain = self.c.chains[reader]
            center = (k // len(readers) + 1) * len(chain) // (slots + 1)
            inject(reader, chain, center)
        reader = readers[len(plan) % len(readers)]
        last = self.c.chains[reader][-1]
        last["comps"] = {**last["comps"], len(self.ids) + 1: HUGE_CLAIM}
        last["token"] = encode(last["comps"])
        self.record("future_position", stream=STREAM, reader=reader, seq=last["seq"])

    def _malformed(self, reader: str, chain: list[dict], j: int, text: str, reason: str) -> None:
        chain[j]["token"] = text
        self.record("malformed_token", stream=STREAM, reader=reader, seq=chain[j]["seq"], note=reason)

    def malformed_grammar(self, reader: str, chain: list[dict], j: int) -> None:
        self._malformed(reader, chain, j, "m12~3", "grammar")

    def malformed_duplicate(self, reader: str, chain: list[dict], j: int) -> None:
        lo = min(chain[j]["comps"].values())
        self._malformed(reader, chain, j, f"m{lo}~1.{lo + 1}~1.{lo + 2}", "duplicate_writer_id")

    def malformed_unknown(self, reader: str, chain: list[dict], j: int) -> None:
        lo = min(chain[j]["comps"].values())
        self._malformed(reader, chain, j, f"m{lo}~{len(self.ids) + 7}.{lo + 1}", "unknown_writer_id")

    def noncanonical(self, reader: str, chain: list[dict], j: int) -> None:
        t = chain[j]
        lo = min(t["comps"].values())
        iid = min(i for i, p in t["comps"].items() if p == lo)
        t["token"] = (f"m{lo}~{iid}.{lo}" if t["token"].startswith("s") else f"{t['token']}~{iid}.{lo}")
        self.record("noncanonical_component", stream=STREAM, reader=reader, seq=t["seq"])

    def broken_chain(self, reader: str, chain: list[dict], j: int) -> None:
        wrong = chain[j - 2]["token"]
        chain[j]["since_override"] = wrong if wrong != chain[j - 1]["token"] else "s1"
        self.record("broken_chain", stream=STREAM, reader=reader, seq=chain[j]["seq"])

    def gap_skip(self, reader: str, chain: list[dict], j: int) -> None:
        for jj in range(j, len(chain) - 1):
            tau = chain[jj]["tau"]
            for w, iid in self.ids.items():
                open_ = [f for f in self.c.facts if f["stream"] == STREAM and f["writer"] == w
                         and f["reserved_at"] <= tau
                         and (f["completed_at"] is None or f["completed_at"] > tau)]
                if not open_:
                    continue
                g = min(open_, key=lambda f: f["stream_id"])
                if (STREAM, g["stream_id"]) in self.used or g["stream_id"] <= self.eff(chain[jj], iid):
                    continue
                self.used.add((STREAM, g["stream_id"]))
                for t in chain[jj:]:
                    if self.eff(t, iid) >= g["stream_id"]:
                        break
                    t["comps"] = {**t["comps"], iid: g["stream_id"]}
                    t["token"] = encode(t["comps"])
                self.record("gap_skip", stream=STREAM, reader=reader, writer=w, stream_id=g["stream_id"])
                return
        raise RuntimeError("no open reservation to skip")

    def non_monotonic(self, reader: str, chain: list[dict], j: int) -> None:
        for jj in range(j, len(chain) - 1):
            a, b = chain[jj - 2]["comps"], chain[jj - 1]["comps"]
            if any(a[i] < b[i] for i in b):
                t = chain[jj]
                t["comps"], t["token"] = dict(a), encode(a)
                chain[jj + 1]["delivered"][:0] = t["delivered"]
                t["delivered"] = []
                self.record("non_monotonic", stream=STREAM, reader=reader, seq=t["seq"])
                return
        raise RuntimeError("no token to turn back")

    def phantom(self, reader: str, chain: list[dict], j: int) -> None:
        chain[j]["delivered"].append("$phantom")
        self.record("phantom_delivery", stream=STREAM, reader=reader, seq=chain[j]["seq"],
                    event_id="$phantom")

    def aborted_delivery(self, reader: str, chain: list[dict], j: int) -> None:
        for a in self.facts(STREAM, lambda f: f["outcome"] == "aborted" and f["completed_at"]):
            for t in chain[j: j + 4]:
                if t["tau"] >= a["completed_at"] and self.eff(t, self.ids[a["writer"]]) >= a["stream_id"]:
                    self.used.add((STREAM, a["stream_id"]))
                    t["delivered"].append(a["event_id"])
                    self.record("aborted_delivery", stream=STREAM, reader=reader, seq=t["seq"],
                                event_id=a["event_id"])
                    return
        raise RuntimeError("no aborted fact to deliver")

    def _move_back(self, reader: str, chain: list[dict], j: int, premature: bool) -> None:
        by_ev = {f["event_id"]: f for f in self.facts(STREAM, lambda f: f["event_id"] is not None)}
        for jj in [*range(j, len(chain) - 1), *range(2, j)]:
            prev = chain[jj - 1]
            for ev in chain[jj]["delivered"]:
                f = by_ev.get(ev)
                if f is None or (f["completed_at"] > prev["tau"]) != premature:
                    continue
                self.used.add((STREAM, f["stream_id"]))
                chain[jj]["delivered"].remove(ev)
                prev["delivered"].append(ev)
                key = {"stream": STREAM, "reader": reader, "seq": prev["seq"], "event_id": ev}
                if premature:
                    self.record("premature_delivery", **key)
                self.record("delivered_beyond_token", primary=not premature, **key)
                return
        raise RuntimeError("no delivery to move back")

    def premature(self, reader: str, chain: list[dict], j: int) -> None:
        self._move_back(reader, chain, j, premature=True)

    def beyond(self, reader: str, chain: list[dict], j: int) -> None:
        self._move_back(reader, chain, j, premature=False)

    def duplicate_delivery(self, reader: str, chain: list[dict], j: int) -> None:
        for jj in range(j, len(chain) - 2):
            if chain[jj]["delivered"]:
                ev = chain[jj]["delivered"][0]
                chain[jj + 2]["delivered"].append(ev)
                self.record("duplicate_delivery", stream=STREAM, reader=reader,
                            seq=chain[jj + 2]["seq"], event_id=ev)
                return
        raise RuntimeError("nothing delivered to repeat")

    def retry(self, reader: str, chain: list[dict], j: int) -> None:
        """A client that lost a response retries from its older token: only the break is reported.

        The response to request ``jj`` (token ``lost``) never reached the client, so request
        ``jj + 1`` comes with ``since`` = the token before ``lost`` and is given ``lost``'s facts
        again. That token does not cover them (each fact is delivered with the first token
        covering it), so the re-deliveries are not ``duplicate_delivery``.
        """
        by_ev = {f["event_id"]: f for f in self.facts(STREAM, lambda f: f["event_id"] is not None)}
        for jj in [*range(j, len(chain) - 2), *range(2, j)]:
            old, lost, t = chain[jj - 1], chain[jj], chain[jj + 1]
            if old["token"] == lost["token"] or any(
                    x["token"] != encode(x["comps"]) or "since_override" in x for x in (old, lost, t)):
                continue  # the since must be a valid token and the chain otherwise intact
            again = [ev for ev in lost["delivered"] if ev in by_ev
                     and self.eff(old, self.ids[by_ev[ev]["writer"]]) < by_ev[ev]["stream_id"]]
            if not again:
                continue
            self.used.update((STREAM, by_ev[ev]["stream_id"]) for ev in again)
            t["since_override"] = old["token"]
            t["delivered"][:0] = again
            self.record("broken_chain", primary=False, note="retry: the re-deliveries are no duplicates",
                        stream=STREAM, reader=reader, seq=t["seq"])
            return
        raise RuntimeError("no delivered token to retry")

    def undelivered(self, reader: str, chain: list[dict], j: int) -> None:
        by_ev = {f["event_id"]: f for f in self.facts(STREAM, lambda f: f["event_id"] is not None)}
        for t in chain[j:]:
            for ev in t["delivered"]:
                f = by_ev.get(ev)
                if f is not None:
                    self.used.add((STREAM, f["stream_id"]))
                    t["delivered"].remove(ev)
                    self.record("undelivered", stream=STREAM, reader=reader, writer=f["writer"],
                                stream_id=f["stream_id"], event_id=ev)
                    return
        raise RuntimeError("nothing delivered to drop")


def inject_all(corpus: Corpus, rng: random.Random) -> None:
    """Inject one anomaly per check into ``corpus`` in place, appending to ``corpus.injected``."""
    inj = _Injector(corpus, rng)
    inj.writer_anomalies()
    inj.token_anomalies()


def expected_keys(injected: list[dict[str, Any]]) -> set[tuple]:
    """The violation keys (see :func:`spark.checks.violation_key`) an injection record expects."""
    return {violation_key(i["check"], i["key"]) for i in injected}
