"""A small asynchronous client for synflow's client API (real HTTP through twisted.web's Agent), for tools and tests.

A bare ``Agent`` rather than treq: treq's URL parsing (hyperlink, IDNA) and
its redirect, cookie and content layers cost more CPU than the request, and
the load generators (``scripts/demo``, the ``mainjob`` benchmark) share the
machine with the deployment they measure.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import json
from io import BytesIO
from typing import Any
from urllib.parse import quote, urlencode

from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.error import TimeoutError
from twisted.web.client import Agent, FileBodyProducer, HTTPConnectionPool, readBody
from twisted.web.http_headers import Headers

PREFIX = "/_synflow/client/v1"


class ApiError(Exception):
    def __init__(self, code: int, body: Any) -> None:
        super().__init__(f"{code}: {body}")
        self.code = code
        self.body = body
        self.errcode = body.get("errcode") if isinstance(body, dict) else None


class Client:
    """One user's view of a synflow server (or just the anonymous endpoints)."""

    def __init__(self, base_url: str, pool: HTTPConnectionPool, token: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.pool = pool
        self.agent = Agent(reactor, pool=pool)
        #: treq over the same connections, for callers that want its response object (headers and all).
        self.http = HTTPClient(self.agent)
        self.token = token
        self.user_id: str | None = None

    def at(self, base_url: str) -> Client:
        """The same user talking to another process."""
        other = Client(base_url, self.pool, self.token)
        other.user_id = self.user_id
        return other

    async def request(self, method: str, path: str, body: Any = None, raw: bytes | None = None,
                      headers: dict | None = None, timeout: float = 60) -> Any:
        hdrs = Headers({b"Content-Type": [b"application/json"]})
        if self.token is not None:
            hdrs.setRawHeaders(b"Authorization", [b"Bearer " + self.token.encode()])
        for name, values in (headers or {}).items():
            hdrs.setRawHeaders(name, values)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        producer = FileBodyProducer(BytesIO(data)) if data is not None else None
        waiting: list[Deferred[Any]] = [
            self.agent.request(method.encode("ascii"), (self.base_url + PREFIX + path).encode("ascii"), hdrs, producer)
        ]
        timer = reactor.callLater(timeout, lambda: waiting[0].cancel())  # the whole exchange, body included
        try:
            response = await waiting[0]
            waiting[0] = readBody(response)
            content = await waiting[0]
        except Exception:
            if not timer.active():
                raise TimeoutError(f"no answer within {timeout}s") from None
            raise
        finally:
            if timer.active():
                timer.cancel()
        try:
            parsed = json.loads(content) if content else None
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
        await self.request("POST", f"/rooms/{quote(room_id)}/join", {})

    async def leave(self, room_id: str) -> None:
        await self.request("POST", f"/rooms/{quote(room_id)}/leave", {})

    async def invite(self, room_id: str, user_id: str) -> None:
        await self.request("POST", f"/rooms/{quote(room_id)}/invite", {"user_id": user_id})

    async def kick(self, room_id: str, user_id: str) -> None:
        await self.request("POST", f"/rooms/{quote(room_id)}/kick", {"user_id": user_id})

    async def send(self, room_id: str, content: dict, txn_id: str, event_type: str = "m.room.message") -> dict:
        return await self.request("PUT", f"/rooms/{quote(room_id)}/send/{quote(event_type)}/{quote(txn_id)}", content)

    async def typing(self, room_id: str, typing: bool = True) -> None:
        await self.request("PUT", f"/rooms/{quote(room_id)}/typing", {"typing": typing})

    async def members(self, room_id: str) -> dict:
        return await self.request("GET", f"/rooms/{quote(room_id)}/members")

    async def sync(self, since: str | None = None, timeout_ms: int = 0, limit: int | None = None,
                   device_id: str | None = None) -> dict:
        params: dict[str, Any] = {"timeout": timeout_ms}
        if since is not None:
            params["since"] = since
        if limit is not None:
            params["limit"] = limit
        if device_id is not None:
            params["device_id"] = device_id
        return await self.request("GET", "/sync?" + urlencode(params), timeout=timeout_ms / 1000 + 60)


def new_pool() -> HTTPConnectionPool:
    pool = HTTPConnectionPool(reactor, persistent=True)
    pool.maxPersistentPerHost = 64
    return pool
