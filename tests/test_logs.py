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

    def test_time_formatted_once_per_second(self):
        """Within one second the formatted time is reused; the next second formats again."""
        calls = []
        self.patch(logs, "formatTime", lambda when: calls.append(when) or str(when))
        cache = logs._SecondCache()
        self.assertEqual([cache(10.1), cache(10.7), cache(11.2)], ["10", "10", "11"])
        self.assertEqual(calls, [10, 11])
