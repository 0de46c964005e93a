"""Prometheus metrics, one registry per process (the Prometheus convention).

Modules get their metrics through :func:`counter`, :func:`gauge` and
:func:`histogram`, which return the existing metric when one of that name is
already registered (so a module imported twice, or several test instances in
one process, do not clash). Every process serves ``/metrics`` from
:data:`REGISTRY` (see ``synflow/http/``).

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram

_metrics: dict[str, Any] = {}


def _get(kind: type, name: str, doc: str, labels: Sequence[str], **kwargs: Any) -> Any:
    metric = _metrics.get(name)
    if metric is None:
        metric = _metrics[name] = kind(name, doc, list(labels), registry=REGISTRY, **kwargs)
    elif not isinstance(metric, kind):
        raise TypeError(f"metric {name} already registered as {type(metric).__name__}")
    return metric


def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
    """A counter called ``name`` (``synflow_`` prefix recommended)."""
    return _get(Counter, name, doc, labels)


def gauge(name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
    """A gauge called ``name``."""
    return _get(Gauge, name, doc, labels)


def histogram(name: str, doc: str, labels: Sequence[str] = (), buckets: Sequence[float] | None = None) -> Histogram:
    """A histogram called ``name``."""
    kwargs = {"buckets": list(buckets)} if buckets is not None else {}
    return _get(Histogram, name, doc, labels, **kwargs)
