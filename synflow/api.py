"""synflow's public API: everything a worker type or stream author imports.

``from synflow import api`` is the only synflow import a plugin needs (see
docs/framework.md for a tutorial and the reference). Every name in
:data:`__all__` is supported across releases; every other module of the
``synflow`` package is internal and may change.

Declaring a stream: :class:`Stream` (its row class has ``to_wire`` and a
``from_wire`` classmethod; :func:`strings` checks a wire row's shape),
:class:`Writers`, :func:`shard_for`.

Declaring a worker type: :class:`WorkerType`, :class:`Section` (with the
validators :func:`positive` and :func:`non_negative`), :class:`Capability`.

What ``build`` gets: :class:`ProcessContext`, holding the config
(:class:`SynflowConfig`), the database (:class:`Database`, transactions
:class:`Txn`), stream writes (:class:`StreamWriters`,
:class:`StreamWriteContext`), replication (:class:`ReplicationHandler`),
internal RPC (:class:`RpcServer`, :class:`RpcClient`), the audit log
(:class:`AuditLog`), instance IDs (:class:`InstanceMap`), tokens
(:class:`StreamToken`) and the metrics registry. HTTP resources are usually
a :class:`JsonResource`; errors a client should see are :class:`HttpApiError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from synflow.audit import AuditLog
from synflow.config import SynflowConfig
from synflow.errors import ConfigError, HttpApiError, PluginError
from synflow.framework import Capability, ProcessContext, Section, StreamFollower, WorkerType
from synflow.http.rpc import RpcClient, RpcServer
from synflow.http.server import JsonResource
from synflow.replication.handler import ReplicationHandler
from synflow.sharding import shard_for
from synflow.storage.engines import Database, Txn
from synflow.storage.id_generators import StreamWriteContext, StreamWriters
from synflow.storage.instances import InstanceMap
from synflow.streams import StreamDef as Stream
from synflow.streams import StreamRowError, Writers
from synflow.tokens import StreamToken

__all__ = [
    "AuditLog",
    "Capability",
    "ConfigError",
    "Database",
    "HttpApiError",
    "InstanceMap",
    "JsonResource",
    "PluginError",
    "ProcessContext",
    "ReplicationHandler",
    "RpcClient",
    "RpcServer",
    "Section",
    "Stream",
    "StreamRowError",
    "StreamFollower",
    "StreamToken",
    "StreamWriteContext",
    "StreamWriters",
    "SynflowConfig",
    "Txn",
    "WorkerType",
    "Writers",
    "non_negative",
    "positive",
    "schema_dir",
    "shard_for",
    "strings",
]


def strings(row: Any, n: int) -> list[str]:
    """``row`` as a list of ``n`` strings, or :class:`StreamRowError` (the reader answers the writer with ERROR).

    For a stream row's ``from_wire``: ``cls(*api.strings(row, 3))``.
    """
    if not isinstance(row, list) or len(row) != n:
        raise StreamRowError(f"row must be a JSON array of {n} items, got {str(row)[:100]}")
    for i, value in enumerate(row):
        if not isinstance(value, str):
            raise StreamRowError(f"item {i} of the row must be a string, got {value!r}")
    return row


def positive(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """An attrs validator: the value is a number greater than 0 (a config error names the key otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{attribute.name} must be greater than 0, got {value!r}")


def non_negative(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """An attrs validator: the value is a number of at least 0."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"{attribute.name} must be at least 0, got {value!r}")


def schema_dir(module: str, name: str = "schema") -> str:
    """The directory ``name`` beside the module ``module`` (``api.schema_dir(__name__)``): a stream's migrations."""
    import importlib

    mod = importlib.import_module(module)
    origin: Sequence[str] | None = getattr(mod, "__path__", None)
    base = Path(origin[0]) if origin else Path(str(mod.__file__)).parent
    return str(base / name)
