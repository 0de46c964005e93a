"""How to reach a configured Redis: its client endpoint and its password.

Shared by the Redis replication transport (``synflow.replication.redis``)
and the shared cache tier (``synflow.caching.tier``), which both take a
:class:`~synflow.config.RedisConfig`.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

from typing import Any

from twisted.internet import ssl
from twisted.internet.endpoints import TCP4ClientEndpoint, UNIXClientEndpoint, wrapClientTLS
from twisted.internet.interfaces import IStreamClientEndpoint

from synflow.config import RedisConfig

__all__ = ["redis_endpoint", "redis_password"]


def redis_password(cfg: RedisConfig) -> str | None:
    """The configured password, or the password file's contents stripped (None without either)."""
    if cfg.password is not None:
        return cfg.password
    if cfg.password_file is not None:
        with open(cfg.password_file, encoding="utf-8") as f:
            return f.read().strip()
    return None


def redis_endpoint(reactor: Any, cfg: RedisConfig) -> IStreamClientEndpoint:
    """The client endpoint for a Redis config: Unix socket, TCP, or TLS over TCP."""
    if cfg.path:
        return UNIXClientEndpoint(reactor, cfg.path, timeout=cfg.connect_timeout_s)
    endpoint: IStreamClientEndpoint = TCP4ClientEndpoint(reactor, cfg.host, cfg.port, timeout=cfg.connect_timeout_s)
    if cfg.tls is not None:
        kwargs: dict[str, Any] = {}
        if cfg.tls.ca_file:
            with open(cfg.tls.ca_file, "rb") as f:
                kwargs["trustRoot"] = ssl.Certificate.loadPEM(f.read())
        if cfg.tls.cert_file:
            with open(cfg.tls.cert_file, "rb") as f:
                cert = f.read()
            key = cert
            if cfg.tls.key_file:
                with open(cfg.tls.key_file, "rb") as f:
                    key = f.read()
            kwargs["clientCertificate"] = ssl.PrivateCertificate.loadPEM(cert + b"\n" + key)
        endpoint = wrapClientTLS(ssl.optionsForClientTLS(cfg.host, **kwargs), endpoint)
    return endpoint
