"""A small JSON-over-HTTP framework on ``twisted.web`` for every synflow listener.

:class:`JsonResource` routes ``(method, path regex)`` to async handlers that
return ``(status, json_body)``. Everything untrusted is checked here once:

* bodies over the listener's size limit are refused with 413 before they are
  buffered (:class:`LimitedRequest` stops storing them);
* JSON must be UTF-8, an object where one is expected, without NaN/Infinity
  and no deeper than the nesting limit -- otherwise 400 ``M_NOT_JSON`` /
  ``M_BAD_JSON``;
* a handler's :class:`~synflow.errors.HttpApiError` becomes its status with
  ``{"errcode", "error"}``, and so does a domain refusal
  (:class:`~synflow.errors.PersistRefused`), through the one table from
  refusal to status here (:func:`http_error`); anything else is logged and
  answered with 500 ``M_UNKNOWN`` (the process keeps serving).

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, cast
from urllib.parse import unquote

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure
from twisted.web.http import NO_BODY_CODES, HTTPChannel, datetimeToString
from twisted.web.resource import Resource, _IEncodingResource
from twisted.web.server import NOT_DONE_YET, Request, Site
from twisted.web.server import version as server_version

from synflow.errors import (
    BadEvent,
    Conflict,
    Forbidden,
    HttpApiError,
    NotFound,
    NotStored,
    PersistRefused,
    RoomMoving,
)
from synflow.json_encoding import compact_encoder, reject_constant
from synflow.logbridge import log_text
from synflow.metrics import histogram, series
from synflow.tcp_write import write_now

logger = logging.getLogger(__name__)
#: One line per request (``logging.levels: {synflow.access: WARNING}`` silences it).
access_logger = logging.getLogger("synflow.access")
#: Where the internal RPC between a deployment's processes is served (its calls are logged at DEBUG).
INTERNAL_PREFIX = b"/_synflow/internal"

REQUEST_SECONDS = histogram(
    "synflow_http_request_seconds", "Time to answer an HTTP request, by route", ["route", "code"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)

Handler = Callable[..., Awaitable[tuple[int, Any]]]

DEFAULT_MAX_BODY = 1024 * 1024
DEFAULT_MAX_DEPTH = 64


#: The HTTP status of each kind of domain refusal (a subclass takes its nearest listed base's).
REFUSAL_STATUS: Final[Mapping[type[PersistRefused], int]] = {
    BadEvent: 400,
    Forbidden: 403,
    NotFound: 404,
    Conflict: 409,
    NotStored: 500,
    RoomMoving: 503,
    PersistRefused: 400,
}
#: The refusal class each status stands for, when a refusal crosses the internal RPC.
_REFUSAL_OF_STATUS: Final[Mapping[int, type[PersistRefused]]] = {
    400: BadEvent, 403: Forbidden, 404: NotFound, 409: Conflict, 500: NotStored, 503: RoomMoving,
}


def refusal_status(refusal: PersistRefused) -> int:
    """The HTTP status a client sees for ``refusal``."""
    return next(REFUSAL_STATUS[cls] for cls in type(refusal).__mro__ if cls in REFUSAL_STATUS)


def http_error(refusal: PersistRefused) -> HttpApiError:
    """``refusal`` as the HTTP error a client sees: its status, errcode, message and extra fields."""
    return HttpApiError(refusal_status(refusal), refusal.errcode, refusal.msg, **refusal.extra)


def refusal_from_status(status: int, errcode: str, message: str) -> PersistRefused:
    """The refusal that :func:`refusal_status` maps to ``status`` (a result read from the internal RPC).

    Raises:
        ValueError: ``status`` is no refusal's.
    """
    cls = _REFUSAL_OF_STATUS.get(status)
    if cls is None:
        raise ValueError(f"status {status} is not a refusal's")
    return cls(errcode, message)


#: Query parameters whose values never reach the access log.
SECRET_QUERY_PARAMS = frozenset({b"access_token", b"token", b"password", b"secret", b"sig"})


class LimitedRequest(Request):
    """A request that stops buffering a body past its site's limit.

    It also remembers when it arrived and, once a handler has authenticated
    it, the user (``synflow_user``), for the access log.
    """

    too_large = False
    synflow_user: str | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Bodies are JSON, never HTML forms: twisted.web's form parsing would run the ``email``
        # package's header parser over every POST's Content-Type (about 27 µs a request) and parse
        # multipart bodies nobody reads. Set on the instance: twisted.web sets it there from its
        # Site's ``parsePOSTFormSubmission`` (default True), over any class attribute.
        self._parsePOSTFormSubmission = False
        self.arrived = time.monotonic()

    def process(self) -> None:
        """twisted.web's ``Request.process``, with less done per request.

        The ``Date`` header is formatted once a second, not per request. A
        site root that has ``resource_for(request)`` (:class:`~synflow.http.site.PrefixRoot`)
        picks the resource itself, from the raw path, instead of twisted.web
        unquoting every path segment and walking the tree one segment at a
        time (the root sets ``postpath`` from the raw path either way).
        """
        site: Site = self.channel.site  # type: ignore[attr-defined]  # set by Site.buildProtocol
        resource_for = getattr(site.resource, "resource_for", None)
        if resource_for is None or self.path == b"*":
            Request.process(self)
            return
        self.site = site
        self.setHeader(b"Server", server_version)
        self.setHeader(b"Date", _http_date())
        self.prepath = []
        self.sitepath: list[bytes] = []
        self.postpath = []
        try:
            resrc = resource_for(self)
            if _IEncodingResource.providedBy(resrc):
                encoder = resrc.getEncoder(self)
                if encoder is not None:
                    self._encoder = encoder
            self.render(resrc)
        except BaseException:
            self.processingFailed(Failure())

    def whole_response_ok(self) -> bool:
        """Whether :meth:`write_whole` may answer: nothing written yet, a response with a body, and nothing
        twisted.web's own first write would add (an encoder, a fake HEAD, Last-Modified, ETag, cookies)."""
        return (not self.startedWriting and self.method != b"HEAD" and self.code not in NO_BODY_CODES
                and self._encoder is None and not self._inFakeHead and self.lastModified is None
                and self.etag is None and not self.cookies and isinstance(self.channel, JsonChannel))

    def write_whole(self, tail: bytes, data: bytes) -> None:
        """Write the response's head -- status line, the headers set so far, then ``tail`` (the last header
        lines and the blank line, already encoded) -- and its whole body ``data`` in one write.

        What twisted.web's first ``write`` sends for a response with a Content-Length, without its checks per
        header and its two writes; the caller has checked :meth:`whole_response_ok` and then finishes the
        request. The headers set so far went through ``setHeader``, which sanitized them.
        """
        head = [b"%s %d %s\r\n" % (self.clientproto, self.code, self.code_message)]
        for name, values in self.responseHeaders.getAllRawHeaders():
            for value in values:
                head.append(b"%s: %s\r\n" % (name, value))
        head.append(tail)
        head.append(data)
        self.startedWriting = 1
        self.sentLength = len(data)
        write_now(self.channel.transport, b"".join(head))

    def gotLength(self, length: int | None) -> None:
        limit = _limit(self)
        if length is not None and length > limit:
            self.too_large = True
        super().gotLength(length if not self.too_large else 0)
        self._received = 0

    def handleContentChunk(self, data: bytes) -> None:
        limit = _limit(self)
        self._received = getattr(self, "_received", 0) + len(data)
        if self.too_large or self._received > limit:
            self.too_large = True
            return
        super().handleContentChunk(data)


