"""The federation listener's gate: every ``/_matrix/federation/…`` request is signed.

:class:`FederationAuthResource` is mounted at ``/_matrix/federation`` and wraps
every federation endpoint (``/send`` and any added later: they are mounted
*inside* it, by path prefix, and never see an unauthenticated request).
For each request it

1. answers 400 ``M_TOO_LARGE`` / ``M_NOT_JSON`` / ``M_BAD_JSON`` for a body
   the site refused to buffer, that is not JSON (no signature can cover it)
   or that nests deeper than :data:`MAX_JSON_DEPTH`;
2. parses the ``Authorization: X-Matrix`` headers (at most
   :data:`~synflow.federation.signing.MAX_AUTH_HEADERS`): none, or a
   malformed one, is 401 ``M_UNAUTHORIZED``;
3. refuses an origin that ``federation.allowed_origins`` does not list
   (403 ``M_FORBIDDEN``) *before* fetching any key, so a forger cannot make
   this server contact arbitrary hosts;
4. looks up the origin's key (:class:`~synflow.federation.keyring.KeyRing`)
   and verifies the signature over method, URI, origin, destination (this
   server) and content: failure is 401 ``M_UNAUTHORIZED``;
5. records the authenticated origin on the request
   (:func:`authenticated_origin`) and hands the request, body rewound, to
   the endpoint mounted for its path.

Nothing behind the gate runs for a refused request, so a refused request
changes nothing. :class:`ServerKeyResource` serves this server's own
``GET /_matrix/key/v2/server`` (unauthenticated, as the specification
requires).

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from signedjson.types import SigningKey
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from synflow.errors import HttpApiError
from synflow.federation.keyring import KeyRing, KeyUnavailable
from synflow.federation.keys import server_keys_response
from synflow.federation.signing import (
    MAX_AUTH_HEADERS,
    MAX_URI_BYTES,
    AuthError,
    parse_auth_header,
    verify_request,
)
from synflow.http.server import client_gone
from synflow.http.site import PrefixRoot
from synflow.json_encoding import nested_deeper_than, reject_constant
from synflow.metrics import counter, series

logger = logging.getLogger(__name__)

REQUESTS = counter("synflow_federation_inbound_requests_total",
                   "Inbound federation requests by the signature check's outcome", ["outcome"])
_requests = series(REQUESTS)

#: Where the gate is mounted: every federation endpoint lives below it.
FEDERATION_PREFIX = "/_matrix/federation"
#: Where inbound transactions are posted (``PUT .../send/{txn_id}``).
FEDERATION_SEND_PREFIX = "/_matrix/federation/v1/send"
#: Where this server's key is published.
KEY_PATH = "/_matrix/key/v2/server"
#: The deepest JSON nesting the gate signs over (as ``limits.max_json_depth``'s default).
MAX_JSON_DEPTH = 64

_ORIGIN_ATTR = "synflow_federation_origin"


def authenticated_origin(request: Any) -> str | None:
    """The origin :class:`FederationAuthResource` authenticated ``request`` as, or None."""
    origin = getattr(request, _ORIGIN_ATTR, None)
    return origin if isinstance(origin, str) else None


def require_origin(request: Any) -> str:
    """The authenticated origin of ``request`` (an endpoint's ``origin_of``).

    Raises:
        HttpApiError: 401 ``M_UNAUTHORIZED`` if the request did not pass the gate.
    """
    origin = authenticated_origin(request)
    if origin is None:
        raise HttpApiError(401, "M_UNAUTHORIZED", "request is not authenticated")
    return origin


def _json_body(request: Any, code: int, body: Mapping[str, Any]) -> bytes:
    request.setResponseCode(code)
    request.setHeader(b"Content-Type", b"application/json")
    return json.dumps(body, separators=(",", ":")).encode("utf-8")


class FederationAuthResource(Resource):
    """The gate in front of every federation endpoint (see the module docstring).

    Args:
        server_name: this server's name (the only accepted destination).
        keyring: remote verify keys.
        mounts: path prefix (full, e.g. ``/_matrix/federation/v1/send``) ->
            the endpoint resource serving it.
        allowed_origins: the servers allowed to send (None: any).
    """

    isLeaf = True

    def __init__(self, server_name: str, keyring: KeyRing, mounts: Mapping[str, Resource],
                 allowed_origins: Sequence[str] | None = None) -> None:
        super().__init__()
        self._server_name = server_name
        self._keyring = keyring
        self._allowed = frozenset(allowed_origins) if allowed_origins is not None else None
        self._root = PrefixRoot()
        for prefix, resource in mounts.items():
            self._root.mount(prefix, resource)
        limits = [limit for limit in (getattr(r, "max_body_bytes", None) for r in mounts.values())
                  if limit is not None]
        #: The largest body any endpoint behind the gate declares (the site buffers up to it).
        self.max_body_bytes: int | None = max(limits) if limits else None

    def render(self, request: Any) -> Any:
        if getattr(request, "too_large", False):
            return _json_body(request, 400, {"errcode": "M_TOO_LARGE", "error": "request body is too large"})
        raw = request.content.read() if request.content is not None else b""
        if request.content is not None:
            request.content.seek(0)
        content: Any = None
        if raw.strip():
            try:
                content = json.loads(raw.decode("utf-8"), parse_constant=reject_constant)
            except (ValueError, RecursionError) as e:
                return _json_body(request, 400, {"errcode": "M_NOT_JSON", "error": f"body is not valid JSON: {e}"})
            if nested_deeper_than(content, MAX_JSON_DEPTH):
                return _json_body(request, 400, {"errcode": "M_BAD_JSON",
                                                 "error": f"JSON is nested more than {MAX_JSON_DEPTH} levels deep"})
        d = Deferred.fromCoroutine(self._authenticate(request, content))
        d.addCallbacks(self._dispatch, self._refuse, callbackArgs=(request,), errbackArgs=(request,))
        return NOT_DONE_YET

    async def _authenticate(self, request: Any, content: Any) -> str:
        headers = request.requestHeaders.getRawHeaders(b"Authorization") or []
        xmatrix = [h for h in headers if h.startswith(b"X-Matrix")]
        if not xmatrix:
            raise HttpApiError(401, "M_UNAUTHORIZED", "missing Authorization: X-Matrix header")
        if len(xmatrix) > MAX_AUTH_HEADERS:
            raise HttpApiError(401, "M_UNAUTHORIZED", f"more than {MAX_AUTH_HEADERS} Authorization headers")
        uri = request.uri
        if len(uri) > MAX_URI_BYTES:
            raise HttpApiError(401, "M_UNAUTHORIZED", f"request URI is more than {MAX_URI_BYTES} bytes")
        try:
            auths = [parse_auth_header(h) for h in xmatrix]
            method, uri_text = request.method.decode("ascii"), uri.decode("ascii")
        except (AuthError, UnicodeDecodeError) as e:
            raise HttpApiError(401, "M_UNAUTHORIZED", str(e)) from None
        origins = {a.origin for a in auths}
        if len(origins) != 1:
            raise HttpApiError(401, "M_UNAUTHORIZED", "Authorization headers name different origins")
        (origin,) = origins
        if self._allowed is not None and origin not in self._allowed:
            raise HttpApiError(403, "M_FORBIDDEN", f"federation from {origin!r} is not allowed")
        errors = []
        for auth in auths:
            try:
                key = await self._keyring.verify_key(origin, auth.key_id)
                verify_request(auth, key, self._server_name, method, uri_text, content)
            except (AuthError, KeyUnavailable) as e:
                errors.append(str(e))
                continue
            return origin
        raise HttpApiError(401, "M_UNAUTHORIZED", "; ".join(errors))

    def _dispatch(self, origin: str, request: Any) -> None:
        _requests("authenticated").inc()
        if client_gone(request):
            return
        setattr(request, _ORIGIN_ATTR, origin)
        endpoint = self._root.getChildWithDefault(b"", request)
        try:
            result = endpoint.render(request)
        except Exception:
            logger.exception("federation endpoint %r failed", request.path)
            result = _json_body(request, 500, {"errcode": "M_UNKNOWN", "error": "internal error"})
        if result is not NOT_DONE_YET and not client_gone(request):
            request.write(result)
            request.finish()

    def _refuse(self, failure: Failure, request: Any) -> None:
        if failure.check(HttpApiError):
            error: HttpApiError = failure.value  # type: ignore[assignment]
            logger.info("refused federation %s %r: %s", request.method, request.path[:200], error.msg)
            code, body = error.code, error.to_json()
            _requests("forbidden" if code == 403 else "unauthorized").inc()
        else:
            logger.error("authenticating a federation request failed: %s", failure.getTraceback())
            code, body = 500, {"errcode": "M_UNKNOWN", "error": "internal error"}
        if not client_gone(request):
            request.write(_json_body(request, code, body))
            request.finish()


class ServerKeyResource(Resource):
    """``GET /_matrix/key/v2/server``: this server's self-signed key response.

    Args:
        server_name: this server's name.
        signing_key: its signing key (only the public half is published).
        clock: gives now, for ``valid_until_ts``.
    """

    isLeaf = True

    def __init__(self, server_name: str, signing_key: SigningKey, clock: IReactorTime) -> None:
        super().__init__()
        self._response: Callable[[], dict[str, Any]] = lambda: server_keys_response(
            server_name, signing_key, int(clock.seconds() * 1000))

    def render_GET(self, request: Any) -> bytes:
        return _json_body(request, 200, self._response())
