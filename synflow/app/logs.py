"""The process log: where it goes, its format, its rotation and its levels.

twistd picks the log target (``--logfile PATH``, ``--logfile=-`` for stdout
as under systemd, stdout with ``--nodaemon`` and no file); synflow decides
the rest from the ``logging:`` config section:

* ``format: text`` is twistd's own line format
  (``2026-11-26T02:40:00+0000 [synflow.federation.sender#info] message``);
  ``format: json`` writes one JSON object per line with ``time`` (ISO 8601,
  UTC), ``level``, ``logger``, ``instance`` and ``message`` (and ``failure``
  with the traceback, when there is one).
* The file rotates past ``max_bytes`` and keeps ``backups`` rotated files
  (twistd alone rotates at 1 MB and never deletes). SIGUSR1 rotates it now.
* ``levels`` sets a level per logger name: a stdlib logger
  (``synflow.federation``) and the Twisted log namespace of the same name.

The observer reaches twistd as the application's ``ILogObserver`` component,
which twistd prefers over the one it would build. Internal: the twistd
plugin calls :func:`with_log_observer`.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from typing import IO, Any, cast

from twisted.application.service import IService, MultiService
from twisted.logger import (
    FileLogObserver,
    FilteringLogObserver,
    ILogObserver,
    LogEvent,
    LogLevel,
    LogLevelFilterPredicate,
    formatEvent,
    formatEventAsClassicLogText,
    formatTime,
)
from twisted.python.logfile import LogFile
from zope.interface import implementer

from synflow.config import SynflowConfig
from synflow.logbridge import PREFORMATTED

__all__ = ["JsonLogObserver", "make_observer", "with_log_observer"]

_TWISTED_LEVELS = {"DEBUG": LogLevel.debug, "INFO": LogLevel.info, "WARNING": LogLevel.warn, "ERROR": LogLevel.error}
_LEVEL_NAMES = {LogLevel.debug: "debug", LogLevel.info: "info", LogLevel.warn: "warning",
                LogLevel.error: "error", LogLevel.critical: "critical"}


@implementer(ILogObserver)
class JsonLogObserver:
    """Writes each log event as one JSON object per line."""

    def __init__(self, out: IO[str] | LogFile, instance: str) -> None:
        self._out = out
        self._instance = instance
        self._second: int | None = None  # the time's text to the second, computed once a second
        self._second_text = ""

    def __call__(self, event: LogEvent) -> None:
        level = event.get("log_level")
        when = event.get("log_time")
        if when is None:
            when = time.time()
        second = int(when)
        if second != self._second:
            self._second, self._second_text = second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        text = preformatted_text(event)
        record: dict[str, Any] = {
            "time": f"{self._second_text}.{int(when * 1000) % 1000:03d}Z",
            "level": _LEVEL_NAMES.get(level, "info") if level is not None else "info",
            "logger": _logger_name(event),
            "instance": self._instance,
            "message": text if text is not None else formatEvent(event),
        }
        failure = event.get("log_failure")
        if failure is not None:
            record["failure"] = failure.getTraceback()
        self._out.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
        self._out.flush()


def preformatted_text(event: LogEvent) -> str | None:
    """The event's message if it arrived formatted (:data:`PREFORMATTED`, no failure), else None."""
    msg = event.get("msg")
    if type(msg) is str and event.get("log_format") == PREFORMATTED and "log_failure" not in event:
        return msg
    return None


class _SecondCache:
    """``formatTime`` of an event, computed once per second of ``log_time`` (the classic text format has no
    finer field, and formatting a time zone-aware timestamp is a large part of writing a log line)."""

    def __init__(self) -> None:
        self._second: int | None = None
        self._text = ""

    def __call__(self, when: float | None) -> str:
        if when is None:
            return formatTime(when)
        second = int(when)
        if second != self._second:
            self._second, self._text = second, formatTime(second)
        return self._text


def text_observer(out: IO[str] | LogFile) -> ILogObserver:
    """twistd's classic text lines (``TIME [namespace#level] message``), as ``textFileLogObserver`` writes them."""
    cached = _SecondCache()

    def line(event: LogEvent) -> str | None:
        text = preformatted_text(event)
        if text is None or not text or "log_system" in event:
            return formatEventAsClassicLogText(event, formatTime=cached)
        # formatEventAsClassicLogText's line, without its generic formatting of the message.
        level = event.get("log_level")
        system = f"{event.get('log_namespace') or '-'}#{level.name if level is not None else '-'}"
        return f"{cached(event.get('log_time'))} [{system}] {text.replace(chr(10), chr(10) + chr(9))}\n"

    return FileLogObserver(cast(IO[str], out), line)


def _logger_name(event: LogEvent) -> str:
    """The event's logger: its namespace, or for legacy ``twisted.python.log`` messages their system."""
    namespace = event.get("log_namespace")
    if namespace and namespace != "log_legacy":
        return str(namespace)
    system = event.get("system") or event.get("log_system")
    return f"twisted:{system}" if system and system != "-" else "twisted"


def _target(logfile: str | None, nodaemon: bool, config: SynflowConfig) -> IO[str] | LogFile:
    """Where twistd was told to log, rotating by the config when it is a file."""
    if logfile == "-" or (nodaemon and not logfile):
        return sys.stdout
    path = os.path.abspath(logfile or "twistd.log")
    out = LogFile(os.path.basename(path), os.path.dirname(path), rotateLength=config.logging.max_bytes,
                  maxRotatedFiles=config.logging.backups)
    if not signal.getsignal(signal.SIGUSR1):
        signal.signal(signal.SIGUSR1, lambda *_: _rotate_soon(out))
    return out


def _rotate_soon(out: LogFile) -> None:
    from twisted.internet import reactor

    reactor.callFromThread(out.rotate)  # type: ignore[attr-defined]


def make_observer(config: SynflowConfig, logfile: str | None, nodaemon: bool) -> ILogObserver:
    """The process's log observer: format, rotation and per-logger levels from ``config.logging``.

    Also sets the stdlib level of each logger named in ``logging.levels``
    (the root logger is at ``log_level``, see ``setup_logging``).
    """
    out = _target(logfile, nodaemon, config)
    base: ILogObserver
    if config.logging.format == "json":
        base = JsonLogObserver(out, config.instance_name)
    else:
        base = text_observer(out)
    predicate = LogLevelFilterPredicate(defaultLogLevel=_TWISTED_LEVELS[config.log_level.upper()])
    for name, level in config.logging.levels.items():
        predicate.setLogLevelForNamespace(name, _TWISTED_LEVELS[level.upper()])
        logging.getLogger(name).setLevel(level.upper())
    return FilteringLogObserver(base, [predicate])


class _LogRoot(MultiService):
    """The process's root service; hands twistd the log observer as the application's component."""

    def __init__(self, child: IService, observer: ILogObserver) -> None:
        super().__init__()
        self.observer = observer
        child.setServiceParent(self)

    def setServiceParent(self, parent: Any) -> None:
        set_component = getattr(parent, "setComponent", None)
        if set_component is not None:
            set_component(ILogObserver, self.observer)
        super().setServiceParent(parent)


def with_log_observer(service: IService, observer: ILogObserver) -> IService:
    """``service`` under a root that makes twistd log through ``observer``."""
    return _LogRoot(service, observer)
