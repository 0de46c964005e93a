"""Tests of the caching layer: ``@cached``, the registry, the shared tier and the invalidator."""
