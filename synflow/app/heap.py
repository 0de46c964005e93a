"""The process's heap and the garbage collector: start-up objects frozen, pauses measured.

CPython's cyclic collector stops the process while it walks a generation. A
full collection walks every tracked object; in a master that is tens of
thousands built at start-up (modules, classes, services) plus the caches,
and it pauses the reactor thread -- every request in flight held -- for
tens of milliseconds. synflow processes started by twistd therefore

* freeze the start-up heap once the process has started
  (:func:`freeze_startup_heap`, :func:`gc.freeze`): those objects live as
  long as the process and are never walked again; what it allocates later
  is collected as usual;
* time every collection (:func:`watch_collections`) into the histogram
  ``synflow_gc_pause_seconds{generation}`` and report the frozen count as
  ``synflow_gc_frozen_objects``.

Test processes, which start and stop many services in one interpreter, do
neither unless a test asks.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

from synflow.metrics import gauge, histogram

logger = logging.getLogger(__name__)

__all__: list[str] = []

_PAUSE = histogram(
    "synflow_gc_pause_seconds", "Time the process stood still in one garbage collection, by generation",
    ["generation"], buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
)
_FROZEN = gauge("synflow_gc_frozen_objects", "Objects moved out of the collector's reach at start-up (gc.freeze)")
_by_generation = [_PAUSE.labels(generation=str(g)) for g in range(3)]
_started: list[float] = [0.0]


def _on_collection(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _started[0] = time.perf_counter()
    else:
        _by_generation[info["generation"]].observe(time.perf_counter() - _started[0])


def watch_collections() -> None:
    """Time every collection of this process into ``synflow_gc_pause_seconds`` (once; later calls do nothing)."""
    if _on_collection not in gc.callbacks:
        gc.callbacks.append(_on_collection)


def freeze_startup_heap() -> int:
    """Collect once, then move every object alive now out of the collector's reach; returns how many."""
    gc.collect()
    gc.freeze()
    count = gc.get_freeze_count()
    _FROZEN.set(count)
    logger.info("start-up heap frozen: %d objects out of the garbage collector's reach", count)
    return count
