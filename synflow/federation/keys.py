"""Server signing keys: this server's own key, and what a remote's key response says.

Each server has one ed25519 signing key (the Matrix server-server
specification's "server key"). :func:`load_or_create_signing_key` reads it
from its file (Synapse's format: ``ed25519 <version> <base64 seed>``), or
creates the file on first start with mode 0600. The key itself is never
logged; only its key ID (``ed25519:<version>``) is.

:func:`server_keys_response` is the self-signed body this server publishes at
``GET /_matrix/key/v2/server``; :func:`parse_server_keys` checks a remote's
body (every field bounded, the self-signature verified) and returns the keys
it vouches for and until when. Both are pure: the caller reads the clock.
The cache that fetches and remembers remote keys is
:mod:`synflow.federation.keyring`.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import logging
import os
import secrets
import string
from collections.abc import Mapping
from typing import Any

import attrs
from signedjson.key import (
    decode_verify_key_bytes,
    encode_verify_key_base64,
    generate_signing_key,
    get_verify_key,
    read_signing_keys,
    write_signing_keys,
)
from signedjson.sign import SignatureVerifyException, sign_json, verify_signed_json
from signedjson.types import SigningKey, VerifyKey
from unpaddedbase64 import decode_base64

from synflow.errors import ConfigError

logger = logging.getLogger(__name__)

#: The only signing algorithm synflow uses and accepts.
ALGORITHM = "ed25519"
#: How long a published key response says it is valid (``valid_until_ts``).
KEY_VALIDITY_MS = 24 * 3600 * 1000
#: The longest a fetched key is trusted, whatever its ``valid_until_ts``
#: says (the specification caps it at seven days).
MAX_KEY_VALIDITY_MS = 7 * 24 * 3600 * 1000
#: The most keys one key response may list.
MAX_VERIFY_KEYS = 16
#: The longest key ID, server name or base64 key accepted from a remote.
MAX_KEY_FIELD_LENGTH = 255
#: The largest integer accepted in federation JSON (``2**53``).
MAX_SAFE_INTEGER = 2**53
#: The file mode of a created key file: readable by its owner only.
KEY_FILE_MODE = 0o600

_VERSION_CHARS = string.ascii_letters + string.digits + "_"


class KeyResponseError(Exception):
    """A remote's key response is malformed, expired or not self-signed."""


def key_id(signing_key: SigningKey) -> str:
    """The key ID of ``signing_key``: ``ed25519:<version>``."""
    return f"{signing_key.alg}:{signing_key.version}"


def public_key_base64(signing_key: SigningKey) -> str:
    """The unpadded base64 public key of ``signing_key`` (safe to log and publish)."""
    result: str = encode_verify_key_base64(get_verify_key(signing_key))
    return result


def load_or_create_signing_key(path: str) -> SigningKey:
    """This server's signing key, from ``path``; created there (mode 0600) if missing.

    An existing file readable by others is made owner-only, with a warning.

    Raises:
        ConfigError: the file exists but holds no ed25519 key, or cannot be
            read or written.
    """
    try:
        with open(path, encoding="ascii") as f:
            keys = read_signing_keys(f)
    except FileNotFoundError:
        return _create(path)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the signing key file {path!r}: {e}") from None
    keys = [k for k in keys if k.alg == ALGORITHM]
    if not keys:
        raise ConfigError(f"the signing key file {path!r} holds no {ALGORITHM} key")
    mode = os.stat(path).st_mode & 0o777
    if mode & 0o077:
        logger.warning("signing key file %s had mode %o; making it readable by its owner only", path, mode)
        os.chmod(path, KEY_FILE_MODE)
    logger.info("loaded signing key %s from %s", key_id(keys[0]), path)
    return keys[0]


def _create(path: str) -> SigningKey:
    version = "a_" + "".join(secrets.choice(_VERSION_CHARS) for _ in range(4))
    key = generate_signing_key(version)
    directory = os.path.dirname(os.path.abspath(path))
    # Written whole under a private name, then linked into place: the
    # processes of one server share the file, and none may read it half-written.
    temporary = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, KEY_FILE_MODE)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            write_signing_keys(f, [key])
        try:
            os.link(temporary, path)
        except FileExistsError:  # another process of this server created it first
            return load_or_create_signing_key(path)
    except OSError as e:
        raise ConfigError(f"cannot create the signing key file {path!r}: {e.strerror}") from None
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    logger.info("created signing key %s in %s", key_id(key), path)
    return key


