"""Prometheus metrics, one registry per process (the Prometheus convention).

Modules get their metrics through :func:`counter`, :func:`gauge` and
:func:`histogram`, which return the existing metric when one of that name is
already registered (so a module imported twice, or several test instances in
one process, do not clash). Every process serves ``/metrics`` from
:data:`REGISTRY` (see ``synflow/http/``). A labelled metric updated on a hot
path (per request, per RPC, per transaction) is reached through
:func:`series`, which keeps each child it hands out.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


def series(metric: Any) -> Callable[..., Any]:
    """``get(*values)``: ``metric.labels(*values)`` (values in the metric's label order), kept per values.

    ``labels()`` checks its arguments, converts and joins them under the
    metric's lock on every call (about four times the cost of the
    ``inc()`` that follows); the child it returns is the same object each
    time, so it is kept here after the first call. The series a hot path
    names are few (handler and RPC names, outcomes, status codes), so the
    dict grows as the metric's own does. Not for a metric whose series are
    removed (``remove``, ``clear``): a kept child would outlive its series.
    """
    children: dict[tuple[str, ...], Any] = {}
    labels = metric.labels

    def get(*values: str) -> Any:
        child = children.get(values)
        if child is None:
            child = children[values] = labels(*values)
        return child

    return get
