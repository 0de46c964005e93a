"""Builds the service tree of one process from its validated config.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import logging
from typing import Any

from twisted.application.service import MultiService
from twisted.logger import Logger, LogLevel

from synflow.app.apps import SynflowProcess
from synflow.config import SynflowConfig

_LEVELS = {
    logging.DEBUG: LogLevel.debug, logging.INFO: LogLevel.info, logging.WARNING: LogLevel.warn,
    logging.ERROR: LogLevel.error, logging.CRITICAL: LogLevel.critical,
}


class _StderrHandler(logging.Handler):
    """Sends stdlib log records into Twisted's log, at their own level.

    Under twistd that is the process's log file, as
    ``[synflow.replication.handler#info] message``.
    """

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = self.format(record)
        except Exception:  # pragma: no cover
            msg = record.getMessage()
        level = _LEVELS.get(record.levelno, LogLevel.info)
        Logger(namespace=record.name).emit(level, "{msg}", msg=msg)


def setup_logging(config: SynflowConfig) -> None:
    """Route synflow's stdlib logging into the process log at the configured level."""
    root = logging.getLogger()
    if not any(isinstance(h, _StderrHandler) for h in root.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
    root.setLevel(config.log_level.upper())
    # The log lines carry no caller, thread or process fields: skip collecting
    # them for every record (the logging HOWTO's "Optimization" settings).
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False


def build_service(config: SynflowConfig, reactor: Any, *, exit_on_failure: bool = True) -> MultiService:
    """The process's root service for its ``app``."""
    return SynflowProcess(config, reactor, exit_on_failure=exit_on_failure)
