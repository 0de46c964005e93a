"""Read receipts and room statistics for synflow, written against ``synflow.api`` alone.

* :mod:`synflow_receipts.receipts` -- the ``receipts`` stream and the
  ``receipt_writer`` worker type that writes it, sharded by room;
* :mod:`synflow_receipts.stats` -- ``room_stats``, a consumer of the
  ``events`` and ``receipts`` streams that serves per-room counts.
"""
