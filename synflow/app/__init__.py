"""Process types: one module per app, each building a service tree.

Only this package touches the global reactor; everything it builds takes the
reactor (and its clock) as a parameter.

Internal to synflow: not part of the public API (``synflow.api``).
"""
