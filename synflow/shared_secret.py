"""The deployment's shared secret for its internal channels (hub ``AUTH``, RPC bearer token).

Every process of a deployment reads one secret file, ``replication.secret_path``
(by default ``<data_dir>/replication.secret``). Whoever needs it first --
``synflowctl start``, or any process started directly with ``twistd -n
synflow`` -- creates it; any number of processes may race to do so:

1. a random secret is written to a private temporary file beside the target
   (``O_CREAT | O_EXCL``, mode 0600) and flushed to disk;
2. the temporary file is hard-linked to the target name. ``link`` fails if
   the target exists, so exactly one creator wins, and a reader never sees a
   partly written file: the name appears only once its content is complete;
3. everyone -- winner and losers -- then reads the target.

A secret file that others may read or write (any group/other permission
bit) is refused: the secret would no longer be secret.

This module also says which addresses count as loopback, for the rule that
a process without a secret may only expose its internal channels there.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import stat
from typing import Final

from synflow.errors import ConfigError

#: Bytes of randomness in a generated secret (256 bits).
SECRET_BYTES: Final = 32
#: The longest secret accepted from a file (it travels in one AUTH line).
MAX_SECRET_CHARS: Final = 1024
#: The default file name under ``data_dir``.
DEFAULT_SECRET_NAME: Final = "replication.secret"


def generate_secret() -> str:
    """A new random secret: URL-safe text without spaces, fit for an AUTH line and a bearer token."""
    return secrets.token_urlsafe(SECRET_BYTES)


def read_secret(path: str, key: str, *, private: bool = True) -> str:
    """The secret held in ``path`` (surrounding whitespace removed).

    Args:
        path: the secret file.
        key: the config key naming the file, for error messages.
        private: refuse a file with any group or other permission bit.

    Raises:
        FileNotFoundError: there is no such file.
        ConfigError: it cannot be read, is not private, is empty, too long or
            holds whitespace inside (the message never shows the secret).
    """
    try:
        with open(path, encoding="utf-8") as f:
            mode = os.fstat(f.fileno()).st_mode
            text = f.read(MAX_SECRET_CHARS + 2)
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise ConfigError(f"cannot read secret file {path!r}: {reason}", key=key) from None
    if private and mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"secret file {path!r} is accessible to other users (mode {stat.S_IMODE(mode):04o}); "
            f"run chmod 600 on it", key=key,
        )
    value = text.strip()
    if not value:
        raise ConfigError(f"secret file {path!r} is empty; delete it to have a new secret created", key=key)
    if len(value) > MAX_SECRET_CHARS or any(c.isspace() for c in value):
        raise ConfigError(
            f"secret file {path!r} must hold one word of at most {MAX_SECRET_CHARS} characters", key=key,
        )
    return value


def load_or_create_secret(path: str, key: str = "replication.secret_path") -> str:
    """The secret in ``path``, creating the file (mode 0600) with a random one if it is missing.

    Safe against any number of processes doing the same at once: see the
    module docstring.

    Raises:
        ConfigError: the file (or its directory) cannot be created or read,
            or what it holds is not a usable secret.
    """
    try:
        return read_secret(path, key)
    except FileNotFoundError:
        pass
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(generate_secret() + "\n")
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass  # another process created it first: use theirs
        finally:
            os.unlink(tmp)
    except OSError as e:
        raise ConfigError(f"cannot create secret file {path!r}: {e.strerror}", key=key) from None
    try:
        return read_secret(path, key)
    except FileNotFoundError:
        raise ConfigError(f"secret file {path!r} vanished right after it was created", key=key) from None


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # another host name: it may resolve anywhere


__all__ = [
    "DEFAULT_SECRET_NAME",
    "MAX_SECRET_CHARS",
    "generate_secret",
    "is_loopback",
    "load_or_create_secret",
    "read_secret",
]
