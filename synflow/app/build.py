"""Builds the service tree of one process from its validated config.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import logging
from typing import Any

from twisted.logger import Logger, LogLevel

from synflow.app.apps import SynflowProcess
from synflow.app.logs import PREFORMATTED
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

    def __init__(self) -> None:
        super().__init__()
        self._loggers: dict[str, Logger] = {}

    def emit(self, record: logging.LogRecord) -> None:
        # Formatted once, here; the observers write the text as it is (see logs.PREFORMATTED).
        try:
            msg = self.format(record) if record.exc_info or record.exc_text or record.stack_info else record.getMessage()
        except Exception:  # pragma: no cover
            msg = record.getMessage()
        logger = self._loggers.get(record.name)
        if logger is None:
            logger = self._loggers[record.name] = Logger(namespace=record.name)
        # What Logger.emit builds, without its per-call checks (the level is always a valid one here).
        logger.observer({
            "msg": msg, "log_logger": logger, "log_level": _LEVELS.get(record.levelno, LogLevel.info),
            "log_namespace": record.name, "log_source": None, "log_format": PREFORMATTED, "log_time": record.created,
        })


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


def build_service(config: SynflowConfig, reactor: Any, *, exit_on_failure: bool = True) -> SynflowProcess:
    """The process's root service for its ``app``."""
    return SynflowProcess(config, reactor, exit_on_failure=exit_on_failure)
