"""Pure tests of the validator's building blocks: token grammar, reference checker, generator."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from spark import reference
from spark.checks import CHECK_NAMES, fails
from spark.generate import Config, generate
from spark.inject import expected_keys
from spark.tokens import encode, parse

KNOWN = {1: "w1", 2: "w2", 3: "w3"}
T = 1_700_000_000_000_000


def fact(sid, writer="w1", room=None, ev=None, res=0, rel=1, outcome="ok", stream="events"):
    """A writer_logs fact row with times in seconds after T."""
    return {"stream": stream, "writer": writer, "stream_id": sid, "room_id": room or f"!{writer}",
            "event_id": ev if ev is not None else f"$e{sid}", "reserved_at": T + res * 10**6,
            "completed_at": None if rel is None else T + rel * 10**6, "outcome": outcome}


def token(seq, text, at, delivered=(), reader="r", rooms=None):
    """A token_logs row issued ``at`` seconds after T."""
    return {"reader": reader, "stream": "events", "seq": seq, "token": text,
            "issued_at": T + at * 10**6, "delivered": list(delivered), "rooms": rooms}


INSTANCES = [{"instance_id": i, "instance_name": n} for i, n in KNOWN.items()]


def checks(writers, tokens):
    """The set of check names the reference reports."""
    return {v["check"] for v in reference.check(writers, tokens, INSTANCES).violations}


class TokenGrammarTests(SynchronousTestCase):
    """The token grammar shared by the reference checker and the generator."""

    def test_valid_forms(self):
        """`s<N>`, `m<min>~id.pos…`, a bare `m<min>` and a trailing `~` all parse."""
        self.assertEqual(parse("s7", KNOWN)[0].claim, 7)
        p, _ = parse("m5~1.9~3.7", KNOWN)
        self.assertEqual((p.min, p.eff(1), p.eff(2), p.eff(3), p.claim), (5, 9, 5, 7, 9))
        self.assertEqual(parse("m5~", KNOWN)[0].components, ())
        self.assertEqual(parse("m5~1.6~", KNOWN)[0].eff(1), 6)

    def test_malformed_reasons(self):
        """Each kind of bad token is rejected with its reason."""
        cases = {None: "empty", "": "empty", "t3-4": "topological", "5": "grammar",
                 "m5~1": "grammar", "m5~1.2.3": "grammar", "s99999999999999999999": "overflow",
                 "m5~9999999999.6": "overflow", "m5~1.6~1.7": "duplicate_writer_id",
                 "m5~4.6": "unknown_writer_id", "s５": "grammar"}
        for text, reason in cases.items():
            self.assertEqual(parse(text, KNOWN), (None, reason), text)

    def test_encode_lists_only_writers_ahead(self):
        """The canonical token lists only writers above the minimum, ids ascending."""
        self.assertEqual(encode({2: 9, 1: 5, 3: 7}), "m5~2.9~3.7")
        self.assertEqual(encode({1: 4, 2: 4}), "s4")

    def test_fail_on(self):
        """`--fail-on warning` fails on warnings; `error` only on errors; `never` never."""
        self.assertTrue(fails("warning", "warning"))
        self.assertFalse(fails("warning", "error"))
        self.assertTrue(fails("error", "error"))
        self.assertFalse(fails("error", "never"))


class ReferenceCheckerTests(SynchronousTestCase):
    """The brute-force checker's definitions on hand-made histories."""

    def test_clean_handover_passes(self):
        """A room moving to a new writer after the old one released its last fact is fine."""
        writers = [fact(2, "w1", room="!r", res=0, rel=5), fact(3, "w2", room="!r", res=5, rel=6)]
        self.assertEqual(checks(writers, [token(1, "s1", 0)]), set())

    def test_overlapping_writers_violate_sharding(self):
        """A second writer reserving in a room while the first is open is a sharding violation."""
        writers = [fact(2, "w1", room="!r", res=0, rel=5), fact(3, "w2", room="!r", res=4, rel=6)]
        self.assertIn("sharding_violation", checks(writers, [token(1, "s1", 0)]))

    def test_gap_skip_and_pending(self):
        """Covering an unfinished fact is gap_skip (and, never delivered, undelivered); above the final position it is pending."""
        writers = [fact(2, "w1", res=0, rel=10), fact(3, "w2", res=1, rel=2)]
        tokens = [token(1, "m1~2.3", 3, ["$e3"]), token(2, "m1~1.2~2.3", 5)]
        result = reference.check(writers, tokens, INSTANCES)
        self.assertEqual({v["check"] for v in result.violations}, {"gap_skip", "undelivered"})
        self.assertEqual(result.pending["above_reader_watermark"], 0)
        result = reference.check(writers, tokens[:1], INSTANCES)
        self.assertEqual(result.violations, [])
        self.assertEqual(result.pending["above_reader_watermark"], 1)

    def test_in_flight_fact_is_pending(self):
        """A fact still in flight at the end of the log is neither undelivered nor an error."""
        writers = [fact(2, "w1", res=0, rel=1), fact(3, "w1", res=2, rel=None, outcome=None)]
        result = reference.check(writers, [token(1, "s2", 3, ["$e2"])], INSTANCES)
        self.assertEqual(result.violations, [])
        self.assertEqual(result.pending["in_flight_facts"], 1)

    def test_rooms_limit_undelivered(self):
        """With `rooms`, a fact of a room the reader is not in is not expected."""
        writers = [fact(2, "w1", room="!a", res=0, rel=1), fact(3, "w1", room="!b", res=1, rel=2)]
        self.assertEqual(checks(writers, [token(1, "s3", 5, ["$e2"], rooms=["!a"])]), set())
        self.assertEqual(checks(writers, [token(1, "s3", 5, ["$e2"])]), {"undelivered"})

    def test_future_position(self):
        """Claiming an id nobody reserved yet is future_position; an idle leap to the top is not."""
        writers = [fact(2, "w1", res=0, rel=1), fact(3, "w2", res=0, rel=1)]
        self.assertEqual(checks(writers, [token(1, "s3", 2, ["$e2", "$e3"])]), set())
        self.assertEqual(checks(writers, [token(1, "m3~1.4", 2, ["$e2", "$e3"])]), {"future_position"})


class GeneratorTests(SynchronousTestCase):
    """The generator's clean logs are clean and each injection is exactly what it records."""

    def test_clean_logs_are_clean(self):
        """The reference checker finds nothing in clean generated logs."""
        for seed in (1, 2):
            c = generate(Config(facts=800, readers=3, tokens_per_reader=40, inject=False, seed=seed))
            self.assertEqual(reference.check(c.writer_rows(), c.token_rows(), c.instances).violations, [])

    def test_injections_are_exact(self):
        """With injections, the reference reports exactly the recorded violations, every check covered."""
        for seed, kw in ((3, {}), (4, {"with_seq": False, "rooms_readers": 2})):
            c = generate(Config(facts=1000, readers=4, tokens_per_reader=50, seed=seed, **kw))
            got = reference.check(c.writer_rows(), c.token_rows(), c.instances).keys()
            self.assertEqual(got, expected_keys(c.injected))
            self.assertEqual({i["check"] for i in c.injected if i["primary"]}, set(CHECK_NAMES))
