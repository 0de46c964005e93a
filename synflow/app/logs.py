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
* Lines below WARNING logged while the reactor runs are written together
  at the end of the reactor's turn (one write for the access lines of
  every request it answered, not one each); a WARNING or worse line, a
  line logged from another thread or while the reactor is not running
  writes them at once. A process killed outright loses at most the lines
  of the turn it was in.

The observer reaches twistd as the application's ``ILogObserver`` component,
which twistd prefers over the one it would build. Internal: the twistd
plugin calls :func:`with_log_observer`.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import IO, Any

from twisted.application.service import IService, MultiService
from twisted.logger import (
    ILogObserver,
    LogEvent,
    LogLevel,
    LogLevelFilterPredicate,
    formatEvent,
    formatEventAsClassicLogText,
    formatTime,
)
from twisted.python import threadable
from twisted.python.logfile import LogFile
from zope.interface import implementer

from synflow.config import SynflowConfig
from synflow.logbridge import PREFORMATTED

__all__ = ["HeldLines", "JsonLogObserver", "LevelFilter", "make_observer", "with_log_observer"]

_TWISTED_LEVELS = {"DEBUG": LogLevel.debug, "INFO": LogLevel.info, "WARNING": LogLevel.warn, "ERROR": LogLevel.error}
#: The levels whose lines are written at once (see :class:`HeldLines`).
_URGENT = frozenset({LogLevel.warn, LogLevel.error, LogLevel.critical})
#: Each level's rank, lowest first: compared as ints (LogLevel's own comparisons are Python methods).
_RANK = {level: rank for rank, level in enumerate(LogLevel.iterconstants())}
_LEVEL_NAMES = {LogLevel.debug: "debug", LogLevel.info: "info", LogLevel.warn: "warning",
                LogLevel.error: "error", LogLevel.critical: "critical"}


@implementer(ILogObserver)
class JsonLogObserver:
    """Writes each log event as one JSON object per line."""

    def __init__(self, out: IO[str] | LogFile | HeldLines, instance: str) -> None:
        self._out = out if isinstance(out, HeldLines) else HeldLines(out)
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
        self._out.write(json.dumps(record, ensure_ascii=False, default=str) + "\n", level)


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


class HeldLines:
    """A log file's lines, written together at the end of the reactor's turn.

    :meth:`write` holds a line logged on the reactor's thread while it runs
    and writes every held line once the turn's work is done (a
    ``callLater(0)``): the process log is unbuffered, so each line would
    otherwise be a system call of its own. A line at WARNING or above, a
    line from another thread (the database threads log too), a line while
    the reactor is not running (start-up, shutdown, tests) or past
    :data:`MAX_HELD_CHARS` held writes the held lines and itself at once,
    in the order they were logged.
    """

    #: Held text past which the lines are written without waiting for the turn to end.
    MAX_HELD_CHARS = 64 * 1024

    def __init__(self, out: IO[str] | LogFile, reactor: Any = None) -> None:
        self._out = out
        self._reactor = reactor
        self._held: list[str] = []
        self._held_chars = 0
        self._lock = threading.Lock()

    def write(self, text: str, level: Any = None) -> None:
        """Write ``text`` (whole lines), held until the turn ends unless it must go now (see the class)."""
        if level in _URGENT or not self._may_hold():
            with self._lock:
                held, self._held, self._held_chars = self._held, [], 0
                held.append(text)
                self._write(held)
            return
        with self._lock:
            first = not self._held
            self._held.append(text)
            self._held_chars += len(text)
            full = self._held_chars > self.MAX_HELD_CHARS
        if full:
            self.flush()
        elif first:
            self._reactor_now().callLater(0, self.flush)

    def flush(self) -> None:
        """Write the held lines now."""
        with self._lock:
            held, self._held, self._held_chars = self._held, [], 0
            if held:
                self._write(held)

    def _flush_at_exit(self) -> None:
        try:
            self.flush()
        except (OSError, ValueError):  # the file is gone or closed by now: nothing left to write to
            pass

    def _write(self, lines: list[str]) -> None:
        self._out.write("".join(lines))
        self._out.flush()

    def _may_hold(self) -> bool:
        reactor = self._reactor_now()
        return bool(getattr(reactor, "running", False)) and threadable.ioThread == threading.get_ident()

    def _reactor_now(self) -> Any:
        if self._reactor is None:
            from twisted.internet import reactor

            self._reactor = reactor
            # Lines held when the reactor stops are written as it shuts down, or at exit at the latest.
            reactor.addSystemEventTrigger("after", "shutdown", self.flush)
            atexit.register(self._flush_at_exit)
        return self._reactor


@implementer(ILogObserver)
class _TextObserver:
    """Writes each event as twistd's classic text line through :class:`HeldLines`."""

    def __init__(self, out: HeldLines) -> None:
        self._out = out
        self._time = _SecondCache()

    def __call__(self, event: LogEvent) -> None:
        level = event.get("log_level")
        text = preformatted_text(event)
        if text is None or not text or "log_system" in event:
            line = formatEventAsClassicLogText(event, formatTime=self._time)
        else:
            # formatEventAsClassicLogText's line, without its generic formatting of the message.
            system = f"{event.get('log_namespace') or '-'}#{level.name if level is not None else '-'}"
            line = f"{self._time(event.get('log_time'))} [{system}] {text.replace(chr(10), chr(10) + chr(9))}\n"
        if line:
            self._out.write(line, level)


def text_observer(out: IO[str] | LogFile | HeldLines) -> ILogObserver:
    """twistd's classic text lines (``TIME [namespace#level] message``), as ``textFileLogObserver`` writes them."""
    return _TextObserver(out if isinstance(out, HeldLines) else HeldLines(out))


@implementer(ILogObserver)
class LevelFilter:
    """Passes an event on when its level is at least its namespace's (``LogLevelFilterPredicate``'s rule).

    The namespace's level is the one set for its longest dotted prefix, or
    the default; an event without a level or a namespace is dropped. The
    level found for each namespace is kept (at most :data:`MAX_NAMESPACES`
    of them), where ``FilteringLogObserver`` walks the prefixes for every
    event.
    """

    #: Namespaces whose level is kept; past this many the kept levels start again.
    MAX_NAMESPACES = 1024

    def __init__(self, observer: ILogObserver, predicate: LogLevelFilterPredicate) -> None:
        self._observer = observer
        self._predicate = predicate
        self._levels: dict[str, int] = {}

    def __call__(self, event: LogEvent) -> None:
        level = event.get("log_level")
        namespace = event.get("log_namespace")
        if level is None or not namespace:
            return
        least = self._levels.get(namespace)
        if least is None:
            if len(self._levels) >= self.MAX_NAMESPACES:
                self._levels.clear()
            least = self._levels[namespace] = _RANK[self._predicate.logLevelForNamespace(namespace)]
        if _RANK.get(level, -1) >= least:
            self._observer(event)


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
    return LevelFilter(base, predicate)


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
