"""The bucketed as-of maximum that gap_skip and future_position are built on, against brute force."""

from __future__ import annotations

import random

from twisted.trial.unittest import TestCase

from spark import common
from spark.common import INF, asof_max
from tests.spark._session import spark


def brute(events, queries, inclusive):
    """For each query id, the max v of the events with its key and an earlier (or equal) time."""
    out = {}
    for qid, key, t in queries:
        vs = [v for k, et, v in events if k == key and (et <= t if inclusive else et < t)]
        out[qid] = max(vs) if vs else None
    return out


def draw(rng: random.Random, n_events: int, n_queries: int):
    """Events and queries on a few keys, with clustered times (ties, shared buckets, empty ones)."""
    keys = ["a", "b", "c"]  # "c" has queries only
    times = [rng.randrange(0, 400) for _ in range(40)]
    events = [(rng.choice(keys[:2]), rng.choice(times) + rng.randrange(0, 3), rng.randrange(-5, 1000))
              for _ in range(n_events)]
    queries = []
    for qid in range(n_queries):
        t = rng.choice([INF, -50, 2000, *times, *(x + 1 for x in times)])
        queries.append((qid, rng.choice(keys), t))
    return events, queries


class AsofMaxTests(TestCase):
    """asof_max gives the brute-force answer whatever the bucket width and whichever side is small."""

    def _check(self, events, queries, bucket_us, inclusive):
        session = spark()
        ev = session.createDataFrame(events, "k string, t long, v long")
        q = session.createDataFrame(queries, "qid long, k string, t long")
        for few in ("events", "queries"):
            got = {r["qid"]: r["best"]
                   for r in asof_max(ev, q, ["k"], bucket_us, inclusive, few, few_rows=10).collect()}
            self.assertEqual(got, brute(events, queries, inclusive), (bucket_us, inclusive, few))

    def test_against_brute_force(self):
        """Random events and queries (ties, a key without events, INF and out-of-range times) agree for several widths."""
        rng = random.Random(3)
        events, queries = draw(rng, 150, 200)
        for bucket_us in (1, 7, 50, 10_000):
            for inclusive in (False, True):
                self._check(events, queries, bucket_us, inclusive)

    def test_width_grows_to_bound_the_buckets(self):
        """With a small bucket budget the buckets widen, and the answer is unchanged."""
        self.patch(common, "MAX_BUCKETS", 16)
        rng = random.Random(4)
        events, queries = draw(rng, 120, 150)
        for inclusive in (False, True):
            self._check(events, queries, 1, inclusive)

    def test_no_events(self):
        """Without any event every query's answer is null."""
        session = spark()
        ev = session.createDataFrame([], "k string, t long, v long")
        q = session.createDataFrame([(1, "a", 5), (2, "a", INF)], "qid long, k string, t long")
        for few in ("events", "queries"):
            got = {r["qid"]: r["best"] for r in asof_max(ev, q, ["k"], 1, False, few, few_rows=10).collect()}
            self.assertEqual(got, {1: None, 2: None})
