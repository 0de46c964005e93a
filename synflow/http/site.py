"""Listener sites: a root that dispatches by path prefix, plus /health and /metrics.

Every synflow process serves ``/health`` (200 when started and connected to
replication and the database, 503 with the reasons otherwise) and Prometheus
``/metrics`` on its internal listener and on its ``metrics`` listener; the
client API and inbound federation are mounted on their listeners.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.twisted import MetricsResource
from twisted.web.resource import Resource
from twisted.web.server import Request

from synflow.http.server import JsonSite


class PrefixRoot(Resource):
    """Hands each request to the resource registered for its longest matching path prefix."""

    def __init__(self) -> None:
        super().__init__()
        self.mounts: list[tuple[bytes, Resource]] = []

    def mount(self, prefix: str, resource: Any) -> None:
        self.mounts.append((prefix.encode(), resource))
        self.mounts.sort(key=lambda m: -len(m[0]))

    def getChildWithDefault(self, path: bytes, request: Request) -> Resource:
        full = request.path
        for prefix, resource in self.mounts:
            if full == prefix or full.startswith(prefix.rstrip(b"/") + b"/"):
                # Leaf resources see the path after their prefix as postpath.
                rest = full[len(prefix):].strip(b"/")
                request.postpath = rest.split(b"/") if rest else []
                return resource
        return _NotFound()

    def render(self, request: Request) -> bytes:
        return _NotFound().render(request)


class _NotFound(Resource):
    isLeaf = True

    def render(self, request: Request) -> bytes:
        request.setResponseCode(404)
        request.setHeader(b"Content-Type", b"application/json")
        return b'{"errcode":"M_UNRECOGNIZED","error":"unrecognized request"}'


class HealthResource(Resource):
    """``/health``: 200 ``{"status": "ok"}`` or 503 with the problems."""

    isLeaf = True

    def __init__(self, check: Callable[[], list[str]], details: Callable[[], dict[str, Any]] | None = None) -> None:
        super().__init__()
        self.check = check
        self.details = details

    def render_GET(self, request: Request) -> bytes:
        problems = self.check()
        body: dict[str, Any] = {"status": "ok" if not problems else "unhealthy", "problems": problems}
        if self.details is not None:
            body.update(self.details())
        request.setResponseCode(200 if not problems else 503)
        request.setHeader(b"Content-Type", b"application/json")
        return json.dumps(body).encode()


def build_site(mounts: dict[str, Resource], *, health: HealthResource, max_body_bytes: int) -> JsonSite:
    """A site serving ``mounts`` plus /health and /metrics."""
    root = PrefixRoot()
    for prefix, resource in mounts.items():
        root.mount(prefix, resource)
    root.mount("/health", health)
    metrics = MetricsResource(registry=REGISTRY)
    metrics.isLeaf = True
    root.mount("/metrics", metrics)
    return JsonSite(root, max_body_bytes=max_body_bytes)
