"""Versioned schema migrations: the master applies them, workers wait for them.

A schema directory holds one SQL file per version::

    0001_initial.sql            both engines
    0002_positions.sql          both engines ...
    0002_positions.postgres.sql ... except PostgreSQL, which uses this variant

A dialect variant (``.sqlite.sql`` / ``.postgres.sql``) replaces the plain
file of the same version for its engine. Every version must resolve to a file
for both engines (write an empty or comment-only file for a no-op).

Statements end at a ``;`` that is the last thing on its line (a trailing
``-- comment`` is allowed), outside string literals, quoted identifiers,
comments and PostgreSQL dollar quotes. A ``;`` followed by more code on the
same line does not split, which keeps SQLite trigger bodies whole when the
inner statements are written ``...; END;`` on one line.

The ``schema_version(version, applied_at)`` table records each applied
version. :func:`prepare_database` applies each pending file in its own
transaction, holding a lock that serialises migrating processes
(``pg_advisory_xact_lock`` on PostgreSQL, the write lock that
``BEGIN IMMEDIATE`` takes on SQLite), and rechecks the version under it, so
two masters racing apply every file once. :func:`wait_for_schema` is what
workers run instead: it polls until the master has done its part.

A plugin's migrations (a stream's or a worker type's ``schema`` directory,
same file rules) live in their own **namespace**: their versions are
recorded in ``plugin_schema_version(namespace, version, applied_at)``, so
they never collide with synflow's or another plugin's. Every process applies
the namespaces of the plugins it knows once synflow's own schema is there
(:func:`prepare_plugin_schemas`), under the same lock: whichever process gets
there first applies a file, the others find it applied.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple, cast

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import deferLater
from twisted.logger import Logger

from synflow.errors import SchemaVersionError, StorageError
from synflow.storage.engines import ENGINE_ALIASES, Database, Txn, scan_sql

log = Logger()

#: Where synflow's own migrations live.
SCHEMA_DIR = Path(__file__).parent / "schema"

_FILE_RE = re.compile(r"^(?P<version>\d{4,})_(?P<name>[A-Za-z0-9_]+)(?:\.(?P<engine>sqlite|postgres))?\.sql$")
_ENGINES = ("sqlite", "postgres")

CREATE_VERSION_TABLE = (
    "CREATE TABLE IF NOT EXISTS schema_version ("
    " version INTEGER NOT NULL PRIMARY KEY, applied_at BIGINT NOT NULL)"
)
CREATE_PLUGIN_VERSION_TABLE = (
    "CREATE TABLE IF NOT EXISTS plugin_schema_version ("
    " namespace TEXT NOT NULL, version INTEGER NOT NULL, applied_at BIGINT NOT NULL,"
    " PRIMARY KEY (namespace, version))"
)


class SchemaFile(NamedTuple):
    """One migration as one engine sees it."""

    version: int
    name: str
    path: Path


def split_sql(text: str, engine: str) -> list[str]:
    """Split a migration file into statements (see the module docstring for the rule).

    Args:
        text: the file's contents.
        engine: ``"sqlite"`` or ``"postgres"`` (the quoting rules to honour).

    Returns:
        The statements without their final ``;``, stripped; pieces holding
        only whitespace and comments are dropped.
    """
    statements: list[str] = []
    current: list[str] = []
    has_code = False
    pieces = scan_sql(text, engine)
    offset = 0
    for is_code, piece in pieces:
        start = 0
        if is_code:
            for i, ch in enumerate(piece):
                if ch == ";" and _ends_line(text, offset + i + 1):
                    current.append(piece[start:i])
                    has_code = has_code or bool(piece[start:i].strip())
                    if has_code:
                        statements.append("".join(current).strip())
                    current, has_code, start = [], False, i + 1
            has_code = has_code or bool(piece[start:].strip())
        elif not piece.startswith(("--", "/*")):
            has_code = True  # a string literal or quoted identifier
        current.append(piece[start:])
        offset += len(piece)
    if has_code:
        statements.append("".join(current).strip())
    return statements


def _ends_line(text: str, pos: int) -> bool:
    """Whether only whitespace or a ``--`` comment follows ``pos`` on its line."""
    end = text.find("\n", pos)
    rest = text[pos:] if end < 0 else text[pos:end]
    rest = rest.strip()
    return not rest or rest.startswith("--")


def schema_files(schema_dir: str | os.PathLike[str] | None, engine: str) -> list[SchemaFile]:
    """The migrations in ``schema_dir``, in version order, as ``engine`` runs them.

    Args:
        schema_dir: the directory; None for synflow's own (:data:`SCHEMA_DIR`).
        engine: ``"sqlite"`` or ``"postgres"``.

    Returns:
        One ``(version, name, path)`` per version, ``path`` being the dialect
        variant for ``engine`` when there is one, else the plain file.

    Raises:
        StorageError: if a ``.sql`` file is misnamed, two files claim one
            version with different names, a version is 0, or a version has
            no file for one of the engines.
    """
    engine = ENGINE_ALIASES.get(engine, engine)
    if engine not in _ENGINES:
        raise StorageError(f"unknown database engine {engine!r}; use 'sqlite' or 'postgres'")
    directory = Path(SCHEMA_DIR if schema_dir is None else schema_dir)
    found: dict[int, dict[str | None, Path]] = {}
    names: dict[int, str] = {}
    for path in sorted(directory.glob("*.sql")) if directory.is_dir() else []:
        m = _FILE_RE.match(path.name)
        if m is None:
            raise StorageError(
                f"schema file {path} is not named NNNN_name.sql, NNNN_name.sqlite.sql "
                "or NNNN_name.postgres.sql"
            )
        version = int(m["version"])
        if version == 0:
            raise StorageError(f"schema file {path}: versions start at 1")
        if names.setdefault(version, m["name"]) != m["name"]:
            raise StorageError(
                f"schema version {version} has two names: {names[version]!r} and {m['name']!r}"
            )
        found.setdefault(version, {})[m["engine"]] = path
    result = []
    for version in sorted(found):
        variants = found[version]
        for e in _ENGINES:
            if e not in variants and None not in variants:
                raise StorageError(
                    f"schema version {version} ({names[version]}) has no file for {e}: add "
                    f"{version:04d}_{names[version]}.sql or .{e}.sql (empty if nothing to do)"
                )
        result.append(SchemaFile(version, names[version], variants.get(engine) or variants[None]))
    return result


def latest_version(schema_dir: str | os.PathLike[str] | None = None) -> int:
    """The highest version in ``schema_dir`` (the code's schema version), or 0."""
    files = schema_files(schema_dir, "sqlite")
    return files[-1].version if files else 0


def current_version(db: Database, namespace: str | None = None) -> Deferred[int | None]:
    """The database's schema version (of a plugin ``namespace``): None before any was applied, else ≥ 0."""
    return db.run_interaction("schema_current_version", _current_version_txn, namespace, idempotent=True)


def _current_version_txn(txn: Txn, namespace: str | None = None) -> int | None:
    if namespace is None:
        if not txn.engine.table_exists_txn(txn, "schema_version"):
            return None
        txn.execute("SELECT MAX(version) FROM schema_version")
    else:
        if not txn.engine.table_exists_txn(txn, "plugin_schema_version"):
            return None
        txn.execute("SELECT MAX(version) FROM plugin_schema_version WHERE namespace = ?", (namespace,))
    row = txn.fetchone()
    if namespace is not None and (not row or row[0] is None):
        return None
    return int(row[0]) if row and row[0] is not None else 0


def _now(clock: IReactorTime) -> float:
    # zope interface methods are declared without ``self``, which mypy (without
    # the mypy-zope plugin) refuses to call on an interface-typed value.
    return cast(Any, clock).seconds()


def _newer_error(found: int, code: int) -> SchemaVersionError:
    return SchemaVersionError(
        f"database version {found} is newer than this code's {code}; "
        "upgrade synflow or restore a backup"
    )


def prepare_database(db: Database, *, apply: bool, schema_dir: str | os.PathLike[str] | None = None,
                     target: int | None = None, namespace: str | None = None) -> Deferred[int]:
    """Bring the schema up to date (``apply=True``, the master) or check it is.

    Args:
        db: the database.
        apply: apply pending migrations; when False only check that none is pending.
        schema_dir: the migrations; None for synflow's own.
        target: stop after this version instead of the latest (for tests and tools).
        namespace: a plugin's namespace (``schema_dir`` is then the plugin's);
            None for synflow's own schema.

    Returns:
        A Deferred firing with the schema version afterwards.

    Raises:
        SchemaVersionError: if the database is newer than the code, or
            (``apply=False``) older than it.
        StorageError: if a migration fails; the message names the file and
            statement. Versions before it stay applied.
    """
    return Deferred.fromCoroutine(_prepare(db, apply, schema_dir, target, namespace))


def prepare_plugin_schemas(db: Database, schemas: Mapping[str, str | os.PathLike[str]]) -> Deferred[dict[str, int]]:
    """Apply each plugin namespace's pending migrations (``schemas``: namespace -> directory), in name order.

    Returns:
        A Deferred firing with each namespace's version afterwards.
    """

    async def run() -> dict[str, int]:
        versions = {}
        for namespace in sorted(schemas):
            versions[namespace] = await _prepare(db, True, schemas[namespace], None, namespace)
        return versions

    return Deferred.fromCoroutine(run())


async def _prepare(db: Database, apply: bool, schema_dir: str | os.PathLike[str] | None,
                   target: int | None, namespace: str | None = None) -> int:
    if namespace is not None and schema_dir is None:
        raise StorageError(f"plugin schema namespace {namespace!r} needs its own schema directory")
    files = schema_files(schema_dir, db.engine.name)
    code = files[-1].version if files else 0
    goal = code if target is None else target
    if goal > code:
        raise StorageError(f"target schema version {goal} is beyond the latest file ({code})")
    current = await current_version(db, namespace)
    if current is not None and current > code:
        raise _newer_error(current, code)
    if not apply:
        if (current or 0) < goal:
            raise SchemaVersionError(
                f"database schema is at version {current if current is not None else 'none'}, "
                f"this code needs {goal}; only the master applies migrations"
            )
        return current or 0
    if current is not None and current >= goal:
        return current  # nothing pending: no lock, no write (every process passes here at start)
    await db.run_interaction("schema_create_version_table", _create_version_table_txn, namespace)
    for f in files:
        if f.version > goal:
            break
        if current is not None and f.version <= current:
            continue
        statements = split_sql(f.path.read_text(encoding="utf-8"), db.engine.name)
        now_ms = int(_now(db.clock) * 1000)
        applied = await db.run_interaction(
            f"schema_migrate_{f.version:04d}", _apply_migration_txn, f, statements, code, now_ms, namespace
        )
        if applied:
            log.info("Applied schema migration {file} ({n} statements){where}", file=f.path.name,
                     n=len(statements), where=f" of {namespace}" if namespace else "")
    final = await current_version(db, namespace)
    return final or 0


def _create_version_table_txn(txn: Txn, namespace: str | None = None) -> None:
    txn.engine.lock_schema_txn(txn)
    txn.execute_raw(CREATE_VERSION_TABLE if namespace is None else CREATE_PLUGIN_VERSION_TABLE)


def _apply_migration_txn(txn: Txn, f: SchemaFile, statements: list[str], code: int,
                         now_ms: int, namespace: str | None = None) -> bool:
    txn.engine.lock_schema_txn(txn)
    current = _current_version_txn(txn, namespace)
    if current is not None and current > code:
        raise _newer_error(current, code)
    if current is not None and current >= f.version:
        return False  # another process applied it while we waited for the lock
    for i, statement in enumerate(statements, 1):
        try:
            txn.execute_raw(statement)
        except Exception as e:
            lines = [ln for ln in statement.splitlines() if ln.strip() and not ln.lstrip().startswith("--")]
            first_line = (lines or [statement])[0].strip()[:80]
            where = f" of {namespace}" if namespace else ""
            raise StorageError(
                f"schema migration {f.path.name}{where} failed at statement {i} ({first_line!r}): "
                f"{type(e).__name__}: {str(e).strip()}"
            ) from e
    if namespace is None:
        txn.execute("INSERT INTO schema_version (version, applied_at) VALUES (?, ?)", (f.version, now_ms))
    else:
        txn.execute("INSERT INTO plugin_schema_version (namespace, version, applied_at) VALUES (?, ?, ?)",
                    (namespace, f.version, now_ms))
    return True


def wait_for_schema(db: Database, clock: IReactorTime, *, version: int | None = None,
                    timeout_s: float = 60.0, poll_s: float = 0.5,
                    schema_dir: str | os.PathLike[str] | None = None) -> Deferred[int]:
    """Poll until the database schema reaches ``version`` (what a worker does at start-up).

    Errors while polling (the database not up yet) are logged and polled
    through until the timeout. Cancelling the Deferred stops polling.

    Args:
        db: the database.
        clock: schedules the polls and measures the timeout.
        version: the version needed; None for the latest in ``schema_dir``.
        timeout_s: how long to wait in total.
        poll_s: the time between polls.
        schema_dir: the migrations; None for synflow's own.

    Returns:
        A Deferred firing with the version found (≥ ``version``).

    Raises:
        SchemaVersionError: after ``timeout_s``, saying which version was
            found and which is needed; or at once when the database is newer
            than this code.
    """
    return Deferred.fromCoroutine(_wait(db, clock, version, timeout_s, poll_s, schema_dir))


async def _wait(db: Database, clock: IReactorTime, version: int | None, timeout_s: float,
                poll_s: float, schema_dir: str | os.PathLike[str] | None) -> int:
    code = latest_version(schema_dir)
    needed = code if version is None else version
    deadline = _now(clock) + timeout_s
    reported: object = ()
    while True:
        found: int | None = None
        error = ""
        try:
            found = await current_version(db)
        except Exception as e:
            error = f"{type(e).__name__}: {str(e).strip()}"
        if found is not None and found > max(code, needed):
            raise _newer_error(found, code)
        if found is not None and found >= needed:
            return found
        described = error or (f"version {found}" if found is not None else "no schema yet")
        if described != reported:
            log.info("Waiting for database schema version {needed}, found {found}",
                     needed=needed, found=described)
            reported = described
        remaining = deadline - _now(clock)
        if remaining <= 0:
            raise SchemaVersionError(
                f"database schema is at {described}, this process needs version {needed}; "
                f"gave up after {timeout_s:g}s: start the master first (it applies migrations)"
            )
        await deferLater(clock, min(poll_s, remaining), lambda: None)