_date: list[Any] = [None, b""]


def _http_date() -> bytes:
    """The ``Date`` header's value for now (formatted once a second)."""
    now = int(time.time())
    if now != _date[0]:
        _date[0], _date[1] = now, datetimeToString(now)
    cached: bytes = _date[1]
    return cached


def no_delay(transport: Any) -> None:
    """Turn off Nagle's algorithm: small request/response writes must not wait for ACKs."""
    set_no_delay = getattr(transport, "setTcpNoDelay", None)
    if set_no_delay is not None:
        try:
            set_no_delay(True)
        except OSError:  # not a TCP socket (a Unix socket, a test transport)
            pass


def _limit(request: Request) -> int:
    site = getattr(request.channel, "site", None)
    return int(getattr(site, "max_body_bytes", DEFAULT_MAX_BODY))


class JsonChannel(HTTPChannel):
    """twisted.web's HTTP/1.1 channel, used as it is rather than behind its HTTP/2 negotiating wrapper.

    synflow's listeners speak HTTP/1.1 (over TLS too: that is the
    transport's business); the wrapper only forwards each call. Nagle's
    algorithm is off (:func:`no_delay`), and the connection's two addresses
    are looked up once: twisted.web asks for both on every request, and the
    local one is a ``getsockname`` system call each time.
    """

    _peer: Any = None
    _host: Any = None

    def connectionMade(self) -> None:
        no_delay(self.transport)
        super().connectionMade()

    def getPeer(self) -> Any:
        if self._peer is None:
            self._peer = cast(Any, self.transport).getPeer()
        return self._peer

    def getHost(self) -> Any:
        if self._host is None:
            self._host = cast(Any, self.transport).getHost()
        return self._host


