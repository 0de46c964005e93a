"""Command-line tools: synflowctl, the client, the workload and Prometheus helpers.

Internal to synflow: not part of the public API (``synflow.api``).
"""
