"""Listener sites: a root that dispatches by path prefix, plus /health and /metrics where asked.

A site serves exactly what is mounted on it; any other path is 404
``M_UNRECOGNIZED``. ``/health`` (200 when started and connected to
replication and the database -- ``"status": "degraded"`` with the reasons when
something non-fatal is wrong, such as an audit log that cannot write -- 503
with the reasons otherwise) and Prometheus
``/metrics`` are mounted only on the listeners that name the ``health`` and
``metrics`` resources (synflow/listeners.py).

A mounted resource may declare its own body limit as ``max_body_bytes``
(inbound federation ``/send`` does): the site then buffers bodies up to the
largest limit and applies, to each request, the limit of the resource its
path reaches -- the listener's limit for everything else.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.twisted import MetricsResource
from twisted.web.resource import Resource, getChildForRequest
from twisted.web.server import Request

from synflow.http.server import JsonSite, LimitedRequest


class PrefixRoot(Resource):
    """Hands each request to the resource registered for its longest matching path prefix."""

    def __init__(self) -> None:
        super().__init__()
        self.mounts: list[tuple[bytes, Resource]] = []

    def mount(self, prefix: str, resource: Any) -> None:
        self.mounts.append((prefix.encode(), resource))
        self.mounts.sort(key=lambda m: -len(m[0]))

    def _match(self, full: bytes) -> tuple[bytes, Resource] | None:
        for prefix, resource in self.mounts:
            if full == prefix or full.startswith(prefix.rstrip(b"/") + b"/"):
                return prefix, resource
        return None

    def body_limit_for(self, path: bytes) -> int | None:
        """The ``max_body_bytes`` declared by the resource serving ``path``, if it declares one."""
        match = self._match(path)
        return getattr(match[1], "max_body_bytes", None) if match is not None else None

    def resource_for(self, request: Request) -> Resource:
        """The resource serving ``request`` (:class:`~synflow.http.server.LimitedRequest` asks directly).

        The same resource twisted.web's walk from this root finds: the mounted
        one, then, if it is not a leaf, its children along the rest of the path.
        """
        return getChildForRequest(self.getChildWithDefault(b"", request), request)

    def getChildWithDefault(self, path: bytes, request: Request) -> Resource:
        full = request.path
        match = self._match(full)
        if match is None:
            return _NotFound()
        prefix, resource = match
        # Leaf resources see the path after their prefix as postpath.
        rest = full[len(prefix):].strip(b"/")
        request.postpath = rest.split(b"/") if rest else []
        return resource

    def render(self, request: Request) -> bytes:
        return _NotFound().render(request)


class _NotFound(Resource):
    isLeaf = True

    def render(self, request: Request) -> bytes:
        request.setResponseCode(404)
        request.setHeader(b"Content-Type", b"application/json")
        return b'{"errcode":"M_UNRECOGNIZED","error":"unrecognized request"}'


class HealthResource(Resource):
    """``/health``: 200 ``{"status": "ok"}``, 200 ``"degraded"`` with warnings, or 503 with the problems.

    ``degraded`` lists what is wrong but does not stop the process serving
    correctly (the audit log cannot write, say): the status is ``degraded``,
    the answer stays 200 and the reasons are under ``"degraded"``.
    """

    isLeaf = True

    def __init__(self, check: Callable[[], list[str]], details: Callable[[], dict[str, Any]] | None = None,
                 degraded: Callable[[], list[str]] | None = None) -> None:
        super().__init__()
        self.check = check
        self.details = details
        self.degraded = degraded

    def render_GET(self, request: Request) -> bytes:
        problems = self.check()
        warnings = self.degraded() if self.degraded is not None else []
        status = "unhealthy" if problems else "degraded" if warnings else "ok"
        body: dict[str, Any] = {"status": status, "problems": problems, "degraded": warnings}
        if self.details is not None:
            body.update(self.details())
        request.setResponseCode(200 if not problems else 503)
        request.setHeader(b"Content-Type", b"application/json")
        return json.dumps(body).encode()


class _PerResourceLimitRequest(LimitedRequest):
    """Buffers bodies up to the largest limit of the site's resources; at dispatch the
    limit of the resource the path reaches applies (the site's own limit if it declares none)."""

    def _site(self) -> _PerResourceLimitSite:
        site: _PerResourceLimitSite = self.channel.site  # type: ignore[attr-defined]  # set by Site.buildProtocol
        return site

    def gotLength(self, length: int | None) -> None:
        self.too_large = length is not None and length > self._site().buffer_max_body_bytes
        Request.gotLength(self, 0 if self.too_large else length)
        self._received = 0

    def handleContentChunk(self, data: bytes) -> None:
        self._received += len(data)
        if self.too_large or self._received > self._site().buffer_max_body_bytes:
            self.too_large = True
            return
        Request.handleContentChunk(self, data)

    def process(self) -> None:
        site = self._site()
        limit = site.root.body_limit_for(self.path)
        if self._received > (limit if limit is not None else site.max_body_bytes):
            self.too_large = True
        super().process()


class _PerResourceLimitSite(JsonSite):
    """A :class:`JsonSite` whose mounted resources may declare their own body limits."""

    requestFactory = _PerResourceLimitRequest

    def __init__(self, root: PrefixRoot, *, max_body_bytes: int, buffer_max_body_bytes: int) -> None:
        super().__init__(root, max_body_bytes=max_body_bytes)
        self.root = root
        self.buffer_max_body_bytes = buffer_max_body_bytes


def build_site(mounts: dict[str, Resource], *, max_body_bytes: int, health: HealthResource | None = None,
               metrics: bool = False) -> JsonSite:
    """A site serving ``mounts``, plus ``/health`` if ``health`` is given and ``/metrics`` if ``metrics``.

    ``max_body_bytes`` bounds request bodies, except for a mounted resource
    declaring its own ``max_body_bytes``, whose limit applies to its requests.
    """
    root = PrefixRoot()
    for prefix, resource in mounts.items():
        root.mount(prefix, resource)
    if health is not None:
        root.mount("/health", health)
    if metrics:
        prometheus = MetricsResource(registry=REGISTRY)
        prometheus.isLeaf = True
        root.mount("/metrics", prometheus)
    own = [o for o in (getattr(r, "max_body_bytes", None) for r in mounts.values()) if o is not None]
    if not own:
        return JsonSite(root, max_body_bytes=max_body_bytes)
    return _PerResourceLimitSite(root, max_body_bytes=max_body_bytes,
                                 buffer_max_body_bytes=max([max_body_bytes, *own]))
