"""HTTP: the JSON framework, the client API, internal RPC and listener sites.

Internal to synflow: not part of the public API (``synflow.api``).
"""
