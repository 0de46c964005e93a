"""Persistent small integer IDs for instance names (used in stream tokens).

``instance_map(instance_id, instance_name)`` is append-only: an instance's
ID never changes, so tokens stay valid across restarts and config changes.
:class:`InstanceMap` caches the mapping and creates missing IDs with a
select-then-insert that never burns IDs on the common path.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

from twisted.internet.defer import Deferred, succeed

from synflow.audit import AuditLog
from synflow.storage.engines import Database, Txn


def get_or_create_instance_id_txn(txn: Txn, name: str) -> int:
    txn.execute("SELECT instance_id FROM instance_map WHERE instance_name = ?", (name,))
    row = txn.fetchone()
    if row is not None:
        return int(row[0])
    txn.execute(
        "INSERT INTO instance_map (instance_name) VALUES (?) ON CONFLICT (instance_name) DO NOTHING", (name,)
    )
    txn.execute("SELECT instance_id FROM instance_map WHERE instance_name = ?", (name,))
    row = txn.fetchone()
    assert row is not None
    return int(row[0])


def all_instances_txn(txn: Txn) -> dict[int, str]:
    txn.execute("SELECT instance_id, instance_name FROM instance_map")
    return {int(i): n for i, n in txn.fetchall()}


class InstanceMap:
    """Name <-> ID lookups, cached; misses go to the database."""

    def __init__(self, db: Database, audit: AuditLog | None = None) -> None:
        self.db = db
        self.audit = audit
        self.by_name: dict[str, int] = {}
        self.by_id: dict[int, str] = {}

    def load(self) -> Deferred[None]:
        """Read every known mapping."""
        return self.db.run_interaction("load_instance_map", all_instances_txn, idempotent=True).addCallback(
            self._remember
        )

    def _remember(self, mapping: dict[int, str]) -> None:
        for i, n in mapping.items():
            self.by_id[i] = n
            self.by_name[n] = i
        if self.audit is not None:
            self.audit.instances(self.by_id)

    def get_id(self, name: str) -> Deferred[int]:
        """The ID of ``name``, creating it if needed."""
        if name in self.by_name:
            return succeed(self.by_name[name])
        d = self.db.run_interaction("get_instance_id", get_or_create_instance_id_txn, name, idempotent=True)

        def got(instance_id: int) -> int:
            self._remember({instance_id: name})
            return instance_id

        return d.addCallback(got)

    def ids_for(self, names: list[str]) -> Deferred[dict[str, int]]:
        """IDs for several names (creating missing ones)."""
        from twisted.internet.defer import gatherResults

        missing = [n for n in names if n not in self.by_name]
        if not missing:
            return succeed({n: self.by_name[n] for n in names})
        d = gatherResults([self.get_id(n) for n in missing])
        return d.addCallback(lambda _: {n: self.by_name[n] for n in names})
