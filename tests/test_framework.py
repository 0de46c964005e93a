"""ProcessContext.follow: every row of a stream once, in order per writer, catch-up first, across restarts."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.trial.unittest import SynchronousTestCase

from synflow.framework import StreamFollower


class _Source:
    """A stream table: rows by writer; a page is answered at once, or held until ``release``."""

    def __init__(self, rows: dict[str, list[tuple[int, str]]], hold: bool = False) -> None:
        self.rows = rows
        self.hold = hold
        self.held: list[Deferred[Any]] = []
        self.asked: list[tuple[str, int, int]] = []

    def get_updates(self, writer: str, after: int, upto: int, limit: int = 2) -> Deferred[Any]:
        self.asked.append((writer, after, upto))
        page = [(t, r) for t, r in self.rows.get(writer, []) if after < t <= upto][:limit]
        limited = len(page) == limit
        result = (page, page[-1][0] if limited else upto, limited)
        if not self.hold:
            return succeed(result)
        d: Deferred[Any] = Deferred()
        self.held.append(d)
        d.addCallback(lambda _: result)
        return d

    def release(self) -> None:
        while self.held:
            self.held.pop(0).callback(None)


class _Handler:
    def __init__(self, source: _Source, positions: dict[str, int]) -> None:
        self.sources = {"notes": source}
        self._positions = positions
        self.views = {"notes": None}
        self.row_handlers: list[Any] = []

    def positions(self, stream: str) -> dict[str, int]:
        return dict(self._positions)

    def add_row_handler(self, stream: str, fn: Any) -> None:
        self.row_handlers.append(fn)


class _Context:
    def __init__(self, handler: _Handler) -> None:
        self.handler = handler

    def on_rows(self, stream: str, callback: Any) -> None:
        self.handler.add_row_handler(stream, callback)


class FollowerTest(SynchronousTestCase):
    def setUp(self) -> None:
        self.applied: list[tuple[str, int, list[Any]]] = []

    def follower(self, source: _Source, positions: dict[str, int], since: dict[str, int]) -> StreamFollower:
        handler = _Handler(source, positions)
        follower = StreamFollower(_Context(handler), "notes",  # type: ignore[arg-type]
                                  lambda w, t, rows: self.applied.append((w, t, rows)), since)
        self.live = handler.row_handlers[0]
        return follower

    def test_catch_up_from_stored_positions_then_live(self):
        """Rows after the stored position are read from the table, page by page; live rows follow, none twice."""
        source = _Source({"w1": [(t, f"a{t}") for t in range(1, 8)], "w2": [(3, "b3")]})
        follower = self.follower(source, {"w1": 7, "w2": 3}, {"w1": 2})
        Deferred.fromCoroutine(follower.start())
        self.assertTrue(follower.caught_up.called)
        self.assertEqual(self.applied, [("w1", t, [f"a{t}"]) for t in range(3, 8)] + [("w2", 3, ["b3"])])
        self.assertEqual(source.asked[0], ("w1", 2, 7))  # from the stored position, not from 0
        self.live("w1", 7, ["a7"])  # already applied by the catch-up: skipped
        self.live("w1", 8, ["a8"])
        self.assertEqual(self.applied[-1], ("w1", 8, ["a8"]))
        self.assertEqual(follower.positions, {"w1": 8, "w2": 3})

    def test_live_rows_during_catch_up_wait_for_it(self):
        """Rows arriving while the catch-up reads the table are applied after it, in order; duplicates are skipped."""
        source = _Source({"w1": [(1, "a1"), (2, "a2"), (3, "a3")]}, hold=True)
        follower = self.follower(source, {"w1": 3}, {})
        Deferred.fromCoroutine(follower.start())
        self.live("w1", 3, ["a3"])  # the catch-up reaches this too
        self.live("w1", 4, ["a4"])
        self.assertEqual(self.applied, [])
        while source.held:
            source.release()
        self.assertEqual([t for _, t, _ in self.applied], [1, 2, 3, 4])
        self.assertTrue(follower.caught_up.called)

    def test_an_asynchronous_apply_is_waited_for(self):
        """The next batch is applied only once the previous apply's Deferred fires."""
        pending: list[Deferred[None]] = []
        source = _Source({})
        handler = _Handler(source, {})

        def apply(writer: str, token: int, rows: list[Any]) -> Deferred[None]:
            self.applied.append((writer, token, rows))
            d: Deferred[None] = Deferred()
            pending.append(d)
            return d

        follower = StreamFollower(_Context(handler), "notes", apply, {})  # type: ignore[arg-type]
        Deferred.fromCoroutine(follower.start())
        live = handler.row_handlers[0]
        live("w1", 1, ["x"])
        live("w1", 2, ["y"])
        self.assertEqual([t for _, t, _ in self.applied], [1])
        pending.pop(0).callback(None)
        self.assertEqual([t for _, t, _ in self.applied], [1, 2])
        self.assertEqual(follower.positions, {"w1": 1})  # 2 is applied only when its Deferred fires
        pending.pop(0).callback(None)
        self.assertEqual(follower.positions, {"w1": 2})
