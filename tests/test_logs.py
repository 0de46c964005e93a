"""The process log's text format: the same lines as twistd's own observer, the time formatted once a second."""

from __future__ import annotations

import io
import threading
import time
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
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

        from synflow.logbridge import TwistedBridge

        out = io.StringIO()
        observer = logs.text_observer(out)
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        handler = TwistedBridge()
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


class LogTextTest(SynchronousTestCase):
    """``logbridge.log_text``: straight to the bridge when it alone would see the record, else the stdlib's path."""

    def setUp(self) -> None:
        import logging

        from twisted.logger import globalLogPublisher

        from synflow.logbridge import TwistedBridge

        # A hierarchy of its own, not under the process's root logger: parent (with the bridge) <- child.
        self.parent = logging.Logger("logtexttest")
        self.bridge = TwistedBridge()
        self.parent.addHandler(self.bridge)
        self.child = logging.Logger("logtexttest.access")
        self.child.parent = self.parent
        self.events: list[dict] = []

        def observe(event: dict) -> None:
            if str(event.get("log_namespace", "")).startswith("logtexttest"):
                self.events.append(event)

        globalLogPublisher.addObserver(observe)
        self.addCleanup(globalLogPublisher.removeObserver, observe)
        self.records: list = []

    def _count_records(self) -> None:
        original = self.child.handle

        def handle(record):
            self.records.append(record)
            return original(record)

        self.child.handle = handle  # type: ignore[method-assign]

    def _strip(self, event: dict) -> dict:
        # What the bridge puts in an event (the publisher adds its own keys, some of them objects made per event).
        keys = ("msg", "log_logger", "log_level", "log_namespace", "log_source", "log_format")
        return {k: event.get(k, "absent") for k in keys}

    def test_sole_bridge_gets_the_text_without_a_record(self):
        """With the bridge the only handler on the way, no stdlib record is made; the event is the stdlib path's."""
        import logging

        from synflow.logbridge import log_text

        self._count_records()
        log_text(self.child, logging.INFO, "GET /sync 200 1.0ms @u:hs {x} %s")
        self.assertEqual(self.records, [])
        self.child.log(logging.INFO, "%s", "GET /sync 200 1.0ms @u:hs {x} %s")
        self.assertEqual(len(self.records), 1)
        direct, through_stdlib = self.events
        self.assertEqual(self._strip(direct), self._strip(through_stdlib))
        self.assertEqual(direct["msg"], "GET /sync 200 1.0ms @u:hs {x} %s")
        self.assertEqual(direct["log_namespace"], "logtexttest.access")

    def test_anything_else_on_the_way_takes_the_stdlib_path(self):
        """Another handler, a filter on the logger or the bridge, or a record factory: the record is made, as before."""
        import logging

        from synflow.logbridge import log_text

        self._count_records()
        other = logging.Handler()
        seen: list = []
        other.emit = seen.append  # type: ignore[method-assign]
        self.child.addHandler(other)
        log_text(self.child, logging.INFO, "one")
        self.assertEqual([r.getMessage() for r in seen], ["one"])
        self.assertEqual([e["msg"] for e in self.events], ["one"])  # the bridge still gets it, through the record
        self.child.removeHandler(other)

        self.child.addFilter(lambda record: False)
        log_text(self.child, logging.INFO, "dropped by the logger's filter")
        self.assertEqual([e["msg"] for e in self.events], ["one"])
        self.child.filters.clear()

        self.bridge.addFilter(lambda record: record.getMessage() != "dropped by the bridge's filter")
        log_text(self.child, logging.INFO, "dropped by the bridge's filter")
        self.assertEqual([e["msg"] for e in self.events], ["one"])
        self.bridge.filters.clear()

        factory = logging.getLogRecordFactory()
        made: list = []

        def counting(*args, **kwargs):
            made.append(args)
            return factory(*args, **kwargs)

        logging.setLogRecordFactory(counting)
        self.addCleanup(logging.setLogRecordFactory, factory)
        log_text(self.child, logging.INFO, "made by the factory")
        self.assertEqual(len(made), 1)
        self.assertEqual([e["msg"] for e in self.events], ["one", "made by the factory"])
        self.assertEqual(len(self.records), 4)

    def test_no_bridge_reached(self):
        """A logger that does not propagate to the bridge, or a bridge above the level, gets nothing."""
        import logging

        from synflow.logbridge import log_text

        self.bridge.setLevel(logging.WARNING)
        log_text(self.child, logging.INFO, "below the bridge's level")
        self.bridge.setLevel(logging.NOTSET)
        self.child.propagate = False
        log_text(self.child, logging.INFO, "not propagated")
        self.assertEqual(self.events, [])
        self.child.propagate = True
        log_text(self.child, logging.WARNING, "reached")
        self.assertEqual([(e["msg"], e["log_level"]) for e in self.events], [("reached", LogLevel.warn)])

    def test_access_line_unchanged(self):
        """The access log line through the bridge directly is byte for byte the line through a stdlib record."""
        import logging

        from twisted.logger import globalLogPublisher

        from synflow.http.server import JsonSite, access_logger
        from synflow.logbridge import TwistedBridge

        class Request:
            method, code, arrived, synflow_user = b"GET", 200, 0.0, "@u:hs"
            path, uri = b"/_synflow/client/v1/sync", b"/_synflow/client/v1/sync?since=s1&access_token=abc"

        root = logging.getLogger()
        bridge = TwistedBridge()
        self.patch(root, "handlers", [bridge])
        self.patch(access_logger, "level", logging.INFO)
        self.patch(access_logger, "propagate", True)
        self.patch(access_logger, "disabled", False)
        self.patch(logging.getLogger("synflow"), "handlers", [])
        self.patch(time, "monotonic", lambda: 0.0123)
        out = io.StringIO()
        observer = logs.text_observer(out)

        def access_lines(event: dict) -> None:
            if event.get("log_namespace") == "synflow.access":
                observer(event)

        globalLogPublisher.addObserver(access_lines)
        self.addCleanup(globalLogPublisher.removeObserver, access_lines)
        records: list = []
        original = access_logger.handle
        self.patch(access_logger, "handle", lambda record: (records.append(record), original(record)))
        site = JsonSite.__new__(JsonSite)
        site.log(Request())  # the bridge alone: no record
        self.assertEqual(records, [])
        self.patch(access_logger, "filters", [lambda record: True])  # a filter: through a record
        site.log(Request())
        self.assertEqual(len(records), 1)
        first, second = out.getvalue().splitlines()
        self.assertEqual(first.split(" ", 1)[1], second.split(" ", 1)[1])
        self.assertEqual(first.split(" ", 1)[1],
                         "[synflow.access#info] GET /_synflow/client/v1/sync?since=s1&access_token=<redacted> 200 "
                         "12.3ms @u:hs")


