"""synflow's stdlib logging, carried into Twisted's log (the process log under twistd).

:class:`TwistedBridge` is the root logger's handler in every synflow
process (``synflow.app.build.setup_logging``): each stdlib record becomes a
Twisted log event at its own level, in the namespace of its logger, with its
text already formatted (:data:`PREFORMATTED`), so the process log's observers
write it as it is.

:func:`log_text` is ``logger.log(level, "%s", text)`` for lines logged on
every request (the access log): when the bridge is the only handler the
record would reach, it hands the text to the bridge directly, without the
stdlib's record, filter and handler walk, which cost more than the rest of
writing the line. Anything else on the way -- another handler, a filter, a
record factory, a logger that does not propagate to the bridge -- and the
line goes through ``logger.log`` as before, so what every handler receives
is unchanged.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import logging
import time

from twisted.logger import Logger, LogLevel

__all__ = ["PREFORMATTED", "TwistedBridge", "log_text"]

#: The ``log_format`` of the events the bridge emits: the text is already formatted, in the event's ``msg``,
#: so the observers write it without running Twisted's format machinery.
PREFORMATTED = "{msg}"

_LEVELS = {
    logging.DEBUG: LogLevel.debug, logging.INFO: LogLevel.info, logging.WARNING: LogLevel.warn,
    logging.ERROR: LogLevel.error, logging.CRITICAL: LogLevel.critical,
}


class TwistedBridge(logging.Handler):
    """Sends stdlib log records into Twisted's log, at their own level.

    Under twistd that is the process's log file, as
    ``[synflow.replication.handler#info] message``.
    """

    def __init__(self) -> None:
        super().__init__()
        self._loggers: dict[str, Logger] = {}

    def emit(self, record: logging.LogRecord) -> None:
        # Formatted once, here; the observers write the text as it is (see PREFORMATTED).
        try:
            msg = self.format(record) if record.exc_info or record.exc_text or record.stack_info else record.getMessage()
        except Exception:  # pragma: no cover
            msg = record.getMessage()
        self.emit_text(record.name, record.levelno, msg, record.created)

    def emit_text(self, name: str, levelno: int, msg: str, when: float) -> None:
        """One event of logger ``name`` at stdlib level ``levelno`` with the text ``msg``, logged at ``when``."""
        logger = self._loggers.get(name)
        if logger is None:
            logger = self._loggers[name] = Logger(namespace=name)
        # What Logger.emit builds, without its per-call checks (the level is always a valid one here).
        logger.observer({
            "msg": msg, "log_logger": logger, "log_level": _LEVELS.get(levelno, LogLevel.info),
            "log_namespace": name, "log_source": None, "log_format": PREFORMATTED, "log_time": when,
        })


def _sole_bridge(logger: logging.Logger, level: int) -> TwistedBridge | None:
    """The bridge, if a record of ``logger`` at ``level`` would reach it and nothing else, unaltered; else None."""
    if logger.filters or logger.disabled or logging.getLogRecordFactory() is not logging.LogRecord:
        return None
    found: TwistedBridge | None = None
    current: logging.Logger | None = logger
    while current is not None:
        for handler in current.handlers:
            if level < handler.level:
                continue  # it would not see the record either way
            if found is not None or type(handler) is not TwistedBridge or handler.filters:
                return None
            found = handler
        if not current.propagate:
            break
        current = current.parent
    return found  # None: no handler at all, where the stdlib's last resort would write it


def log_text(logger: logging.Logger, level: int, text: str) -> None:
    """``logger.log(level, "%s", text)``, straight to the bridge when nothing else would see the record.

    The caller has checked ``logger.isEnabledFor(level)``.
    """
    bridge = _sole_bridge(logger, level)
    if bridge is None:
        logger.log(level, "%s", text)
        return
    when = time.time()
    bridge.acquire()  # as Handler.handle: the bridge is also called from the database threads
    try:
        bridge.emit_text(logger.name, level, text, when)
    finally:
        bridge.release()
