"""Caches-stream rows from two writers through a real ReplicationHandler with the registry attached.

Rows arrive interleaved and out of stream-ID order across writers, in
batches, and by catch-up; every key they name must be gone from the caches
before the reader's position passes the row.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from synflow import registry
from synflow.caching import CURRENT_STATE_CACHE_NAME, CacheRegistry
from synflow.config import CacheConfig
from synflow.replication.commands import PositionCommand, RdataCommand
from synflow.replication.handler import ReplicationHandler
from synflow.streams import CachesRow
from tests.caching.stores import RoomStore, sample
from tests.caching.test_registry import (
    CACHE_ATTRS,
    assert_invalidated,
    contents,
    rows_strategy,
    warm,
)

TS = 1_700_000_000_000
WRITERS = ("w1", "w2")


class Conn:
    def send_command(self, cmd: Any) -> None:
        pass


class ListSource:
    """Catch-up rows of the caches stream: ``(instance, stream_id, row)``."""

    def __init__(self, rows: list[tuple[str, int, CachesRow]]) -> None:
        self.rows = rows

    def get_updates(self, instance: str, from_token: int, to_token: int, limit: int = 100) -> Deferred[Any]:
        hits = sorted((t, r) for i, t, r in self.rows if i == instance and from_token < t <= to_token)
        return succeed((hits, to_token, False))


class Reader:
    """A reader process: a handler whose caches row handler is the registry, as in ``setup_caches``."""

    def __init__(self, source: ListSource | None = None) -> None:
        self.handler = ReplicationHandler(
            "reader", Clock(), streams=registry.streams(), sources={"caches": source or ListSource([])},
            initial_positions={"caches": {w: 1 for w in WRITERS}},
        )
        self.registry = CacheRegistry(CacheConfig())
        self.store = RoomStore()
        self.registry.register(self.store)
        warm(self.store)
        self.handler.add_row_handler("caches", self.registry.row_handler)
        self.rows_by_id: dict[tuple[str, int], list[CachesRow]] = {}
        self.checked: list[tuple[str, int]] = []
        self.problems: list[tuple[Any, ...]] = []
        self.handler.add_position_listener("caches", self._check_applied_before_advance)
        self.conn = Conn()
        self.handler.new_connection(self.conn)
        for w in WRITERS:
            self.handler.on_command(self.conn, PositionCommand("caches", w, 1, 1))

    def _check_applied_before_advance(self, instance: str, token: int) -> None:
        # The handler logs (and swallows) a listener's exceptions: record instead.
        rows = self.rows_by_id.get((instance, token))
        if rows:
            for name, key in [pair for r in rows for pair in self.registry.expand(r)]:
                if name in CACHE_ATTRS:
                    cache = getattr(self.store, name).cache
                    if (len(cache) != 0) if key is None else (key in cache):
                        self.problems.append((instance, token, name, key))
            self.checked.append((instance, token))

    def send(self, writer: str, stream_id: int, rows: list[CachesRow]) -> None:
        """The writer's RDATA for one stream ID (several rows: a batch)."""
        self.rows_by_id[(writer, stream_id)] = rows
        for r in rows[:-1]:
            self.handler.on_command(self.conn, RdataCommand("caches", writer, None, r.to_wire()))
        self.handler.on_command(self.conn, RdataCommand("caches", writer, stream_id, rows[-1].to_wire()))


def row(name: str, keys: tuple[Any, ...] | None) -> CachesRow:
    return CachesRow(name, keys, TS)