class JsonSite(Site):
    """A Site using :class:`LimitedRequest` on :class:`JsonChannel` s."""

    requestFactory = LimitedRequest
    protocol = JsonChannel  # type: ignore[assignment]  # twisted.web's default is its negotiating wrapper

    def __init__(self, resource: Resource, *, max_body_bytes: int = DEFAULT_MAX_BODY, **kwargs: Any) -> None:
        super().__init__(resource, **kwargs)
        self.max_body_bytes = max_body_bytes

    def log(self, request: Any) -> None:
        """One access log line per request: method, path (query secrets redacted), status, duration, user.

        At INFO, except internal RPC between the processes of the deployment
        (``/_synflow/internal``), at DEBUG: one line per call would double
        the log of every client request the deployment serves.
        """
        level = logging.DEBUG if request.path.startswith(INTERNAL_PREFIX) else logging.INFO
        if not access_logger.isEnabledFor(level):
            return
        duration_ms = (time.monotonic() - getattr(request, "arrived", time.monotonic())) * 1000
        log_text(access_logger, level, f"{request.method.decode('ascii', 'replace')} {loggable_uri(request.uri)} "
                                       f"{request.code} {duration_ms:.1f}ms {getattr(request, 'synflow_user', None) or '-'}")


#: Any of :data:`SECRET_QUERY_PARAMS` anywhere in a lower-cased query: a query without a match names none of
#: them. Only the names that hold no other (``token`` finds ``access_token`` too), and the query lower-cased
#: first: a case-insensitive alternation costs several times as much on a sync's query.
_may_hold_secret = re.compile(b"|".join(
    re.escape(name) for name in sorted(SECRET_QUERY_PARAMS)
    if not any(other != name and other in name for other in SECRET_QUERY_PARAMS)
)).search


def loggable_uri(uri: bytes) -> str:
    """``uri`` for a log line: the values of secret query parameters replaced by ``<redacted>``."""
    path, sep, query = uri.partition(b"?")
    if not sep or not _may_hold_secret(query.lower()):
        return uri.decode("ascii", "backslashreplace")
    parts = []
    for part in query.split(b"&"):
        name, eq, _ = part.partition(b"=")
        parts.append(name + b"=<redacted>" if eq and name.lower() in SECRET_QUERY_PARAMS else part)
    return (path + b"?" + b"&".join(parts)).decode("ascii", "backslashreplace")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError("number overflows to Infinity")
    return value


#: What ``json.loads(text, parse_constant=..., parse_float=...)`` builds on every call, built once.
_body_decoder = json.JSONDecoder(parse_constant=reject_constant, parse_float=_finite)


def _depth(value: Any, limit: int) -> int:
    stack = [(value, 1)]
    deepest = 0
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return depth
        deepest = max(deepest, depth)
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return deepest


