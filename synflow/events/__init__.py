"""Events: persisting, routing, room rules and sync.

Internal to synflow: not part of the public API (``synflow.api``).
"""
