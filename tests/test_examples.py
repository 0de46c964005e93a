"""The example package's own tests (``examples/receipts/tests/``), run in synflow's suite.

The package is registered from its checkout (its ``pyproject.toml`` entry
points; ``tests.plugins.install_example``) for each test, so the conformance
kit finds its worker types and stream as it would once installed.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from tests.plugins import EXAMPLE, install_example


def _load(path: str, name: str):
    """Import the example's test module (and through it synflow_receipts) from the checkout.

    The checkout is on ``sys.path`` only while importing: left there, a
    ``.egg-info`` an in-tree build may leave would register the example for
    every later test.
    """
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, EXAMPLE)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(EXAMPLE)
    return module


_receipts = _load(os.path.join(EXAMPLE, "tests", "test_receipts.py"), "synflow_receipts_tests")


class _Registered:
    def setUp(self) -> None:
        install_example(self, on_path=False)
        super().setUp()  # type: ignore[misc]


class ReceiptsStreamConformanceTest(_Registered, _receipts.ReceiptsStreamConformanceTest):
    __doc__ = _receipts.ReceiptsStreamConformanceTest.__doc__


class ReceiptWriterConformanceTest(_Registered, _receipts.ReceiptWriterConformanceTest):
    __doc__ = _receipts.ReceiptWriterConformanceTest.__doc__


class RoomStatsConformanceTest(_Registered, _receipts.RoomStatsConformanceTest):
    __doc__ = _receipts.RoomStatsConformanceTest.__doc__
