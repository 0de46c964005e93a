"""A small asynchronous client for synflow's client API (real HTTP over kept-alive connections), for tools and tests.

The API calls go through the internal RPC's HTTP/1.1 client
(:class:`~synflow.http.rpc_http.RpcHttpPool`: the request written as one
buffer, the answer read by a bounded parser) rather than twisted.web's
``Agent`` or treq: those build a URI (with IDNA checks), a ``Headers``, a
body producer, a request and a response object for every call, which cost
more CPU than the request itself, and the load generators (``scripts/demo``,
the ``mainjob`` benchmark) share the machine with the deployment they
measure. :attr:`Client.http` is treq over twisted.web's pool, for callers
that want a full response object (headers and all).

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.internet.defer import Deferred, gatherResults
from twisted.web.client import Agent, HTTPConnectionPool

from synflow.http.rpc_http import RpcHttpPool
from synflow.json_encoding import loads

PREFIX = "/_synflow/client/v1"
#: Kept-alive connections per server address (the load generators keep up to 24 sends and 80 syncs in flight).
MAX_IDLE_PER_ADDRESS = 128


class ApiError(Exception):
    def __init__(self, code: int, body: Any) -> None:
        super().__init__(f"{code}: {body}")
        self.code = code
        self.body = body
        self.errcode = body.get("errcode") if isinstance(body, dict) else None


def retry_delay_s(error: BaseException, default: float = 0.2) -> float:
    """How long to wait before trying again after ``error``: what its ``retry_after_ms`` asks (a 429's, up to
    a minute), else ``default``."""
    retry_ms = error.body.get("retry_after_ms") if isinstance(error, ApiError) and isinstance(error.body, dict) else None
    return retry_ms / 1000 if isinstance(retry_ms, int | float) and 0 < retry_ms <= 60_000 else default


class ClientPool(HTTPConnectionPool):
    """The connections of a set of :class:`Client` s: the API calls' own (:attr:`calls`) and twisted.web's, for treq."""

    def __init__(self) -> None:
        super().__init__(reactor, persistent=True)
        self.maxPersistentPerHost = 64
        self.calls = RpcHttpPool(reactor, max_idle_per_address=MAX_IDLE_PER_ADDRESS)

    def closeCachedConnections(self) -> Deferred[None]:
        """Close every connection of both kinds (a call in flight fails)."""
        return gatherResults([super().closeCachedConnections(), self.calls.close()]).addCallback(lambda _: None)


@lru_cache(maxsize=256)
def _address(base_url: str) -> tuple[str, int, bytes]:
    """``http://host:port`` (an IPv4 address or a name) -> (host, port, the ``Host`` header's value)."""
    parts = urlsplit(base_url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"the client speaks plain HTTP to host:port, not {base_url!r}")
    port = parts.port or 80
    return parts.hostname, port, parts.netloc.encode("ascii")


#: Text that ``quote`` and ``urlencode`` leave as it is: unreserved characters (and ``/`` for a path's ``quote``).
_unreserved = re.compile(r"[A-Za-z0-9_.~-]*").fullmatch
_unreserved_or_slash = re.compile(r"[A-Za-z0-9_.~/-]*").fullmatch


_quote_kept = lru_cache(maxsize=1024)(quote)


def _quote(text: str) -> str:
    """``urllib.parse.quote(text)``: as it is when nothing needs escaping, else kept for the next call (room IDs
    and event types recur in every call about them)."""
    return text if _unreserved_or_slash(text) else _quote_kept(text)


def _query(params: dict[str, Any]) -> str:
    """``urlencode(params)``, without its work when no name or value needs escaping."""
    pairs = [(name, str(value)) for name, value in params.items()]
    if all(_unreserved(name) and _unreserved(value) for name, value in pairs):
        return "&".join(f"{name}={value}" for name, value in pairs)
    return urlencode(pairs)


#: The bytes that end a request line's word or a header: space, the C0 controls and DEL.
_LINE_BREAKERS = bytes(range(0x21)) + b"\x7f"


def _breaks_a_line(text: bytes) -> bool:
    """Whether ``text`` holds a space or a control character (it would end a request line's word or a header)."""
    return len(text.translate(None, _LINE_BREAKERS)) != len(text)


