"""synflow: one server as many cooperating Twisted processes.

The public API is :mod:`synflow.api` (``from synflow import api``): what a
worker type or stream author imports, declared in its ``__all__``. The
conformance kit for plugins is :mod:`synflow.testing.conformance`. Every
other module of this package is internal and may change between releases.
"""
