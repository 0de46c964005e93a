"""Signed federation requests: the ``Authorization: X-Matrix`` header, both ways.

Pure functions (no I/O, no clock), following the Matrix server-server
specification's "Request Authentication":

* the signed object is the canonical JSON of ``{"method", "uri", "origin",
  "destination", "content"?}`` (``content`` only when the request has a
  JSON body), signed with the origin's ed25519 key;
* :func:`auth_header` makes the header value
  ``X-Matrix origin="…",destination="…",key="…",sig="…"``;
* :func:`parse_auth_header` reads one back (input from a remote: bounded);
* :func:`verify_request` checks a parsed header against the request and the
  origin's verify key. The destination in the signed object is always this
  server's name, so a request signed for another server never verifies here.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import re
from typing import Any

import attrs
from signedjson.sign import SignatureVerifyException, sign_json, verify_signed_json
from signedjson.types import SigningKey, VerifyKey

from synflow.federation.keys import MAX_KEY_FIELD_LENGTH, key_id

#: The longest ``Authorization`` header value read.
MAX_AUTH_HEADER_BYTES = 4096
#: The most ``Authorization: X-Matrix`` headers one request may carry.
MAX_AUTH_HEADERS = 4
#: The longest request URI (path and query) signed or checked.
MAX_URI_BYTES = 8192

_SCHEME = "X-Matrix"
#: A server name: host (DNS name, IPv4, or [IPv6]) and an optional port.
_SERVER_NAME = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(?::[0-9]{1,5})?$")
_PARAM = re.compile(r'\s*([A-Za-z]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^,\s]*)\s*(?:,|$)')


class AuthError(Exception):
    """A request's ``X-Matrix`` authentication is missing, malformed or wrong."""


@attrs.frozen
class XMatrixAuth:
    """One parsed ``Authorization: X-Matrix`` header.

    Attributes:
        origin: the server the request claims to come from.
        destination: the server it was signed for (None if the header omits it).
        key_id: the origin's key that signed it (``ed25519:<version>``).
        sig: the unpadded base64 signature.
    """

    origin: str
    destination: str | None
    key_id: str
    sig: str


def is_server_name(value: str) -> bool:
    """Whether ``value`` is a syntactically valid server name of at most 255 characters."""
    return 0 < len(value) <= MAX_KEY_FIELD_LENGTH and _SERVER_NAME.match(value) is not None


def request_json(method: str, uri: str, origin: str, destination: str, content: Any | None) -> dict[str, Any]:
    """The object whose canonical JSON is signed for a request."""
    obj: dict[str, Any] = {"method": method, "uri": uri, "origin": origin, "destination": destination}
    if content is not None:
        obj["content"] = content
    return obj


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def auth_header(origin: str, destination: str, signing_key: SigningKey, method: str, uri: str,
                content: Any | None) -> bytes:
    """The ``Authorization`` header value signing a request from ``origin`` to ``destination``.

    Args:
        origin: this server's name.
        destination: the server the request goes to.
        signing_key: this server's signing key.
        method: the HTTP method (``PUT``, ``GET``, ...).
        uri: the request path and query, exactly as sent.
        content: the JSON body, or None for a request without one.
    """
    signed = sign_json(request_json(method, uri, origin, destination, content), origin, signing_key)
    sig = signed["signatures"][origin][key_id(signing_key)]
    fields = (("origin", origin), ("destination", destination), ("key", key_id(signing_key)), ("sig", sig))
    return (_SCHEME + " " + ",".join(f"{name}={_quote(value)}" for name, value in fields)).encode("ascii")


def _unquote(value: str) -> str:
    if value.startswith('"'):
        return re.sub(r"\\(.)", r"\1", value[1:-1])
    return value


def parse_auth_header(value: bytes) -> XMatrixAuth:
    """Parse one ``Authorization`` header value.

    Input from a remote server: the value is at most
    :data:`MAX_AUTH_HEADER_BYTES` of ASCII, every parameter at most 255
    characters, ``origin`` (and ``destination``, if present) a valid server
    name.

    Raises:
        AuthError: saying what is wrong.
    """
    if len(value) > MAX_AUTH_HEADER_BYTES:
        raise AuthError(f"Authorization header is more than {MAX_AUTH_HEADER_BYTES} bytes")
    try:
        text = value.decode("ascii")
    except UnicodeDecodeError:
        raise AuthError("Authorization header is not ASCII") from None
    scheme, _, rest = text.strip().partition(" ")
    if scheme != _SCHEME:
        raise AuthError("Authorization is not X-Matrix")
    params: dict[str, str] = {}
    pos = 0
    rest = rest.strip()
    while pos < len(rest):
        match = _PARAM.match(rest, pos)
        if match is None or match.end() == pos:
            raise AuthError("Authorization header is malformed")
        name, raw = match.group(1).lower(), _unquote(match.group(2))
        if len(raw) > MAX_KEY_FIELD_LENGTH:
            raise AuthError(f"Authorization parameter {name} is more than {MAX_KEY_FIELD_LENGTH} characters")
        params[name] = raw
        pos = match.end()
    missing = [p for p in ("origin", "key", "sig") if not params.get(p)]
    if missing:
        raise AuthError(f"Authorization header lacks {', '.join(missing)}")
    destination = params.get("destination")
    for name, server in (("origin", params["origin"]), ("destination", destination)):
        if server is not None and not is_server_name(server):
            raise AuthError(f"Authorization {name} {server[:80]!r} is not a server name")
    return XMatrixAuth(params["origin"], destination, params["key"], params["sig"])


def verify_request(auth: XMatrixAuth, verify_key: VerifyKey, my_server_name: str, method: str, uri: str,
                   content: Any | None) -> None:
    """Check that ``auth`` signs this request, sent to this server, with ``verify_key``.

    Raises:
        AuthError: the header names another destination, or the signature
            does not verify (wrong key, another request, another destination).
    """
    if auth.destination is not None and auth.destination != my_server_name:
        raise AuthError(f"request was signed for {auth.destination}, not {my_server_name}")
    signed = request_json(method, uri, auth.origin, my_server_name, content)
    signed["signatures"] = {auth.origin: {auth.key_id: auth.sig}}
    try:
        verify_signed_json(signed, auth.origin, verify_key)
    except SignatureVerifyException as e:
        raise AuthError(f"signature of {auth.origin} by {auth.key_id} does not verify: {e}") from None
    except (ValueError, TypeError, UnicodeError, RecursionError) as e:
        # Content no signer could have encoded either (a lone surrogate, say).
        raise AuthError(f"request cannot be canonically encoded: {type(e).__name__}") from None