def _request_bytes(method: str, path: str, authority: bytes, token: str | None, data: bytes | None,
                   headers: dict | None) -> bytes:
    """One whole HTTP/1.1 request; a method, path or header that would break the request line or a header refuses."""
    target = (PREFIX + path).encode("ascii")
    if not method.isalpha() or _breaks_a_line(target):
        raise ValueError(f"invalid method or path: {method!r} {path!r}")
    head = [method.encode("ascii") + b" " + target + b" HTTP/1.1", b"Host: " + authority,
            b"Content-Type: application/json"]
    if token is not None:
        token_b = token.encode("ascii")
        if _breaks_a_line(token_b):
            raise ValueError("invalid access token")
        head.append(b"Authorization: Bearer " + token_b)
    for name, values in (headers or {}).items():
        name_b = name if isinstance(name, bytes) else name.encode("ascii")
        for value in values:
            value_b = value if isinstance(value, bytes) else value.encode("ascii")
            if b"\r" in value_b or b"\n" in value_b or b":" in name_b or not name_b.strip():
                raise ValueError(f"invalid header {name!r}")
            head.append(name_b + b": " + value_b)
    if data is not None:
        head.append(b"Content-Length: " + str(len(data)).encode("ascii"))
    return b"\r\n".join(head) + b"\r\n\r\n" + (data or b"")


class Client:
    """One user's view of a synflow server (or just the anonymous endpoints)."""

    def __init__(self, base_url: str, pool: ClientPool, token: str | None = None) -> None:
        if not isinstance(pool, ClientPool):
            raise TypeError(f"a Client needs a pool from new_pool(), not {type(pool).__name__}")
        self.base_url = base_url.rstrip("/")
        self.pool = pool
        self.token = token
        self.user_id: str | None = None
        self._http: HTTPClient | None = None

    @property
    def http(self) -> HTTPClient:
        """treq over the pool's twisted.web connections, for callers that want its response object."""
        if self._http is None:
            self._http = HTTPClient(Agent(reactor, pool=self.pool))
        return self._http

    def at(self, base_url: str) -> Client:
        """The same user talking to another process."""
        other = Client(base_url, self.pool, self.token)
        other.user_id = self.user_id
        return other

    async def request(self, method: str, path: str, body: Any = None, raw: bytes | None = None,
                      headers: dict | None = None, timeout: float = 60) -> Any:
        host, port, authority = _address(self.base_url)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        request = _request_bytes(method, path, authority, self.token, data, headers)
        response = await self.pool.calls.request_within(host, port, request, timeout, reactor)
        content = response.body
        try:
            parsed = loads(content) if content else None
        except ValueError:
            parsed = content
        if response.code != 200:
            raise ApiError(response.code, parsed)
        return parsed

    async def register(self, username: str) -> Client:
        result = await self.request("POST", "/register", {"username": username})
        self.token = result["access_token"]
        self.user_id = result["user_id"]
        return self

    async def create_room(self, preset: str | None = None) -> str:
        """Create a room (``preset``: ``private_chat``, the default, or ``public_chat``)."""
        return (await self.request("POST", "/rooms", {} if preset is None else {"preset": preset}))["room_id"]

    async def join(self, room_id: str) -> None:
        await self.request("POST", f"/rooms/{_quote(room_id)}/join", {})

    async def leave(self, room_id: str) -> None:
        await self.request("POST", f"/rooms/{_quote(room_id)}/leave", {})

    async def invite(self, room_id: str, user_id: str) -> None:
        await self.request("POST", f"/rooms/{_quote(room_id)}/invite", {"user_id": user_id})

    async def kick(self, room_id: str, user_id: str) -> None:
        await self.request("POST", f"/rooms/{_quote(room_id)}/kick", {"user_id": user_id})

    async def send(self, room_id: str, content: dict, txn_id: str, event_type: str = "m.room.message") -> dict:
        return await self.request("PUT", f"/rooms/{_quote(room_id)}/send/{_quote(event_type)}/{_quote(txn_id)}", content)

    async def typing(self, room_id: str, typing: bool = True) -> None:
        await self.request("PUT", f"/rooms/{_quote(room_id)}/typing", {"typing": typing})

    async def members(self, room_id: str) -> dict:
        return await self.request("GET", f"/rooms/{_quote(room_id)}/members")

    async def sync(self, since: str | None = None, timeout_ms: int = 0, limit: int | None = None,
                   device_id: str | None = None) -> dict:
        params: dict[str, Any] = {"timeout": timeout_ms}
        if since is not None:
            params["since"] = since
        if limit is not None:
            params["limit"] = limit
        if device_id is not None:
            params["device_id"] = device_id
        return await self.request("GET", "/sync?" + _query(params), timeout=timeout_ms / 1000 + 60)


def new_pool() -> ClientPool:
    """Connections for a set of :class:`Client` s; close them with ``closeCachedConnections()``."""
    return ClientPool()