class _Reactor:
    """As much of a reactor as :class:`~synflow.app.logs.HeldLines` uses: running or not, and its turn's end."""

    def __init__(self, running: bool = True) -> None:
        self.running = running
        self.soon: list = []
        self.triggers: list = []

    def callLater(self, delay: float, f: Any) -> None:
        assert delay == 0
        self.soon.append(f)

    def addSystemEventTrigger(self, phase: str, event: str, f: Any) -> None:
        self.triggers.append((phase, event, f))

    def end_turn(self) -> None:
        soon, self.soon = self.soon, []
        for f in soon:
            f()


class _Out(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        return super().write(text)


class HeldLinesTest(SynchronousTestCase):
    """Lines logged on the reactor's thread while it runs are written together once its turn ends."""

    def setUp(self) -> None:
        from twisted.python import threadable

        self.patch(threadable, "ioThread", threading.get_ident())
        self.reactor = _Reactor()
        self.out = _Out()
        self.lines = logs.HeldLines(self.out, self.reactor)

    def test_held_until_the_turn_ends_then_one_write(self):
        for n in range(3):
            self.lines.write(f"line {n}\n", LogLevel.info)
        self.assertEqual(self.out.getvalue(), "")
        self.assertEqual(len(self.reactor.soon), 1)  # one flush for the turn, not one per line
        self.reactor.end_turn()
        self.assertEqual(self.out.getvalue(), "line 0\nline 1\nline 2\n")
        self.assertEqual(self.out.writes, 1)
        self.lines.write("next turn\n", LogLevel.debug)
        self.reactor.end_turn()
        self.assertEqual(self.out.getvalue().splitlines()[-1], "next turn")

    def test_warning_writes_at_once_after_what_was_held(self):
        self.lines.write("held\n", LogLevel.info)
        for level in (LogLevel.warn, LogLevel.error, LogLevel.critical):
            self.lines.write(f"{level.name}\n", level)
        self.assertEqual(self.out.getvalue(), "held\nwarn\nerror\ncritical\n")
        self.reactor.end_turn()  # nothing left to write
        self.assertEqual(self.out.getvalue(), "held\nwarn\nerror\ncritical\n")

    def test_other_thread_or_stopped_reactor_writes_at_once(self):
        self.lines.write("held\n", LogLevel.info)
        done = []
        worker = threading.Thread(target=lambda: done.append(self.lines.write("from a thread\n", LogLevel.info)))
        worker.start()
        worker.join()
        self.assertEqual(self.out.getvalue(), "held\nfrom a thread\n")
        self.reactor.running = False
        self.lines.write("stopped\n", LogLevel.info)
        self.assertEqual(self.out.getvalue(), "held\nfrom a thread\nstopped\n")

    def test_too_much_held_is_written_without_waiting(self):
        line = "x" * 1000 + "\n"
        for _ in range(logs.HeldLines.MAX_HELD_CHARS // len(line)):
            self.lines.write(line, LogLevel.info)
        self.assertEqual(self.out.getvalue(), "")
        self.lines.write(line, LogLevel.info)
        self.assertEqual(len(self.out.getvalue()), (logs.HeldLines.MAX_HELD_CHARS // len(line) + 1) * len(line))

    def test_shutdown_writes_what_is_held(self):
        lines = logs.HeldLines(self.out)  # the global reactor: the trigger is registered on it
        from twisted.internet import reactor

        triggers = []
        self.patch(reactor, "addSystemEventTrigger", lambda *args: triggers.append(args))
        self.patch(reactor, "running", True)
        self.patch(reactor, "callLater", lambda delay, f: None)
        lines.write("held at shutdown\n", LogLevel.info)
        self.assertEqual(self.out.getvalue(), "")
        [(phase, event, flush)] = triggers
        self.assertEqual((phase, event), ("after", "shutdown"))
        flush()
        self.assertEqual(self.out.getvalue(), "held at shutdown\n")


LEVELS = st.sampled_from(list(LogLevel.iterconstants()))
NAMESPACES = st.sampled_from(["", "synflow", "synflow.access", "synflow.accessx", "synflow.federation.sender",
                              "twisted", "log_legacy", "a.b.c.d"])


class LevelFilterTest(SynchronousTestCase):
    @settings(max_examples=200, deadline=None)
    @given(default=LEVELS, levels=st.dictionaries(NAMESPACES.filter(bool), LEVELS, max_size=4),
           events=st.lists(st.tuples(NAMESPACES | st.none(), LEVELS | st.none()), max_size=20))
    def test_passes_what_twisteds_filter_passes(self, default, levels, events):
        """The same events pass as through ``FilteringLogObserver`` with a ``LogLevelFilterPredicate``."""
        from twisted.logger import FilteringLogObserver, LogLevelFilterPredicate

        predicate = LogLevelFilterPredicate(defaultLogLevel=default)
        for name, level in levels.items():
            predicate.setLogLevelForNamespace(name, level)
        ours, theirs = [], []
        mine, reference = logs.LevelFilter(ours.append, predicate), FilteringLogObserver(theirs.append, [predicate])
        for n, (namespace, level) in enumerate(events * 2):  # twice: the second time from the kept levels
            event = {"n": n}
            if namespace is not None:
                event["log_namespace"] = namespace
            if level is not None:
                event["log_level"] = level
            mine(dict(event))
            reference(dict(event))
        self.assertEqual(ours, theirs)

    def test_kept_levels_are_bounded(self):
        from twisted.logger import LogLevelFilterPredicate

        self.patch(logs.LevelFilter, "MAX_NAMESPACES", 8)
        passed = []
        observer = logs.LevelFilter(passed.append, LogLevelFilterPredicate(defaultLogLevel=LogLevel.info))
        for n in range(50):
            observer({"log_namespace": f"ns{n}", "log_level": LogLevel.info})
            self.assertLessEqual(len(observer._levels), 8)
        self.assertEqual(len(passed), 50)


class HeldLinesAtExitTest(SynchronousTestCase):
    def test_exit_with_the_file_closed_is_quiet(self):
        """Lines still held when the interpreter exits are written; a file already closed by then is left be."""
        from twisted.python import threadable

        self.patch(threadable, "ioThread", threading.get_ident())
        out = _Out()
        lines = logs.HeldLines(out, _Reactor())
        lines.write("held\n", LogLevel.info)
        lines._flush_at_exit()
        self.assertEqual(out.getvalue(), "held\n")
        lines.write("held again\n", LogLevel.info)
        out.close()
        lines._flush_at_exit()  # no exception
