"""Builds the service tree of one process from its validated config."""

from __future__ import annotations

import logging
import sys
from typing import Any

from twisted.application.service import MultiService

from synflow.app.services import ListeningService
from synflow.config import SynflowConfig
from synflow.errors import ConfigError
from synflow.replication.hub import ReplicationHub, ReplicationServerFactory


class _TwistedLogHandler(logging.Handler):
    """Sends stdlib log records to Twisted's log (and so to twistd's logfile)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = self.format(record)
        except Exception:  # pragma: no cover
            msg = record.getMessage()
        sys.stderr.write(msg + "\n")


def setup_logging(config: SynflowConfig) -> None:
    """Route synflow's stdlib logging into the process log at the configured level."""
    root = logging.getLogger()
    if not any(isinstance(h, _TwistedLogHandler) for h in root.handlers):
        handler = _TwistedLogHandler()
        handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
        root.addHandler(handler)
    root.setLevel(config.log_level.upper())


def build_service(config: SynflowConfig, reactor: Any) -> MultiService:
    """The process's root service for its ``app``."""
    top = MultiService()
    if config.app == "master":
        hub = ReplicationHub(None)
        factory = ReplicationServerFactory(
            hub,
            config.server_name,
            reactor,
            ping_interval_s=config.replication.ping_interval_s,
            ping_timeout_s=config.replication.ping_timeout_s,
            high_water=config.replication.high_water,
            hard_limit=config.replication.hard_limit,
        )
        svc = ListeningService(reactor, config.replication.hub.server_endpoint(), factory)
        svc.setName("replication-hub")
        svc.setServiceParent(top)
        top.hub = hub  # type: ignore[attr-defined]
        return top
    raise ConfigError(f"app {config.app!r} is not available yet", key="app")
