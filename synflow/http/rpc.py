"""Internal HTTP RPC between synflow processes, with read-your-writes.

``POST /_synflow/internal/<name>/<txn_id>`` on the target's internal listener
(its ``instance_map`` address). The body is ``{"args": ..., "positions":
{stream: {instance: position}}}``: the caller's own writer positions. The
receiver waits (bounded) until it has seen those positions before it runs
the call, and answers ``{"result": ..., "positions": ...}`` with its own; the
caller in turn waits until it has seen the receiver's positions before it
returns. So whatever the caller wrote is visible to the call, and whatever
the call wrote is visible to the caller afterwards -- on any process.

* With a secret (by default every deployment has one: see
  :mod:`synflow.shared_secret`), requests need ``Authorization: Bearer
  <secret>``: without it, or with another value, the answer is 401, the
  connection is closed after it, and nothing runs (compared in constant time).
* The ``txn_id`` makes retries idempotent: the receiver keeps each response
  for :data:`RESPONSE_CACHE_S` and replays it (or waits for the first
  attempt still running) instead of running the call again.
* A method raises :class:`HttpApiError` or a domain refusal
  (:class:`~synflow.errors.PersistRefused`, answered with the status
  :func:`~synflow.http.server.http_error` gives it).
* Connect errors and timeouts are retried with backoff and the same
  ``txn_id``; an error the receiver answers (``{errcode, error}`` with a
  status) is raised to the caller as the same :class:`HttpApiError`, so a
  client sees the persister's 403 as a 403.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import hmac
import json
import logging
import random
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectError, ConnectingCancelledError, TimeoutError
from twisted.internet.interfaces import IReactorTime
from twisted.web.client import ResponseFailed
from twisted.web.server import Request

from synflow.backoff import Backoff
from synflow.config import HostPort
from synflow.errors import HttpApiError, PersistRefused
from synflow.http.rpc_http import RpcHttpPool
from synflow.http.server import INTERNAL_PREFIX, JsonResource, bearer_token, http_error
from synflow.json_encoding import compact_json
from synflow.metrics import counter, histogram, series
from synflow.util import observe, sleep

logger = logging.getLogger(__name__)

PREFIX = INTERNAL_PREFIX.decode()
#: How long a response is kept for replays of the same txn_id (seconds).
RESPONSE_CACHE_S = 30 * 60.0
#: Attempts for connect errors / timeouts.
MAX_ATTEMPTS = 6
#: Per-request timeout (seconds).
REQUEST_TIMEOUT_S = 30.0

RPC_CALLS = counter("synflow_rpc_calls_total", "Internal RPC calls made", ["name", "outcome"])
RPC_SERVED = counter("synflow_rpc_served_total", "Internal RPC calls served", ["name", "outcome"])
RPC_SECONDS = histogram(
    "synflow_rpc_seconds", "Time spent in internal RPC, by side and phase", ["name", "side", "phase"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
_rpc_calls, _rpc_served, _rpc_seconds = series(RPC_CALLS), series(RPC_SERVED), series(RPC_SECONDS)

Positions = dict[str, dict[str, int]]


class PositionSource:
    """What RPC needs of the replication handler."""

    def __init__(self, handler: Any, wait_timeout_s: float = 5.0) -> None:
        self.handler = handler
        self.wait_timeout_s = wait_timeout_s

    def own_positions(self) -> Positions:
        me = self.handler.instance_name
        return {name: {me: gen.position} for name, gen in self.handler.generators.items()}

    async def wait_for(self, positions: Mapping[str, Mapping[str, int]]) -> None:
        for stream, by_writer in positions.items():
            if stream not in self.handler.views:
                continue
            for instance, pos in by_writer.items():
                if not isinstance(pos, int):
                    raise HttpApiError(400, "M_BAD_JSON", "stream positions must be integers")
                await self.handler.wait_for_position(stream, instance, pos, self.wait_timeout_s)


#: The errcode of a call refused because the serving process is stopping (the client retries it).
STOPPING_ERRCODE = "M_STOPPING"


class RpcServer(JsonResource):
    """Serves the internal RPC endpoints of one process.

    Args:
        positions: this process's positions (and how to wait for others').
        clock: expires cached responses.
        secret: the shared replication secret, if one is configured.
    """

    def __init__(self, positions: PositionSource, clock: IReactorTime, secret: str | None) -> None:
        super().__init__(PREFIX)
        self.positions = positions
        self.clock = clock
        self.secret = secret
        self.methods: dict[str, Callable[[Any], Awaitable[Any]]] = {}
        #: Set when the process begins to stop: new calls are refused (and retried elsewhere or later).
        self.stopping = False
        # key -> (expiry time, response); insertion order is expiry order (one TTL).
        self._responses: OrderedDict[str, tuple[float, Deferred[tuple[int, Any]]]] = OrderedDict()
        self.route("POST", r"/(?P<name>[a-z_]+)/(?P<txn_id>[A-Za-z0-9_-]{1,64})", self._on_call)

    def register(self, name: str, method: Callable[[Any], Awaitable[Any]]) -> None:
        """Serve ``name``: ``method(args)`` returns the JSON result."""
        self.methods[name] = method

    async def _on_call(self, request: Request, name: str, txn_id: str) -> tuple[int, Any]:
        if self.secret is not None:
            token = bearer_token(request)
            if token is None or not hmac.compare_digest(token.encode(), self.secret.encode()):
                # The name comes from the request: only registered names become labels.
                _rpc_served(name if name in self.methods else "other", "unauthorized").inc()
                _close_after_response(request)
                raise HttpApiError(401, "M_UNAUTHORIZED", "internal RPC requires the replication secret")
        method = self.methods.get(name)
        if method is None:
            raise HttpApiError(404, "M_UNRECOGNIZED", f"no internal method {name!r} on this process")
        body = self.body(request)
        key = f"{name}/{txn_id}"
        now = self.clock.seconds()
        self._expire(now)
        entry = self._responses.get(key)
        if entry is None and self.stopping:
            # A call that arrives on a kept-alive connection after the drain began: refuse it
            # before it runs, so the caller retries it (the process's database may be closing).
            _rpc_served(name, "stopping").inc()
            _close_after_response(request)
            raise HttpApiError(503, STOPPING_ERRCODE, f"{name}: this process is stopping; retry")
        if entry is None:
            entry = self._responses[key] = (now + RESPONSE_CACHE_S, Deferred.fromCoroutine(self._run(name, method, body)))
        code, result = await observe(entry[1])
        return code, result

    def _expire(self, now: float) -> None:
        # Expired lazily rather than by a timer per call: no reactor timers
        # outlive the process's services, and the reactor's heap stays small.
        while self._responses:
            key, (expires, _) = next(iter(self._responses.items()))
            if expires > now:
                return
            del self._responses[key]

    async def _run(self, name: str, method: Callable[[Any], Awaitable[Any]], body: dict[str, Any]) -> tuple[int, Any]:
        try:
            positions = body.get("positions") or {}
            if not isinstance(positions, dict) or not all(isinstance(v, dict) for v in positions.values()):
                raise HttpApiError(400, "M_BAD_JSON", "positions must map streams to {instance: position}")
            started = time.perf_counter()
            await self.positions.wait_for(positions)
            waited = time.perf_counter()
            _rpc_seconds(name, "server", "wait").observe(waited - started)
            try:
                result = await method(body.get("args", {}))
            except PersistRefused as refused:
                raise http_error(refused) from None
            _rpc_seconds(name, "server", "run").observe(time.perf_counter() - waited)
        except HttpApiError as e:
            _rpc_served(name, str(e.code)).inc()
            return e.code, {**e.to_json(), "positions": self.positions.own_positions()}
        except Exception:
            logger.exception("internal RPC %s failed", name)
            _rpc_served(name, "500").inc()
            return 500, {"errcode": "M_UNKNOWN", "error": f"{name} failed on this process",
                         "positions": self.positions.own_positions()}
        _rpc_served(name, "ok").inc()
        return 200, {"result": result, "positions": self.positions.own_positions()}


def _close_after_response(request: Request) -> None:
    """Close the connection once this response is written (a caller without the secret gets no second try on it)."""
    request.setHeader(b"Connection", b"close")
    channel = getattr(request, "channel", None)
    if channel is not None and hasattr(channel, "persistent"):
        channel.persistent = False


def _errcode(content: bytes) -> str | None:
    """The ``errcode`` of a JSON error body, if it has one."""
    try:
        data = json.loads(content)
    except ValueError:
        return None
    return data.get("errcode") if isinstance(data, dict) else None


class RpcClient:
    """Calls other processes' internal RPC methods.

    Args:
        reactor: for treq and the clock.
        instance_map: each instance's internal listener address.
        positions: this process's positions (sent along; the answer's awaited).
        secret: the shared replication secret, if configured.
        backoff: delays between retries of connect errors.
        rng: jitter.
    """

    def __init__(self, reactor: Any, instance_map: Mapping[str, HostPort], positions: PositionSource,
                 secret: str | None = None, *, backoff: Backoff | None = None,
                 rng: random.Random | None = None, http: Any = None, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.reactor = reactor
        self.instance_map = dict(instance_map)
        self.positions = positions
        self.secret = secret
        self.backoff = backoff or Backoff(initial_s=0.1, multiplier=2.0, max_s=2.0, jitter=0.1)
        self.rng = rng or random.Random()
        self.timeout_s = timeout_s
        # Not treq, nor twisted.web's Agent: their per-request machinery cost
        # more CPU than the call itself on this hot path (see rpc_http).
        self.pool = RpcHttpPool(reactor)
        self.http = http
        auth = b"" if secret is None else b"Authorization: Bearer " + secret.encode() + b"\r\n"
        #: Every request's headers after Host and before Content-Length.
        self._fixed_headers = b"Content-Type: application/json\r\n" + auth

    def close(self) -> Deferred[None]:
        return self.pool.close()

    async def call(self, instance: str, name: str, args: Any, *, attempts: int = MAX_ATTEMPTS) -> Any:
        """Call ``name`` on ``instance``; returns its result or raises its HttpApiError.

        A refused connection, a timeout or a stopping peer is retried with backoff, ``attempts`` times in all.
        """
        address = self.instance_map.get(instance)
        if address is None:
            raise HttpApiError(502, "M_UNKNOWN", f"instance {instance!r} is not in instance_map")
        txn_id = secrets.token_urlsafe(12)
        path = f"{PREFIX}/{name}/{txn_id}"
        body = compact_json({"args": args, "positions": self.positions.own_positions()}).encode()
        last_error: Exception | None = None
        for attempt in range(1, attempts + 1):
            try:
                started = time.perf_counter()
                code, content = await self._post(address, path, body)
                _rpc_seconds(name, "client", "http").observe(time.perf_counter() - started)
            except (ConnectError, ConnectingCancelledError, TimeoutError, ResponseFailed) as e:
                last_error = e
                delay = self.backoff.delay(attempt, self.rng)
                logger.info("RPC %s to %s failed (%s); retry %d in %.2fs", name, instance, type(e).__name__, attempt, delay)
                await sleep(self.reactor, delay)
                continue
            if code == 503 and _errcode(content) == STOPPING_ERRCODE:
                last_error = HttpApiError(503, STOPPING_ERRCODE, f"{instance} is stopping")
                delay = self.backoff.delay(attempt, self.rng)
                logger.info("RPC %s to %s refused: it is stopping; retry %d in %.2fs", name, instance, attempt, delay)
                await sleep(self.reactor, delay)
                continue
            return await self._finish(instance, name, code, content)
        _rpc_calls(name, "unreachable").inc()
        raise HttpApiError(502, "M_UNKNOWN", f"failed to talk to {instance!r} ({type(last_error).__name__})")

    async def _post(self, address: HostPort, path: str, body: bytes) -> tuple[int, bytes]:
        if self.http is not None:  # an injected treq-like client (tests)
            headers: dict[bytes, list[bytes]] = {b"Content-Type": [b"application/json"]}
            if self.secret is not None:
                headers[b"Authorization"] = [b"Bearer " + self.secret.encode()]
            response = await self.http.post(f"http://{address.host}:{address.port}{path}", data=body,
                                             headers=headers, timeout=self.timeout_s)
            return response.code, await response.content()
        request = b"".join((
            f"POST {path} HTTP/1.1\r\nHost: {address.host}:{address.port}\r\n".encode(), self._fixed_headers,
            b"Content-Length: %d\r\n\r\n" % len(body), body,
        ))
        response = await self.pool.request_within(address.host, address.port, request, self.timeout_s, self.reactor)
        return response.code, response.body

    async def _finish(self, instance: str, name: str, code: int, content: bytes) -> Any:
        try:
            data = json.loads(content)
        except ValueError:
            _rpc_calls(name, "bad_response").inc()
            raise HttpApiError(502, "M_UNKNOWN", f"{instance!r} answered {code} with a non-JSON body") from None
        positions = data.get("positions") if isinstance(data, dict) else None
        if isinstance(positions, dict):
            started = time.perf_counter()
            await self.positions.wait_for(positions)
            _rpc_seconds(name, "client", "wait").observe(time.perf_counter() - started)
        if code != 200:
            _rpc_calls(name, str(code)).inc()
            extra = {k: v for k, v in data.items() if k not in ("errcode", "error", "positions")}
            raise HttpApiError(code, data.get("errcode", "M_UNKNOWN"), data.get("error", f"{instance} failed"), **extra)
        _rpc_calls(name, "ok").inc()
        return data.get("result")
