"""shard_for: SHA-256 of the key, little-endian, modulo the instance count."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from synflow.errors import ShardingError
from synflow.sharding import ShardMap, ShardStep, rendezvous, shard_for


def reference(key: str, instances: list[str]) -> str:
    """The definition, written out independently of synflow."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    value = sum(b << (8 * i) for i, b in enumerate(digest))
    return instances[value % len(instances)]


CASES = [
    (f"!room{i}:example.com", [f"persister{j}" for j in range(1, n + 1)])
    for i, n in zip(range(24), [1, 2, 3, 4, 5, 7] * 4, strict=False)
] + [
    ("!foo:test", ["worker1", "worker2"]),
    ("!baz:test", ["worker1", "worker2"]),
    ("other.example.org", ["sender1", "sender2", "sender3"]),
    ("ünïcødé:ß", ["a", "b", "c", "d"]),
]


class ShardForTest(SynchronousTestCase):
    def test_table(self):
        """shard_for matches the definition on a fixed table of keys and instance lists."""
        self.assertGreaterEqual(len(CASES), 20)
        for key, instances in CASES:
            self.assertEqual(shard_for(key, instances), reference(key, instances), key)

    def test_known_values(self):
        """Literal answers worked out once from SHA-256 by hand, so a change to the mapping cannot pass unnoticed."""
        # (key, instances, expected): the first digest byte is 0x68 for "!foo:test",
        # 0xb3 for "!baz:test" and 0xc0 for "ünïcødé:ß", so modulo 2 and 4 the
        # little-endian value gives these (big-endian would give worker2, b, persister5).
        known = [
            ("!foo:test", ["worker1", "worker2"], "worker1"),
            ("!baz:test", ["worker1", "worker2"], "worker2"),
            ("ünïcødé:ß", ["a", "b", "c", "d"], "a"),
            ("other.example.org", ["sender1", "sender2", "sender3"], "sender2"),
            ("!room5:example.com", [f"persister{j}" for j in range(1, 8)], "persister7"),
            ("!abc:hs", ["p1", "p2", "p3", "p4", "p5"], "p2"),
            ("", ["x", "y", "z"], "y"),
        ]
        for key, instances, expected in known:
            self.assertEqual(shard_for(key, instances), expected, key)
        self.assertEqual(len({shard_for(f"!r{i}:hs", ["a", "b"]) for i in range(50)}), 2)

    @given(st.text(max_size=50), st.lists(st.text(min_size=1, max_size=5), min_size=1, max_size=8, unique=True))
    def test_any_key(self, key, instances):
        """For any key and instance list the result is the definition's."""
        self.assertEqual(shard_for(key, instances), reference(key, instances))

    def test_stable_across_processes(self):
        """Another interpreter (another process, or a restart) computes the same mapping."""
        keys = [k for k, _ in CASES]
        code = (
            "import json,sys; from synflow.sharding import shard_for; "
            "cases=json.load(sys.stdin); print(json.dumps([shard_for(k, i) for k, i in cases]))"
        )
        import json

        out = subprocess.run([sys.executable, "-c", code], input=json.dumps(CASES), capture_output=True,
                             text=True, check=True)
        self.assertEqual(json.loads(out.stdout), [shard_for(k, i) for k, i in CASES])
        self.assertTrue(keys)

    def test_no_instances(self):
        """Sharding over no instances is a clear error."""
        with self.assertRaises(ShardingError):
            shard_for("!r:hs", [])


class ShardMapTest(SynchronousTestCase):
    """ShardMap: the configured base by shard_for, then epochs that move only the keys they must."""

    ROOMS = [f"!room{i}:example.com" for i in range(30_000)]

    @given(st.lists(st.text(min_size=1, max_size=30), min_size=1, max_size=50),
           st.integers(min_value=1, max_value=6))
    def test_no_steps_is_shard_for(self, keys, n):
        """A map that never resharded owns every key where shard_for puts it."""
        writers = [f"w{i}" for i in range(n)]
        m = ShardMap(writers)
        for key in keys:
            self.assertEqual(m.owner(key), shard_for(key, writers))

    @given(st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=40),
           st.lists(st.tuples(st.booleans(), st.integers(min_value=0, max_value=5)), max_size=6))
    def test_steps_move_only_what_they_must(self, keys, ops):
        """Adding w moves keys only to w; removing w moves only w's keys; every key has a writer of the map."""
        m = ShardMap(["w0", "w1"])
        for add, i in ops:
            name = f"w{i}"
            if add == (name in m.writers) or (not add and len(m.writers) == 1):
                continue
            nxt = m.then(ShardStep("add" if add else "remove", name))
            for key in keys:
                before, after = m.owner(key), nxt.owner(key)
                self.assertIn(after, nxt.writers)
                if before != after:
                    self.assertEqual(after if add else before, name)
            m = nxt

    def test_moved_fraction_and_balance(self):
        """2 -> 3 -> 2 -> 3 -> 4 writers: each change moves within 10% of the ideal share, and leaves the load even."""
        m = ShardMap(["p1", "p2"])
        for op, name in (("add", "p3"), ("remove", "p2"), ("add", "p2"), ("add", "p4")):
            nxt = m.then(ShardStep(op, name))
            moved = sum(1 for r in self.ROOMS if m.owner(r) != nxt.owner(r)) / len(self.ROOMS)
            ideal = 1 / len(nxt.writers) if op == "add" else 1 / len(m.writers)
            self.assertLess(abs(moved - ideal), 0.1 * ideal, f"{op} {name}: moved {moved:.3f}, ideal {ideal:.3f}")
            counts = Counter(nxt.owner(r) for r in self.ROOMS)
            for writer in nxt.writers:
                share = counts[writer] / len(self.ROOMS)
                self.assertLess(abs(share - 1 / len(nxt.writers)), 0.1 / len(nxt.writers), f"{writer}: {share:.3f}")
            m = nxt
        self.assertEqual(m.epoch, 4)

    def test_impossible_steps_refused(self):
        """Adding a writer twice, removing an unknown one or the last one is a ShardingError."""
        m = ShardMap(["p1"])
        for step in (ShardStep("add", "p1"), ShardStep("remove", "p9"), ShardStep("remove", "p1")):
            with self.assertRaises(ShardingError):
                m.then(step)
        with self.assertRaises(ShardingError):
            ShardMap([])

    def test_rendezvous_is_stable_and_salted(self):
        """The rendezvous winner depends only on key, list and salt; salts give independent winners."""
        writers = ["a", "b", "c"]
        self.assertEqual([rendezvous(r, writers) for r in self.ROOMS[:100]],
                         [rendezvous(r, list(reversed(writers))) for r in self.ROOMS[:100]])
        differ = sum(1 for r in self.ROOMS[:3000] if rendezvous(r, writers, 1) != rendezvous(r, writers, 2))
        self.assertGreater(differ, 1500)  # about 2/3 for independent winners