def server_keys_response(server_name: str, signing_key: SigningKey, now_ms: int,
                         validity_ms: int = KEY_VALIDITY_MS) -> dict[str, Any]:
    """The self-signed body of ``GET /_matrix/key/v2/server`` for this server."""
    body = {
        "server_name": server_name,
        "valid_until_ts": now_ms + validity_ms,
        "verify_keys": {key_id(signing_key): {"key": public_key_base64(signing_key)}},
        "old_verify_keys": {},
    }
    signed: dict[str, Any] = sign_json(body, server_name, signing_key)
    return signed


@attrs.frozen
class ServerKeys:
    """The verify keys a server vouched for, and until when they are trusted.

    Attributes:
        server_name: the server.
        keys: key ID -> verify key.
        valid_until_ts: ms; after it the keys must be fetched again.
    """

    server_name: str
    keys: Mapping[str, VerifyKey] = attrs.field(eq=False, repr=False)
    valid_until_ts: int


def decode_verify_key(key_id_: str, key_base64: str) -> VerifyKey:
    """A verify key from its ID and unpadded base64 (a remote's or a pinned one).

    Raises:
        ValueError: the ID is not ``ed25519:<version>`` or the key is not 32
            bytes of base64.
    """
    alg, _, version = key_id_.partition(":")
    if alg != ALGORITHM or not version or len(key_id_) > MAX_KEY_FIELD_LENGTH:
        raise ValueError(f"key ID {key_id_[:80]!r} is not {ALGORITHM}:<version>")
    if not isinstance(key_base64, str) or len(key_base64) > MAX_KEY_FIELD_LENGTH:
        raise ValueError(f"key {key_id_} is not a base64 string")
    try:
        raw = decode_base64(key_base64)
    except Exception:
        raise ValueError(f"key {key_id_} is not valid base64") from None
    if len(raw) != 32:
        raise ValueError(f"key {key_id_} is {len(raw)} bytes, not 32")
    result: VerifyKey = decode_verify_key_bytes(key_id_, raw)
    return result


def parse_server_keys(server_name: str, body: Any, now_ms: int) -> ServerKeys:
    """Check a remote's ``GET /_matrix/key/v2/server`` body.

    Input from a remote server: every field is bounded before use. The body
    must name ``server_name``, list at most :data:`MAX_VERIFY_KEYS` ed25519
    keys, be signed by one of them, and not have expired. The returned
    validity is capped at :data:`MAX_KEY_VALIDITY_MS` from ``now_ms``.

    Raises:
        KeyResponseError: saying what is wrong.
    """
    if not isinstance(body, dict):
        raise KeyResponseError("key response is not a JSON object")
    if body.get("server_name") != server_name:
        raise KeyResponseError(f"key response names {str(body.get('server_name'))[:80]!r}, not {server_name!r}")
    valid_until = body.get("valid_until_ts")
    if isinstance(valid_until, bool) or not isinstance(valid_until, int) or not 0 <= valid_until <= MAX_SAFE_INTEGER:
        raise KeyResponseError("valid_until_ts is not an integer in [0, 2^53]")
    if valid_until <= now_ms:
        raise KeyResponseError(f"key response expired at {valid_until} (now {now_ms})")
    listed = body.get("verify_keys")
    if not isinstance(listed, dict) or not 0 < len(listed) <= MAX_VERIFY_KEYS:
        raise KeyResponseError(f"verify_keys must be an object of 1 to {MAX_VERIFY_KEYS} keys")
    keys: dict[str, VerifyKey] = {}
    for kid, entry in listed.items():
        if not kid.startswith(ALGORITHM + ":"):
            continue  # another algorithm: not ours to use
        if not isinstance(entry, dict) or not isinstance(entry.get("key"), str):
            raise KeyResponseError(f"verify_keys.{kid[:80]} is not an object with a key string")
        try:
            keys[kid] = decode_verify_key(kid, entry["key"])
        except ValueError as e:
            raise KeyResponseError(str(e)) from None
    signatures = body.get("signatures")
    own = signatures.get(server_name) if isinstance(signatures, dict) else None
    if not isinstance(own, dict) or not any(kid in keys for kid in own):
        raise KeyResponseError(f"key response is not signed by one of {server_name}'s listed keys")
    for kid in own:
        if kid in keys:
            try:
                verify_signed_json(body, server_name, keys[kid])
            except SignatureVerifyException as e:
                raise KeyResponseError(f"self-signature by {kid} does not verify: {e}") from None
            break
    return ServerKeys(server_name, keys, min(valid_until, now_ms + MAX_KEY_VALIDITY_MS))