def parse_json_body(raw: bytes, *, max_depth: int = DEFAULT_MAX_DEPTH, want_object: bool = True) -> Any:
    """Decode a request body strictly.

    Raises:
        HttpApiError: 400 M_NOT_JSON for undecodable input, M_BAD_JSON for
            the wrong shape or too deep nesting.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise HttpApiError(400, "M_NOT_JSON", "request body is not UTF-8") from None
    # Refuse absurd nesting before the recursive decoder sees it.
    brackets = text.count("[") + text.count("{")
    if brackets > max_depth and _bracket_depth(text) > max_depth:
        raise HttpApiError(400, "M_BAD_JSON", f"JSON nested deeper than {max_depth} levels")
    try:
        if text.startswith("\ufeff"):  # as json.loads refuses it
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
        value = _body_decoder.decode(text)
    except (ValueError, RecursionError) as e:
        raise HttpApiError(400, "M_NOT_JSON", f"request body is not valid JSON: {e}") from None
    # Each level but the innermost needs a bracket of its own: with fewer
    # brackets than the limit, the value cannot be deeper than it.
    if brackets >= max_depth and _depth(value, max_depth) > max_depth:
        raise HttpApiError(400, "M_BAD_JSON", f"JSON nested deeper than {max_depth} levels")
    if want_object and not isinstance(value, dict):
        raise HttpApiError(400, "M_BAD_JSON", "request body must be a JSON object")
    return value


def _bracket_depth(text: str) -> int:
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


# Built once (see synflow.json_encoding): a response is encoded per request.
_encode_strict = compact_encoder(allow_nan=False)


def encode_json(value: Any) -> bytes:
    """``value`` as compact JSON (ASCII, no NaN or Infinity), as ``json.dumps(value, separators=(",", ":"),
    allow_nan=False)`` encodes it.

    Raises:
        ValueError: NaN or Infinity in ``value``.
        TypeError: ``value`` holds something JSON cannot encode.
    """
    return _encode_strict(value).encode("ascii")


class EncodedJson:
    """A response body a handler has already encoded as JSON text: :func:`respond_json` sends it as it is.

    For responses assembled from pieces that are encoded once and sent many
    times (sync's events).
    """

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def client_gone(request: Request) -> bool:
    """Whether ``request``'s client has disconnected: twisted.web's ``Request`` marks it when its connection is
    lost, so nothing need ask for ``notifyFinish()`` to learn it (a Deferred per request)."""
    return bool(getattr(request, "_disconnected", False))


def respond_json(request: Request, code: int, body: Any) -> None:
    """Write a JSON response and finish the request (if still open)."""
    if request.finished or client_gone(request):
        return
    data = body.text.encode("utf-8") if type(body) is EncodedJson else encode_json(body)
    request.setResponseCode(code)
    if isinstance(request, LimitedRequest) and request.whole_response_ok():
        request.write_whole(_JSON_HEAD_TAIL % len(data), data)
    else:
        request.setHeader(b"Content-Type", b"application/json")
        request.setHeader(b"Content-Length", str(len(data)).encode())
        request.write(data)
    request.finish()


#: The last lines of a JSON response's head (its Content-Length filled in).
_JSON_HEAD_TAIL = b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"


class JsonResource(Resource):
    """Routes requests under a prefix to async JSON handlers.

    Args:
        prefix: the path prefix (e.g. ``/_synflow/client/v1``), matched exactly.
        max_depth: JSON nesting limit for bodies.
    """

    isLeaf = True

    def __init__(self, prefix: str = "", *, max_depth: int = DEFAULT_MAX_DEPTH) -> None:
        super().__init__()
        self.prefix = prefix.rstrip("/")
        self.max_depth = max_depth
        self._routes: list[tuple[bytes, re.Pattern[str], Handler]] = []
        #: The routes that may match a path, by the path's first segment (in the order they were added); a
        #: first segment not listed may only match the routes whose pattern does not start with a literal one.
        self._by_first: dict[str, list[tuple[bytes, re.Pattern[str], Handler]]] = {}
        self._unindexed: list[tuple[bytes, re.Pattern[str], Handler]] = []

    def route(self, method: str, pattern: str, handler: Handler) -> None:
        """Send ``method`` requests whose path (after the prefix) fully matches ``pattern``."""
        entry = (method.encode(), re.compile(pattern + r"\Z"), handler)
        self._routes.append(entry)
        first = _literal_first_segment(pattern)
        if first is None:
            # It may match any first segment: every list gets it, in order.
            self._unindexed.append(entry)
            for routes in self._by_first.values():
                routes.append(entry)
        else:
            self._by_first.setdefault(first, list(self._unindexed)).append(entry)

    def render(self, request: Request) -> Any:
        d = Deferred.fromCoroutine(self._dispatch(request))
        d.addErrback(self._unexpected, request)
        return NOT_DONE_YET

    def _unexpected(self, failure: Any, request: Request) -> None:
        logger.error("unhandled error serving %s %s: %s", request.method, request.uri, failure.getTraceback())
        respond_json(request, 500, {"errcode": "M_UNKNOWN", "error": "internal server error"})

    async def _dispatch(self, request: Request) -> None:
        started = time.perf_counter()
        route = "unrouted"
        try:
            if getattr(request, "too_large", False):
                limit = _limit(request)
                raise HttpApiError(413, "M_TOO_LARGE", f"request body is larger than {limit} bytes")
            try:
                path = request.path.decode("utf-8")
            except UnicodeDecodeError:
                raise HttpApiError(400, "M_UNRECOGNIZED", "request path is not UTF-8") from None
            if not path.startswith(self.prefix):
                raise HttpApiError(404, "M_UNRECOGNIZED", "unrecognized request")
            sub = _decoded_path(path[len(self.prefix):])
            allowed = False
            for method, pattern, handler in self._candidates(sub):
                match = pattern.match(sub)
                if match is None:
                    continue
                allowed = True
                if method != request.method:
                    continue
                args = {k: v.replace("%2F", "/") for k, v in match.groupdict().items()}
                route = handler.__name__
                try:
                    code, body = await handler(request, **args)
                except PersistRefused as e:
                    raise http_error(e) from None
                respond_json(request, code, body)
                _request_seconds(route, code).observe(time.perf_counter() - started)
                return
            if allowed:
                raise HttpApiError(405, "M_UNRECOGNIZED", f"method {request.method.decode()} not allowed here")
            raise HttpApiError(404, "M_UNRECOGNIZED", "unrecognized request")
        except HttpApiError as e:
            retry_ms = e.extra.get("retry_after_ms")
            if isinstance(retry_ms, int) and e.code in (429, 503):
                request.setHeader(b"Retry-After", str(max(1, -(-retry_ms // 1000))).encode())
            respond_json(request, e.code, e.to_json())
            _request_seconds(route, e.code).observe(time.perf_counter() - started)

    def _candidates(self, sub: str) -> list[tuple[bytes, re.Pattern[str], Handler]]:
        """The routes that may match the path ``sub`` (after the prefix), in the order they were added."""
        if not sub.startswith("/"):
            return self._routes
        return self._by_first.get(sub.split("/", 2)[1], self._unindexed)

    def body(self, request: Request, *, want_object: bool = True) -> Any:
        """The request's JSON body, strictly parsed (an empty body is ``{}``)."""
        assert request.content is not None
        request.content.seek(0)
        raw = request.content.read()
        if not raw.strip():
            return {}
        return parse_json_body(raw, max_depth=self.max_depth, want_object=want_object)


#: :data:`REQUEST_SECONDS`'s series by (route, status): routes are handler names and statuses the few the
#: handlers answer.
_request_seconds_series = series(REQUEST_SECONDS)


def _request_seconds(route: str, code: int) -> Any:
    return _request_seconds_series(route, str(code))


#: A path segment a pattern names literally: nothing in it a regular expression reads otherwise.
_LITERAL_SEGMENT = re.compile(r"[A-Za-z0-9_-]+")


def _literal_first_segment(pattern: str) -> str | None:
    """The first path segment every path ``pattern`` matches has, when the pattern spells it out, else None."""
    if not pattern.startswith("/"):
        return None
    segment = pattern[1:].split("/", 1)[0]
    return segment if _LITERAL_SEGMENT.fullmatch(segment) else None


def _decoded_path(path: str) -> str:
    """``path`` with its segments percent-decoded ("%21room%3Ahs" is "!room:hs"), for matching routes.

    A "/" encoded inside a segment (``%2F`` or ``%2f``) stays ``%2F``, so it
    cannot split a segment: the whole path is decoded at once, with each
    encoded slash first written as an encoded "%2F".

    Raises:
        HttpApiError: 400, the decoded path is not UTF-8.
    """
    if "%" not in path:
        return path  # nothing to decode (most paths): skip urllib's work
    try:
        return unquote(_ENCODED_SLASH.sub("%252F", path), errors="strict")
    except UnicodeDecodeError:
        raise HttpApiError(400, "M_UNRECOGNIZED", "request path is not UTF-8") from None


_ENCODED_SLASH = re.compile("%2F", re.IGNORECASE)


def query_arg(request: Request, name: str) -> str | None:
    """One query-string argument, decoded, or None."""
    assert request.args is not None
    values = request.args.get(name.encode())
    if not values:
        return None
    try:
        return values[0].decode("utf-8")
    except UnicodeDecodeError:
        raise HttpApiError(400, "M_INVALID_PARAM", f"query parameter {name!r} is not UTF-8") from None


_digits = re.compile(r"[0-9]{1,12}").fullmatch


def int_arg(request: Request, name: str, default: int, *, minimum: int = 0, maximum: int | None = None) -> int:
    """An integer query argument, bounded, or 400 M_INVALID_PARAM."""
    raw = query_arg(request, name)
    if raw is None:
        return default
    if not _digits(raw):
        raise HttpApiError(400, "M_INVALID_PARAM", f"query parameter {name!r} must be a non-negative integer")
    value = int(raw)
    if value < minimum:
        raise HttpApiError(400, "M_INVALID_PARAM", f"query parameter {name!r} must be at least {minimum}")
    if maximum is not None:
        value = min(value, maximum)
    return value


def bearer_token(request: Request) -> str | None:
    """The token of an ``Authorization: Bearer`` header (only one allowed)."""
    headers = request.requestHeaders.getRawHeaders(b"authorization") or []
    if len(headers) > 1:
        raise HttpApiError(400, "M_BAD_JSON", "more than one Authorization header")
    if not headers:
        return None
    scheme, _, token = headers[0].partition(b" ")
    if scheme.lower() != b"bearer" or not token.strip():
        return None
    try:
        return token.strip().decode("ascii")
    except UnicodeDecodeError:
        return None