class HandlerInvalidationTest(SynchronousTestCase):
    def test_two_writers_out_of_order(self) -> None:
        """Interleaved, out-of-ID-order rows of two writers (batches included) all invalidate, before each position advance."""
        reader = Reader()
        before = sample("synflow_cache_invalidations_total", cache="get_display_name")
        reader.send("w2", 9, [row("get_display_name", ("@a",))])
        reader.send("w1", 3, [row("get_users_in_room", ("!r1",)), row("get_rooms_for_user", ("@c",))])
        reader.send("w2", 10, [row(CURRENT_STATE_CACHE_NAME, ("!r2", "@b"))])
        reader.send("w1", 4, [row("get_display_name", ("@c",))])
        self.assertEqual(sorted(reader.store.get_display_name.cache), [("@b",), ("@d",)])
        self.assertEqual(sorted(reader.store.get_users_in_room.cache), [("!r3",)])
        self.assertEqual(sorted(reader.store.get_room_summary.cache), [("!r1",), ("!r3",)])
        self.assertEqual(sorted(reader.store.get_rooms_for_user.cache), [("@a",), ("@d",)])
        self.assertEqual(reader.handler.positions("caches"), {"w1": 4, "w2": 10})
        self.assertEqual(sorted(reader.checked), [("w1", 3), ("w1", 4), ("w2", 9), ("w2", 10)])
        self.assertEqual(reader.problems, [])
        self.assertEqual(sample("synflow_cache_invalidations_total", cache="get_display_name") - before, 2)

    def test_null_clears_and_batched_name_clears_every_cache_it_names(self) -> None:
        """A null key clears its cache; cs_cache_fake clears the room in every room-keyed cache and each member in every user-keyed one."""
        reader = Reader()
        reader.send("w1", 2, [row("get_display_name", None)])
        self.assertEqual(len(reader.store.get_display_name.cache), 0)
        self.assertEqual(len(reader.store.get_rooms_for_user.cache), 4)
        reader.send("w2", 7, [row(CURRENT_STATE_CACHE_NAME, ("!r1", "@a", "@d"))])
        for cache in (reader.store.get_users_in_room, reader.store.get_room_summary):
            self.assertEqual(sorted(cache.cache), [("!r2",), ("!r3",)])
        self.assertEqual(sorted(reader.store.get_rooms_for_user.cache), [("@b",), ("@c",)])

    def test_rows_fetched_by_catch_up_invalidate(self) -> None:
        """Rows a reader missed and fetches on a POSITION gap invalidate before it advances."""
        missed = [("w1", 5, row("get_display_name", ("@b",))), ("w1", 6, row(CURRENT_STATE_CACHE_NAME, ("!r3",)))]
        reader = Reader(ListSource(missed))
        for writer, sid, r in missed:
            reader.rows_by_id[(writer, sid)] = [r]
        reader.handler.on_command(reader.conn, PositionCommand("caches", "w1", 4, 6))
        self.assertEqual(reader.handler.position("caches", "w1"), 6)
        self.assertNotIn(("@b",), reader.store.get_display_name.cache)
        self.assertNotIn(("!r3",), reader.store.get_users_in_room.cache)
        self.assertEqual(sorted(reader.checked), [("w1", 5), ("w1", 6)])
        self.assertEqual(reader.problems, [])

    @settings(max_examples=60)
    @given(
        writer_a=st.lists(st.lists(rows_strategy, min_size=1, max_size=3), max_size=5),
        writer_b=st.lists(st.lists(rows_strategy, min_size=1, max_size=3), max_size=5),
        data=st.data(),
    )
    def test_any_interleaving_through_the_handler(self, writer_a: list[list[CachesRow]],
                                                  writer_b: list[list[CachesRow]], data: Any) -> None:
        """Any interleaving of two writers' RDATA (IDs from one shared sequence) leaves the caches as ID order does."""
        # Hand out IDs from one sequence in a random allocation order, then
        # deliver in another: each writer's own IDs stay increasing (as on a
        # connection), across writers they arrive out of order.
        allocation = data.draw(st.permutations(["w1"] * len(writer_a) + ["w2"] * len(writer_b)))
        queues = {"w1": list(writer_a), "w2": list(writer_b)}
        facts: dict[str, list[tuple[int, list[CachesRow]]]] = {"w1": [], "w2": []}
        in_id_order: list[list[CachesRow]] = []
        for stream_id, writer in enumerate(allocation, start=2):
            rows = queues[writer].pop(0)
            facts[writer].append((stream_id, rows))
            in_id_order.append(rows)
        delivery = data.draw(st.permutations(allocation))
        reader = Reader()
        for writer in delivery:
            stream_id, rows = facts[writer].pop(0)
            reader.send(writer, stream_id, rows)
        assert_invalidated(self, reader.registry, reader.store, [r for rows in in_id_order for r in rows])
        self.assertEqual(len(reader.checked), len(allocation))
        self.assertEqual(reader.problems, [])
        reference = RoomStore()
        registry = CacheRegistry(CacheConfig())
        registry.register(reference)
        warm(reference)
        for rows in in_id_order:
            registry.apply(rows)
        self.assertEqual(contents(reader.store), contents(reference))
