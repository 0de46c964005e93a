"""synflow.metrics: one registry per process, and the kept series of hot paths."""

from __future__ import annotations

from prometheus_client import REGISTRY
from twisted.trial import unittest

from synflow import metrics


class SeriesTest(unittest.TestCase):
    def test_the_child_of_the_same_values_is_labels_own_and_kept(self) -> None:
        counter = metrics.counter("synflow_test_series_total", "series test", ["name", "outcome"])
        calls: list[tuple[str, ...]] = []
        labels = counter.labels

        def counting_labels(*values: str) -> object:
            calls.append(values)
            return labels(*values)

        counter.labels = counting_labels  # type: ignore[method-assign]
        try:
            get = metrics.series(counter)
            first = get("persist_events", "ok")
            self.assertIs(first, labels(name="persist_events", outcome="ok"))  # the values in label order
            self.assertIs(get("persist_events", "ok"), first)
            other = get("persist_events", "500")
            self.assertIsNot(other, first)
            self.assertEqual(calls, [("persist_events", "ok"), ("persist_events", "500")])  # once per values
        finally:
            del counter.labels

    def test_updates_through_a_kept_child_reach_the_registry(self) -> None:
        histogram = metrics.histogram("synflow_test_series_seconds", "series test", ["name", "side"],
                                      buckets=(0.01, 1))
        get = metrics.series(histogram)
        for _ in range(3):
            get("call", "client").observe(0.005)
        get("call", "server").observe(0.5)
        sample = REGISTRY.get_sample_value
        self.assertEqual(sample("synflow_test_series_seconds_count", {"name": "call", "side": "client"}), 3)
        self.assertEqual(sample("synflow_test_series_seconds_bucket", {"name": "call", "side": "client", "le": "0.01"}), 3)
        self.assertEqual(sample("synflow_test_series_seconds_count", {"name": "call", "side": "server"}), 1)
