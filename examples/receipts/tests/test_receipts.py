"""synflow-receipts' own tests: the receipts stream and both worker types run synflow's conformance kit.

Run with the package installed beside synflow::

    pip install ./examples/receipts
    python -m twisted.trial examples/receipts/tests/test_receipts.py

(synflow's own suite runs them too, through ``tests/test_examples.py``.)
"""

from __future__ import annotations

from twisted.trial.unittest import TestCase

from synflow.testing.conformance import StreamConformance, WorkerTypeConformance
from synflow_receipts.receipts import RECEIPTS, ReceiptRow, ReceiptWriter
from synflow_receipts.stats import RoomStats


class ReceiptsStreamConformanceTest(StreamConformance, TestCase):
    """The receipts stream: wire round trip, positions after commit, catch-up, tokens, the validator's checks."""

    stream = RECEIPTS

    def sample_rows(self) -> list[ReceiptRow]:
        return [ReceiptRow(f"!room{n}:hs", f"@user{n % 3}:hs", f"$event{n}:hs") for n in range(12)]

    def malformed_wire_rows(self) -> list[object]:
        return [None, {}, [], ["!r:hs", "@u:hs"], ["!r:hs", "@u:hs", 3], ["!r:hs", None, "$e:hs"],
                ["!r:hs", "@u:hs", "$e:hs", "extra"]]


class ReceiptWriterConformanceTest(WorkerTypeConformance, TestCase):
    """receipt_writer: described, registered, its ``receipts:`` section checked like synflow's own."""

    worker_type = ReceiptWriter
    config_yaml = "receipts:\n  max_list: 50\n"


class RoomStatsConformanceTest(WorkerTypeConformance, TestCase):
    """room_stats: described, registered, the streams it follows registered."""

    worker_type = RoomStats
