"""Vector-clock stream tokens: grammar, round trip and algebra."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from synflow.errors import TokenError
from synflow.tokens import StreamToken

positions = st.integers(min_value=0, max_value=2**40)
clocks = st.dictionaries(st.integers(min_value=1, max_value=8), positions, min_size=1, max_size=6)


@st.composite
def tokens(draw):
    clock = draw(clocks)
    minimum = draw(st.integers(min_value=0, max_value=min(clock.values())))
    return StreamToken.from_positions(clock, minimum)


IDS = range(1, 9)

MALFORMED = [
    ("", "empty token"),
    ("m", "expected m<min>"),
    ("m~", "expected m<min>"),
    ("mx", "expected m<min>"),
    ("m1~a.2", "expected m<min>"),
    ("m1~2", "expected m<min>"),
    ("m1~2.", "expected m<min>"),
    ("m1~.2", "expected m<min>"),
    ("m1~~2.3", "expected m<min>"),
    ("m1~2.3.4", "expected m<min>"),
    ("m1~2.3~4.5~", None),  # a trailing ~ is accepted
    ("m5~1.3", "not greater than the minimum"),
    ("m5~1.5", "not greater than the minimum"),
    ("m1~2.3~2.4", "appears twice"),
    ("m1~2.5~1.3", None),  # any order on input; canonical on output
    ("s", "expected s<N>"),
    ("s-1", "expected s<N>"),
    ("s05", "expected s<N>"),
    ("s1.5", "expected s<N>"),
    ("s٣", "expected s<N>"),
    (" s5", "starts with 's' or 'm'"),
    ("s5 ", "expected s<N>"),
    ("t3-5", "starts with 's' or 'm'"),
    ("5", "starts with 's' or 'm'"),
    ("s99999999999999999999", "expected s<N>"),
    ("s9999999999999999999", "does not fit in 64 bits"),
    ("m1~3000000000.5", "out of range"),
    ("s" + "1" * 5000, "characters long"),
]


class GrammarTest(SynchronousTestCase):
    def test_examples(self):
        """Tokens print as s<N> when no writer is ahead, else m<min>~id.pos in id order."""
        self.assertEqual(str(StreamToken.at(5)), "s5")
        token = StreamToken.from_positions({3: 59, 2: 58, 1: 56})
        self.assertEqual(str(token), "m56~2.58~3.59")
        self.assertEqual(StreamToken.parse("m56~2.58~3.59"), token)
        self.assertEqual(StreamToken.parse("m5~"), StreamToken.at(5))
        self.assertEqual(str(StreamToken.parse("m1~2.5~1.3")), "m1~1.3~2.5")
        self.assertEqual(StreamToken.from_positions({1: 7, 2: 7}), StreamToken.at(7))

    def test_malformed(self):
        """Every malformed shape is rejected with a message naming the problem."""
        rejected = 0
        for text, fragment in MALFORMED:
            if fragment is None:
                StreamToken.parse(text)
                continue
            with self.assertRaises(TokenError, msg=text[:40]) as cm:
                StreamToken.parse(text)
            self.assertIn(fragment, str(cm.exception), text[:40])
            rejected += 1
        self.assertGreaterEqual(rejected, 15)

    @given(st.text(max_size=40))
    def test_arbitrary_text_only_token_errors(self, text):
        """Any string parses to a token or raises TokenError, nothing else."""
        try:
            token = StreamToken.parse(text)
        except TokenError:
            return
        self.assertEqual(StreamToken.parse(str(token)), token)


class AlgebraTest(SynchronousTestCase):
    @given(tokens())
    def test_round_trip(self, token):
        """parse(str(t)) == t for every token."""
        self.assertEqual(StreamToken.parse(str(token)), token)

    @given(tokens(), tokens())
    def test_le_is_pointwise(self, a, b):
        """a <= b exactly when every writer's effective position in a is at most b's."""
        pointwise = a.minimum <= b.minimum and all(a.get(i) <= b.get(i) for i in IDS)
        self.assertEqual(a.is_before_or_eq(b), pointwise)

    @given(tokens(), tokens(), tokens())
    def test_partial_order(self, a, b, c):
        """<= is reflexive, antisymmetric and transitive."""
        self.assertTrue(a <= a)
        if a <= b and b <= a:
            self.assertEqual(a, b)
        if a <= b and b <= c:
            self.assertTrue(a <= c)

    @given(tokens(), tokens(), tokens())
    def test_merge_is_least_upper_bound(self, a, b, c):
        """merge(a, b) is an upper bound of both and below every other upper bound."""
        m = a.merge(b)
        self.assertTrue(a <= m and b <= m)
        if a <= c and b <= c:
            self.assertTrue(m <= c)
        self.assertEqual(m, b.merge(a))
        for i in IDS:
            self.assertEqual(m.get(i), max(a.get(i), b.get(i)))

    @given(tokens(), st.integers(min_value=1, max_value=8), positions)
    def test_advance_never_goes_back(self, token, instance_id, pos):
        """advance moves one writer forward and leaves the others where they were."""
        moved = token.advance(instance_id, pos)
        self.assertEqual(moved.get(instance_id), max(token.get(instance_id), pos))
        self.assertTrue(token <= moved)


class ParseCacheTest(SynchronousTestCase):
    def test_cache_is_bounded_and_keeps_results(self):
        """Parsed texts are remembered up to a bound (then the cache starts again) and long texts never are;
        a remembered text parses to the same token, and a malformed text is refused every time."""
        from synflow import tokens

        self.addCleanup(tokens._parsed.clear)
        tokens._parsed.clear()
        for n in range(tokens._CACHED_TOKENS + 10):
            self.assertEqual(StreamToken.parse(f"m{n}~1.{n + 1}"), StreamToken(n, ((1, n + 1),)))
            self.assertLessEqual(len(tokens._parsed), tokens._CACHED_TOKENS)
        self.assertIs(StreamToken.parse("m5~1.6"), StreamToken.parse("m5~1.6"))
        long = "m1" + "".join(f"~{i}.{10**15 + i}" for i in range(2, 40))
        self.assertGreater(len(long), tokens._CACHED_TEXT_LENGTH)
        self.assertEqual(str(StreamToken.parse(long)), long)
        self.assertNotIn(long, tokens._parsed)
        for _ in range(2):
            with self.assertRaises(TokenError):
                StreamToken.parse("m5~1.5")
        self.assertNotIn("m5~1.5", tokens._parsed)
