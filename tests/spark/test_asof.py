"""The bucketed as-of computations that gap_skip and future_position are built on, against brute force."""

from __future__ import annotations

import random

from twisted.trial.unittest import TestCase

from spark import common
from spark.common import INF, asof_max, asof_reaches
from tests.spark._session import spark


def brute(events, queries, inclusive):
    """For each query id, the max v of the events with its key and an earlier (or equal) time."""
    out = {}
    for qid, key, t, *_ in queries:
        vs = [v for k, et, v in events if k == key and (et <= t if inclusive else et < t)]
        out[qid] = max(vs) if vs else None
    return out


def draw(rng: random.Random, n_events: int, n_queries: int):
    """Events and queries on a few keys, with clustered times (ties, shared buckets, empty ones).

    Each query also carries a threshold ``x`` (for :func:`asof_reaches`), spread around the
    values of the events.
    """
    keys = ["a", "b", "c"]  # "c" has queries only
    times = [rng.randrange(0, 400) for _ in range(40)]
    events = [(rng.choice(keys[:2]), rng.choice(times) + rng.randrange(0, 3), rng.randrange(-5, 1000))
              for _ in range(n_events)]
    queries = []
    for qid in range(n_queries):
        t = rng.choice([INF, -50, 2000, *times, *(x + 1 for x in times)])
        queries.append((qid, rng.choice(keys), t, rng.randrange(-10, 1010)))
    return events, queries


class AsofTests(TestCase):
    """asof_max and asof_reaches give the brute-force answers whatever the bucket width."""

    def _check(self, events, queries, bucket_us, inclusive):
        session = spark()
        ev = session.createDataFrame(events, "k string, t long, v long")
        q = session.createDataFrame(queries, "qid long, k string, t long, x long")
        want = brute(events, queries, inclusive)
        got = {r["qid"]: r["best"] for r in asof_max(ev, q, ["k"], bucket_us, inclusive, few_rows=10).collect()}
        self.assertEqual(got, want, (bucket_us, inclusive))
        reached = sorted(r["qid"] for r in asof_reaches(ev, q, ["k"], bucket_us, inclusive, "x", few_rows=10).collect())
        self.assertEqual(reached, sorted(qid for qid, _, _, x in queries if want[qid] is not None and want[qid] >= x),
                         (bucket_us, inclusive))

    def test_against_brute_force(self):
        """Random events and queries (ties, a key without events, INF and out-of-range times) agree for several widths."""
        rng = random.Random(3)
        events, queries = draw(rng, 150, 200)
        for bucket_us in (1, 7, 50, 10_000):
            for inclusive in (False, True):
                self._check(events, queries, bucket_us, inclusive)

    def test_reaches_decided_in_every_way(self):
        """Queries are dropped by the bound through their bucket, kept by the bound before it, and decided
        by an event of their own bucket; each way occurs here."""
        session = spark()
        # Bucket width 10: events at 5 (v=3), 15 (v=7) and 17 (v=20).
        ev = session.createDataFrame([("a", 5, 3), ("a", 15, 7), ("a", 17, 20)], "k string, t long, v long")
        q = session.createDataFrame([
            (1, "a", 25, 21),   # upper bound 20 < 21: dropped by the bound
            (2, "a", 12, 3),    # bound before its bucket is 3 >= 3: kept by the bound
            (3, "a", 16, 7),    # own bucket: the event at 15 (v=7) decides: kept
            (4, "a", 16, 8),    # own bucket: only v=7 before t=16 < 8: dropped
            (5, "a", 17, 20),   # own bucket, tie at t=17: strict, so 20 does not count
            (6, "a", INF, 20),  # after everything: 20 >= 20
            (7, "a", 4, -100),  # before every event: no answer, so never kept
        ], "qid long, k string, t long, x long")
        got = sorted(r["qid"] for r in asof_reaches(ev, q, ["k"], 10, False, "x", few_rows=3).collect())
        self.assertEqual(got, [2, 3, 6])
        got = sorted(r["qid"] for r in asof_reaches(ev, q, ["k"], 10, True, "x", few_rows=3).collect())
        self.assertEqual(got, [2, 3, 5, 6])

    def test_width_grows_to_bound_the_buckets(self):
        """With a small bucket budget the buckets widen, and the answer is unchanged."""
        self.patch(common, "MAX_BUCKETS", 16)
        rng = random.Random(4)
        events, queries = draw(rng, 120, 150)
        for inclusive in (False, True):
            self._check(events, queries, 1, inclusive)

    def test_no_events(self):
        """Without any event every query's answer is null and no query reaches anything."""
        session = spark()
        ev = session.createDataFrame([], "k string, t long, v long")
        q = session.createDataFrame([(1, "a", 5, 0), (2, "a", INF, -5)], "qid long, k string, t long, x long")
        got = {r["qid"]: r["best"] for r in asof_max(ev, q, ["k"], 1, False, few_rows=10).collect()}
        self.assertEqual(got, {1: None, 2: None})
        self.assertEqual(asof_reaches(ev, q, ["k"], 1, False, "x", few_rows=10).collect(), [])
