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


def token(seq, text, at, delivered=(), reader="r", rooms=None, since=None):
    """A token_logs row issued ``at`` seconds after T."""
    return {"reader": reader, "stream": "events", "seq": seq, "token": text,
            "issued_at": T + at * 10**6, "delivered": list(delivered), "rooms": rooms, "since": since}


def retry_history(third, fourth=None):
    """$e2 then $e3 delivered in order (seq 1, 2), then request 3 (and 4) as given.

    ``third``/``fourth`` are ``(since, delivered)``; the tokens are s3 from seq 2 on.
    """
    writers = [fact(2, res=0, rel=1), fact(3, res=1, rel=2)]
    tokens = [token(1, "s2", 3, ["$e2"]), token(2, "s3", 4, ["$e3"], since="s2"),
              token(3, "s3", 5, third[1], since=third[0])]
    if fourth is not None:
        tokens.append(token(4, "s3", 6, fourth[1], since=fourth[0]))
    return [(v["check"], v["seq"], v.get("event_id"))
            for v in reference.check(writers, tokens, INSTANCES).violations]


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


class RetryTests(SynchronousTestCase):
    """A re-delivery after a retry from a `since` older than the earlier delivery is no duplicate."""

    def test_retry_from_an_older_since_is_not_a_duplicate(self):
        """The response of seq 2 was lost: seq 3 asks with since=s2, which does not cover $e3, and gets it again."""
        self.assertEqual(retry_history(("s2", ["$e3"])), [("broken_chain", 3, None)])

    def test_since_covering_the_fact_is_a_duplicate(self):
        """A broken chain whose since already covers the re-delivered fact does not excuse it."""
        self.assertEqual(sorted(retry_history(("s2", ["$e2"]))),
                         [("broken_chain", 3, None), ("duplicate_delivery", 3, "$e2")])
        # An equivalent spelling of the covering token is still a break, and still covers $e3.
        self.assertEqual(sorted(retry_history(("m2~1.3", ["$e3"]))),
                         [("broken_chain", 3, None), ("duplicate_delivery", 3, "$e3")])

    def test_redelivery_without_a_break_is_a_duplicate(self):
        """Without a chain break, a re-delivery is a duplicate."""
        self.assertEqual(retry_history(("s3", ["$e3"])), [("duplicate_delivery", 3, "$e3")])
        self.assertEqual(retry_history((None, ["$e3"])), [("duplicate_delivery", 3, "$e3")])

    def test_since_that_is_no_valid_token_is_no_evidence(self):
        """A break earlier than the re-delivery, whose own since is null or malformed, leaves a duplicate."""
        self.assertEqual(sorted(retry_history(("s2", []), (None, ["$e3"]))),
                         [("broken_chain", 3, None), ("duplicate_delivery", 4, "$e3")])
        self.assertEqual(sorted(retry_history(("s2", []), ("m2~9.1", ["$e3"]))),
                         [("broken_chain", 3, None), ("broken_chain", 4, None),
                          ("duplicate_delivery", 4, "$e3")])

    def test_break_before_the_request_counts(self):
        """The break may come at an earlier request after the delivery; the since of the re-delivering one decides."""
        writers = [fact(2, res=0, rel=1), fact(3, res=1, rel=2)]
        # seq 3 breaks the chain and is (wrongly) turned back to s2; seq 4 resumes from it.
        tokens = [token(1, "s2", 3, ["$e2"]), token(2, "s3", 4, ["$e3"], since="s2"),
                  token(3, "s2", 5, [], since="s2"), token(4, "s3", 6, ["$e3"], since="s2")]
        self.assertEqual(sorted((v["check"], v["seq"]) for v in
                                reference.check(writers, tokens, INSTANCES).violations),
                         [("broken_chain", 3), ("non_monotonic", 3)])
        tokens[3]["since"] = "s3"  # covers $e3: with a break in between, still a duplicate
        self.assertEqual(sorted((v["check"], v["seq"]) for v in
                                reference.check(writers, tokens, INSTANCES).violations),
                         [("broken_chain", 3), ("broken_chain", 4), ("duplicate_delivery", 4),
                          ("non_monotonic", 3)])

    def test_each_repeat_is_judged_against_the_one_before(self):
        """A retry's re-delivery is fine; a third delivery without a new break repeats the second."""
        writers = [fact(2, res=0, rel=1), fact(3, res=1, rel=2)]
        tokens = [token(1, "s2", 3, ["$e2"]), token(2, "s3", 4, ["$e3"], since="s2"),
                  token(3, "s3", 5, ["$e3"], since="s2"), token(4, "s3", 6, ["$e3"], since="s3"),
                  token(5, "s3", 7, ["$e3"], since="s2")]
        got = reference.check(writers, tokens, INSTANCES)
        self.assertEqual(sorted((v["check"], v["seq"], v.get("prev_seq")) for v in got.violations),
                         [("broken_chain", 3, 2), ("broken_chain", 5, 4), ("duplicate_delivery", 4, 3)])
        self.assertEqual(got.retried_redeliveries, 2)


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

    def test_retry_injection(self):
        """The injected retry re-delivers facts after a chain break; only the break is reported."""
        c = generate(Config(facts=1000, readers=4, tokens_per_reader=50, seed=3))
        retry = [i["key"] for i in c.injected if i["note"].startswith("retry")]
        self.assertEqual(len(retry), 1)
        rows = [r for r in c.token_rows() if r["reader"] == retry[0]["reader"]]
        j = next(i for i, r in enumerate(rows) if r["seq"] == retry[0]["seq"])
        self.assertEqual(rows[j]["since"], rows[j - 2]["token"])
        self.assertTrue(set(rows[j - 1]["delivered"]) & set(rows[j]["delivered"]))
        self.assertGreater(reference.check(c.writer_rows(), c.token_rows(), c.instances).retried_redeliveries, 0)
