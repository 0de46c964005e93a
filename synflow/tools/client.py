"""A small asynchronous client for synflow's client API (treq, real HTTP), for tools and tests.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote, urlencode

from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.web.client import Agent, HTTPConnectionPool

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
        self.http = HTTPClient(Agent(reactor, pool=pool))
        self.token = token
        self.user_id: str | None = None

    def at(self, base_url: str) -> Client:
        """The same user talking to another process."""
        other = Client(base_url, self.pool, self.token)
        other.user_id = self.user_id
        return other

    async def request(self, method: str, path: str, body: Any = None, raw: bytes | None = None,
                      headers: dict | None = None, timeout: float = 60) -> Any:
        hdrs: dict[bytes | str, list[bytes | str]] = {b"Content-Type": [b"application/json"]}
        if self.token is not None:
            hdrs[b"Authorization"] = [b"Bearer " + self.token.encode()]
        if headers:
            hdrs.update(headers)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        response = await self.http.request(method, self.base_url + PREFIX + path, data=data, headers=hdrs,
                                           timeout=timeout)
        content = await response.content()
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
