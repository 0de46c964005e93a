"""Replication: the line protocol, its connection core, the TCP hub and client, Redis, the handler.

Internal to synflow: not part of the public API (``synflow.api``).
"""
