"""The client API: JSON over HTTP under ``/_synflow/client/v1/``.

===========================================  =========================================
request                                      response
===========================================  =========================================
``POST register {"username"}``               ``{"user_id", "access_token", "device_id"}`` (409 if taken)
``POST rooms {"preset"?, "visibility"?}``    ``{"room_id"}`` (the creator is joined; see below)
``POST rooms/{room}/join {}``                ``{}`` (invited, or the room is public)
``POST rooms/{room}/leave {}``               ``{}``
``POST rooms/{room}/invite {"user_id"}``     ``{}`` (a remote user's server joins the room's destinations)
``POST rooms/{room}/kick {"user_id"}``       ``{}`` (needs the ``kick`` power level)
``PUT rooms/{room}/send/{type}/{txn_id}``    ``{"event_id", "token"}`` (idempotent per device and request path)
``GET sync?since=&timeout=&limit=&device_id=``  ``{"next_batch", "events", "limited"}``
``GET rooms/{room}/members``                 ``{"members", "token"}`` (joined users; read at or after ``token``)
``GET rooms/{room}/state``                   ``{"state": {type: {state_key: event_id}}, "token"}`` (joined users)
``PUT rooms/{room}/typing {"typing": bool}``  ``{}`` (an EDU to the room's remote servers)
===========================================  =========================================

Every request but ``register`` needs ``Authorization: Bearer <access_token>``.
Writes are routed to the room's event persister (this process, or one
reached over internal RPC). ``token`` in a send's response is a sync token
positioned just before the event: a sync with ``since=<token>`` and a
``timeout`` on any process returns the event (with ``timeout=0`` a process that
has not received it yet answers without it, and the next sync returns it).
Errors are ``{"errcode", "error"}`` with the right status. Writes are limited
per user (``limits.rate_limit_per_s``) and syncs per access token
(``limits.sync_rate_limit_per_s``); past a limit the answer is 429
``M_LIMIT_EXCEEDED`` with ``retry_after_ms`` and a ``Retry-After`` header.

``createRoom`` writes ``m.room.create``, the creator's join,
``m.room.power_levels`` (creator 100) and ``m.room.join_rules``: ``invite``
for ``preset: private_chat`` (the default), ``public`` for ``preset:
public_chat`` (the default when ``visibility`` is ``public``). Every event
then passes :mod:`synflow.events.auth`; ``send`` never makes ``m.room.create``.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import math
import re
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from twisted.internet.interfaces import IReactorTime
from twisted.web.server import Request

from synflow.config import LimitsConfig
from synflow.errors import HttpApiError
from synflow.events.auth import JOIN_RULES, POWER_LEVELS, JoinRule, PowerLevels
from synflow.events.persist import CREATE, MEMBER, EventSpec, PersistResult
from synflow.events.sync import SyncHandler
from synflow.http.ratelimit import TokenBucket
from synflow.http.server import EncodedJson, JsonResource, bearer_token, int_arg, query_arg
from synflow.json_encoding import compact_json, json_string
from synflow.storage.stores import DataStore, Requester
from synflow.tokens import StreamToken

PREFIX = "/_synflow/client/v1"
_USERNAME = re.compile(r"[a-z0-9._=\-/]{1,64}\Z")
_ROOM = r"(?P<room_id>![^/]{1,255})"
#: A sync's device_id query argument.
_device_id = re.compile(r"[A-Za-z0-9._\-]{1,64}").fullmatch
_MXID = re.compile(r"@[a-z0-9._=\-/]{1,64}:[A-Za-z0-9.\-:\[\]]{1,255}\Z")

#: ``createRoom`` presets and the join rule each sets.
PRESETS = {"private_chat": JoinRule.INVITE, "public_chat": JoinRule.PUBLIC}

Persist = Callable[[list[EventSpec]], Awaitable[list[PersistResult]]]


class ClientApi(JsonResource):
    """The client API of one process.

    Args:
        server_name: this server.
        store: users and rooms.
        sync: the sync handler.
        persist: routes events to their rooms' persisters.
        event_position: maps a persisted event to its sync token (just before it).
        clock: timestamps, rate limits.
        limits: request limits.
    """

    def __init__(self, server_name: str, store: DataStore, sync: SyncHandler, persist: Persist,
                 event_position: Callable[[PersistResult], Awaitable[StreamToken]],
                 clock: IReactorTime, limits: LimitsConfig,
                 queue_edus: Callable[[list[tuple[str, str, dict[str, Any]]]], Awaitable[None]] | None = None) -> None:
        super().__init__(PREFIX, max_depth=limits.max_json_depth)
        self.server_name = server_name
        self.store = store
        self.sync_handler = sync
        self.persist = persist
        self.event_position = event_position
        self.clock = clock
        self.limits = limits
        self.queue_edus = queue_edus
        self.rate = (TokenBucket(limits.rate_limit_per_s, limits.rate_limit_burst, clock)
                     if limits.rate_limit_per_s else None)
        self.sync_rate = (TokenBucket(limits.sync_rate_limit_per_s, limits.sync_rate_limit_burst, clock)
                          if limits.sync_rate_limit_per_s else None)
        self.route("POST", r"/register", self.on_register)
        self.route("POST", r"/rooms", self.on_create_room)
        self.route("POST", rf"/rooms/{_ROOM}/join", self.on_join)
        self.route("POST", rf"/rooms/{_ROOM}/leave", self.on_leave)
        self.route("POST", rf"/rooms/{_ROOM}/invite", self.on_invite)
        self.route("POST", rf"/rooms/{_ROOM}/kick", self.on_kick)
        self.route("PUT", rf"/rooms/{_ROOM}/send/(?P<event_type>[^/]{{1,255}})/(?P<txn_id>[^/]{{1,255}})", self.on_send)
        self.route("GET", r"/sync", self.on_sync)
        self.route("GET", rf"/rooms/{_ROOM}/members", self.on_members)
        self.route("GET", rf"/rooms/{_ROOM}/state", self.on_state)
        self.route("PUT", rf"/rooms/{_ROOM}/typing", self.on_typing)

    # -- helpers ------------------------------------------------------------------------

    async def auth(self, request: Request) -> Requester:
        token = bearer_token(request)
        if token is None:
            raise HttpApiError(401, "M_MISSING_TOKEN", "missing access token (Authorization: Bearer <token>)")
        requester = await self.store.get_user_by_access_token(token)
        if requester is None:
            raise HttpApiError(401, "M_UNKNOWN_TOKEN", "unknown access token")
        request.synflow_user = requester.user_id  # type: ignore[attr-defined]  # for the access log
        return requester

    def _rate_limit(self, key: str, request: Request | None = None, bucket: TokenBucket | None = None) -> None:
        """Refuse with 429 (``retry_after_ms``, ``Retry-After``) when ``key`` is over its limit."""
        bucket = bucket if bucket is not None else self.rate
        if bucket is None:
            return
        wait_s = bucket.take(key)
        if wait_s > 0:
            retry_ms = max(1, math.ceil(wait_s * 1000))
            if request is not None:
                request.setHeader(b"Retry-After", str(max(1, math.ceil(wait_s))).encode())
            raise HttpApiError(429, "M_LIMIT_EXCEEDED", f"too many requests; retry in {retry_ms} ms",
                               retry_after_ms=retry_ms)

    def _now_ms(self) -> int:
        return int(self.clock.seconds() * 1000)

    def _spec(self, room_id: str, event_type: str, sender: str, content: dict[str, Any],
              state_key: str | None = None, txn_id: str | None = None) -> EventSpec:
        return EventSpec(room_id, event_type, sender, content, state_key, self.server_name, self._now_ms(), txn_id)

    async def _persist_one(self, spec: EventSpec) -> PersistResult:
        (result,) = await self.persist([spec])
        result.raise_error()
        return result

    # -- endpoints -----------------------------------------------------------------------

    async def on_register(self, request: Request) -> tuple[int, Any]:
        body = self.body(request)
        username = body.get("username")
        if not isinstance(username, str) or not _USERNAME.match(username):
            raise HttpApiError(400, "M_INVALID_USERNAME", "username must be 1-64 of a-z 0-9 . _ = - /")
        self._rate_limit(f"register:{request.getClientAddress().host if request.getClientAddress() else ''}")
        user_id = f"@{username}:{self.server_name}"
        token = secrets.token_urlsafe(32)
        device_id = secrets.token_hex(5).upper()
        created = await self.store.register_user(user_id, token, device_id, self._now_ms())
        if not created:
            raise HttpApiError(409, "M_USER_IN_USE", f"user {user_id} already exists")
        return 200, {"user_id": user_id, "access_token": token, "device_id": device_id}

    async def on_create_room(self, request: Request) -> tuple[int, Any]:
        requester = await self.auth(request)
        body = self.body(request)
        visibility = body.get("visibility", "private")
        if visibility not in ("private", "public"):
            raise HttpApiError(400, "M_INVALID_PARAM", "visibility must be private or public")
        preset = body.get("preset", "public_chat" if visibility == "public" else "private_chat")
        if preset not in PRESETS:
            raise HttpApiError(400, "M_INVALID_PARAM", f"preset must be one of {sorted(PRESETS)}")
        self._rate_limit(requester.user_id)
        room_id = f"!{secrets.token_urlsafe(12)}:{self.server_name}"
        creator = requester.user_id
        specs = [
            self._spec(room_id, CREATE, creator, {"creator": creator}, ""),
            self._spec(room_id, MEMBER, creator, {"membership": "join"}, creator),
            self._spec(room_id, POWER_LEVELS, creator, PowerLevels.for_new_room(creator).to_content(), ""),
            self._spec(room_id, JOIN_RULES, creator, {"join_rule": PRESETS[preset].value}, ""),
        ]
        results = await self.persist(specs)
        for result in results:
            result.raise_error()
        return 200, {"room_id": room_id}

    async def _membership(self, request: Request, room_id: str, membership: str, target: str | None = None) -> tuple[int, Any]:
        requester = await self.auth(request)
        body = self.body(request)
        self._rate_limit(requester.user_id)
        if membership in ("invite", "kick"):
            target = body.get("user_id")
            if not isinstance(target, str) or not _MXID.match(target):
                raise HttpApiError(400, "M_INVALID_PARAM", "user_id must be a user ID like @name:server")
        state_key = target or requester.user_id
        membership = "leave" if membership == "kick" else membership
        await self._persist_one(self._spec(room_id, MEMBER, requester.user_id, {"membership": membership}, state_key))
        return 200, {}

    async def on_join(self, request: Request, room_id: str) -> tuple[int, Any]:
        return await self._membership(request, room_id, "join")

    async def on_leave(self, request: Request, room_id: str) -> tuple[int, Any]:
        return await self._membership(request, room_id, "leave")

    async def on_invite(self, request: Request, room_id: str) -> tuple[int, Any]:
        return await self._membership(request, room_id, "invite")

    async def on_kick(self, request: Request, room_id: str) -> tuple[int, Any]:
        return await self._membership(request, room_id, "kick")

    async def on_send(self, request: Request, room_id: str, event_type: str, txn_id: str) -> tuple[int, Any]:
        """Send an event; a retry of the same request (device, room, type, txn_id) returns the same event."""
        requester = await self.auth(request)
        if event_type == CREATE:
            raise HttpApiError(403, "M_FORBIDDEN", "m.room.create is only made by creating a room (POST rooms)")
        assert request.content is not None
        request.content.seek(0, 2)
        if request.content.tell() > self.limits.max_event_bytes:
            raise HttpApiError(400, "M_TOO_LARGE", f"event content is larger than {self.limits.max_event_bytes} bytes")
        content = self.body(request)
        self._rate_limit(requester.user_id, request)
        txn_key = compact_json([requester.device_id, room_id, event_type, txn_id])
        result = await self._persist_one(self._spec(room_id, event_type, requester.user_id, content, txn_id=txn_key))
        token = await self.event_position(result)
        return 200, {"event_id": result.event_id, "token": str(token)}

    async def on_typing(self, request: Request, room_id: str) -> tuple[int, Any]:
        """Tell the room's remote servers that the user is (or stopped) typing: an EDU, not an event."""
        requester = await self.auth(request)
        body = self.body(request)
        typing = body.get("typing")
        if not isinstance(typing, bool):
            raise HttpApiError(400, "M_BAD_JSON", "typing must be true or false")
        self._rate_limit(requester.user_id)
        if await self.store.get_membership(room_id, requester.user_id) != "join":
            raise HttpApiError(403, "M_FORBIDDEN", f"{requester.user_id} is not joined to room {room_id}")
        hosts = [h for h in await self.store.get_current_hosts_in_room(room_id) if h != self.server_name]
        if hosts and self.queue_edus is not None:
            content = {"room_id": room_id, "user_id": requester.user_id, "typing": typing}
            await self.queue_edus([(h, "m.typing", content) for h in hosts])
        return 200, {}

    async def on_members(self, request: Request, room_id: str) -> tuple[int, Any]:
        """The room's joined members, and the position (token) they were read at; only for joined users.

        The token is taken before the read, so the members reflect every
        membership change the token covers.
        """
        requester = await self.auth(request)
        token, _ = await self.sync_handler.current_token()
        members = await self.store.get_users_in_room(room_id)
        if requester.user_id not in members:
            raise HttpApiError(403, "M_FORBIDDEN", f"{requester.user_id} is not joined to room {room_id}")
        return 200, {"members": list(members), "token": str(token)}

    async def on_state(self, request: Request, room_id: str) -> tuple[int, Any]:
        """The room's current state (event IDs by type and state key), and the position it was read at.

        Only joined users may read it. Like ``members``, the token is taken
        first: the (cached) state reflects every state event the token covers.
        """
        requester = await self.auth(request)
        token, _ = await self.sync_handler.current_token()
        if requester.user_id not in await self.store.get_users_in_room(room_id):
            raise HttpApiError(403, "M_FORBIDDEN", f"{requester.user_id} is not joined to room {room_id}")
        state = await self.store.get_current_state_ids(room_id)
        return 200, {"state": state, "token": str(token)}

    async def on_sync(self, request: Request) -> tuple[int, Any]:
        requester = await self.auth(request)
        since = query_arg(request, "since")
        timeout = int_arg(request, "timeout", 0, maximum=self.limits.sync_max_timeout_ms)
        limit = int_arg(request, "limit", self.limits.sync_default_limit, minimum=1, maximum=self.limits.sync_max_limit)
        device = query_arg(request, "device_id")
        if device is not None and not _device_id(device):
            raise HttpApiError(400, "M_INVALID_PARAM", "device_id must be 1-64 of A-Z a-z 0-9 . _ -")
        reader = f"{requester.user_id}/{device}" if device else requester.user_id
        # Per access token (a user's device): every sync chain of a client has its own bucket.
        self._rate_limit(f"sync:{requester.user_id}/{requester.device_id}", request, self.sync_rate)
        result = await self.sync_handler.sync(requester.user_id, reader, since, timeout, limit)
        # {"next_batch", "events": [each event's to_client()], "limited"}, as encode_json would
        # encode it, from each event's client JSON (built once per event, shared by the syncs
        # that deliver it).
        return 200, EncodedJson(
            f'{{"next_batch":{json_string(result.next_batch)},'
            f'"events":[{",".join([e.client_json() for e in result.events])}],'
            f'"limited":{"true" if result.limited else "false"}}}'
        )
