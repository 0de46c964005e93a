"""Server endpoint descriptions in config: checked at load time, and their TCP address when they have one.

A listener's ``endpoint`` is any Twisted server endpoint description:
``tcp:8008:interface=127.0.0.1``, ``tcp6:8008:interface=\\:\\:1``,
``ssl:8448:privateKey=key.pem:certKey=cert.pem``, ``unix:/run/synflow/client.sock``,
``systemd:domain=INET:index=0`` (a socket systemd passes in, see
``contrib/systemd``). :func:`endpoint_problem` checks one the way Twisted
will parse it, without listening; :func:`tcp_address` gives the interface
and port of the ones that have a port (tcp, tcp6, ssl), which is all that
port-clash checks and URLs need. Internal: used by config validation and
``synflowctl``.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

from typing import Any

from twisted.internet.endpoints import serverFromString

__all__ = ["endpoint_problem", "split_description", "tcp_address"]

#: Endpoint types that listen on a TCP port.
TCP_TYPES = ("tcp", "tcp6", "ssl")
#: The domains the systemd endpoint accepts.
SYSTEMD_DOMAINS = ("INET", "INET6", "UNIX")


def split_description(description: str) -> tuple[str, list[str], dict[str, str]]:
    """Split a description as Twisted does: ``:`` separates, ``\\`` escapes; ``k=v`` parts are keywords."""
    parts: list[str] = []
    current = []
    chars = iter(description)
    for ch in chars:
        if ch == "\\":
            current.append(next(chars, ""))
        elif ch == ":":
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    kind, rest = parts[0], parts[1:]
    args = [p for p in rest if "=" not in p]
    kwargs = dict(p.split("=", 1) for p in rest if "=" in p)
    return kind, args, kwargs


def tcp_address(description: str) -> tuple[str, int | None] | None:
    """``(interface, port)`` of a tcp/tcp6/ssl description (port None if it is not a number); None for others."""
    kind, args, kwargs = split_description(description)
    if kind not in TCP_TYPES:
        return None
    raw = kwargs.get("port", args[0] if args else "")
    default = "::" if kind == "tcp6" else "0.0.0.0"
    return kwargs.get("interface", default), int(raw) if raw.isdigit() else None


class _NoReactor:
    """Stands in for the reactor while a description is only parsed (nothing listens)."""

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"parsing an endpoint description does not use the reactor ({name})")


def endpoint_problem(description: str) -> str | None:
    """Why ``description`` is not a usable server endpoint description, or None if it is."""
    kind, args, kwargs = split_description(description)
    if kind == "systemd":
        # Parsing it for real needs the sockets systemd passes (LISTEN_FDS): check its shape only.
        if kwargs.get("domain") not in SYSTEMD_DOMAINS:
            return f"systemd endpoints need domain=INET, INET6 or UNIX: {description!r}"
        if not (kwargs.get("index", "").isdigit() or kwargs.get("name")):
            return f"systemd endpoints need index=N or name=NAME: {description!r}"
        return None
    if kind in TCP_TYPES:
        address = tcp_address(description)
        if address is None or address[1] is None:
            return f"no port number in {description!r}"
    try:
        serverFromString(_NoReactor(), description)
    except (ValueError, TypeError, KeyError, IndexError, OSError) as e:
        return f"not a server endpoint description: {description!r} ({e})"
    return None
