"""Developer scripts (``scripts/test``, ``scripts/demo``, ``scripts/bench``).

A package only so that ``python -m scripts.benchmarks`` can import the
benchmark harness; the other scripts run as plain files.
"""
