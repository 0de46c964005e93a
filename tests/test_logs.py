"""The process log's text format: the same lines as twistd's own observer, the time formatted once a second."""

from __future__ import annotations

import io

from twisted.logger import LogLevel, textFileLogObserver
from twisted.trial.unittest import SynchronousTestCase

from synflow.app import logs


class TextObserverTest(SynchronousTestCase):
    def test_lines_match_twistd(self):
        """Every line equals what textFileLogObserver writes, across second boundaries and without a time."""
        ours, theirs = io.StringIO(), io.StringIO()
        mine, reference = logs.text_observer(ours), textFileLogObserver(theirs)
        for when in (1_800_000_000.1, 1_800_000_000.9, 1_800_000_001.0, 1_800_000_003.5, None):
            event = {"log_format": "sent {n}", "n": 3, "log_namespace": "synflow.access", "log_level": LogLevel.info,
                     "log_time": when}
            mine(dict(event))
            reference(dict(event))
        self.assertEqual(ours.getvalue(), theirs.getvalue())
        self.assertEqual(len(ours.getvalue().splitlines()), 5)

    def test_preformatted_lines_match_twistd(self):
        """Events the stdlib bridge emits (text already formatted) give twistd's lines, newlines and braces too."""
        ours, theirs = io.StringIO(), io.StringIO()
        mine, reference = logs.text_observer(ours), textFileLogObserver(theirs)
        for msg, level in (("GET /sync 200 3.1ms @u:hs", LogLevel.info), ("two\nlines {x}", LogLevel.warn),
                           ("no level", None)):
            event = {"log_format": logs.PREFORMATTED, "msg": msg, "log_namespace": "synflow.access",
                     "log_level": level, "log_time": 1_800_000_000.5}
            mine(dict(event))
            reference(dict(event))
        self.assertEqual(ours.getvalue(), theirs.getvalue())

    def test_stdlib_records_reach_the_text_log(self):
        """A stdlib record through the bridge is one classic line with its logger, level and formatted message."""
        import logging

        from twisted.logger import globalLogPublisher

        from synflow.app.build import _StderrHandler

        out = io.StringIO()
        observer = logs.text_observer(out)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.emit(logging.LogRecord("synflow.access", logging.WARNING, "", 0, "%s {not a field} %d", ("GET", 5),
                                       None))
        self.assertTrue(out.getvalue().endswith(" [synflow.access#warn] GET {not a field} 5\n"), out.getvalue())

    def test_time_formatted_once_per_second(self):
        """Within one second the formatted time is reused; the next second formats again."""
        calls = []
        self.patch(logs, "formatTime", lambda when: calls.append(when) or str(when))
        cache = logs._SecondCache()
        self.assertEqual([cache(10.1), cache(10.7), cache(11.2)], ["10", "10", "11"])
        self.assertEqual(calls, [10, 11])


class AccessLogTest(SynchronousTestCase):
    def test_internal_rpc_at_debug_client_at_info(self):
        """A client request is an INFO access line; an internal RPC call between processes is DEBUG."""
        import logging

        from synflow.http.server import JsonSite, access_logger

        class Request:
            method, code, arrived = b"PUT", 200, 0.0

            def __init__(self, path: bytes) -> None:
                self.path = self.uri = path

        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append  # type: ignore[method-assign]
        access_logger.addHandler(handler)
        self.addCleanup(access_logger.removeHandler, handler)
        self.addCleanup(access_logger.setLevel, access_logger.level)
        access_logger.setLevel(logging.DEBUG)
        site = JsonSite.__new__(JsonSite)
        site.log(Request(b"/_synflow/client/v1/rooms/!r:hs/send/m.room.message/t1"))
        site.log(Request(b"/_synflow/internal/persist_events/abc"))
        self.assertEqual([(r.levelno, r.getMessage().split()[1]) for r in records],
                         [(logging.INFO, "/_synflow/client/v1/rooms/!r:hs/send/m.room.message/t1"),
                          (logging.DEBUG, "/_synflow/internal/persist_events/abc")])
        access_logger.setLevel(logging.INFO)
        site.log(Request(b"/_synflow/internal/persist_events/abc"))
        self.assertEqual(len(records), 2)  # not even formatted below the logger's level
