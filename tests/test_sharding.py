"""shard_for: SHA-256 of the key, little-endian, modulo the instance count."""

from __future__ import annotations

import hashlib
import subprocess
import sys

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from synflow.errors import ShardingError
from synflow.sharding import shard_for


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
