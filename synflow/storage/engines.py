"""Database engines, the transaction wrapper and the connection pool.

synflow talks to SQLite (the embedded default) or PostgreSQL through
:mod:`twisted.enterprise.adbapi`. Everything that differs between the two lives
in an :class:`Engine`: how to connect, the placeholder style, a few SQL
snippets, and which errors are worth retrying. Store code writes SQL once,
with ``?`` placeholders, in functions that run on a pool thread and end in
``_txn``; they receive a :class:`Txn`. :class:`Database` runs them, commits or
rolls back, fires the after-commit/on-rollback callbacks on the reactor
thread, retries idempotent work after transient errors, and keeps per-``desc``
counts and timings. On a SQLite file, read-only interactions run on the
reactor thread (a WAL reader takes no lock; the thread hand-over would cost
more than the read).

The configuration (:class:`DatabaseConfig`) is validated here too, so the
config loader only has to call :meth:`DatabaseConfig.from_dict`.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import abc
import contextlib
import functools
import os
import random
import re
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Literal, cast

import attrs
from twisted.enterprise import adbapi
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IReactorCore, IReactorTime
from twisted.internet.task import deferLater
from twisted.logger import Logger

from synflow.errors import ConfigError, StorageError

log = Logger()

#: How long a SQLite connection waits for another process's write lock.
SQLITE_BUSY_TIMEOUT_S = 30.0
#: Waiting for the write lock at ``BEGIN IMMEDIATE``: the first poll after
#: this long, doubling up to :data:`SQLITE_LOCK_POLL_MAX_S` (each with
#: jitter). SQLite's own busy handler sleeps 1, 2, 5, 10 ... up to 100 ms
#: between polls, so a writer that misses a lock held for 2 ms can sleep
#: 100 ms: under several processes' writes, most of the tail latency.
SQLITE_LOCK_POLL_S = 0.0002
SQLITE_LOCK_POLL_MAX_S = 0.002
#: How many times an ``idempotent=True`` interaction is retried after a transient error.
MAX_RETRIES = 5
#: Delay before the first retry; each further retry doubles it (0.05, 0.1, 0.2, ...).
RETRY_BACKOFF_S = 0.05
#: The values of ``database.synchronous`` (SQLite's ``PRAGMA synchronous``); the first is the default.
SQLITE_SYNCHRONOUS = ("full", "normal")
#: Rows per statement for :meth:`Txn.insert_many` on PostgreSQL.
INSERT_PAGE_SIZE = 1000

EngineName = Literal["sqlite", "postgres"]
ENGINE_ALIASES: Mapping[str, EngineName] = {
    "sqlite": "sqlite", "sqlite3": "sqlite",
    "postgres": "postgres", "postgresql": "postgres", "psycopg2": "postgres",
}
_MEMORY_PATHS = (":memory:", "")
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?$")


# --------------------------------------------------------------------- config


def _default_cp_max(config: DatabaseConfig) -> int:
    return 1 if config.engine == "sqlite" else 5


@attrs.frozen
class DatabaseConfig:
    """The ``database`` section of the configuration.

    Attributes:
        engine: ``"sqlite"`` (embedded default) or ``"postgres"``.
        path: the SQLite database file. ``":memory:"`` only with ``cp_max == 1``.
        host: PostgreSQL host name or socket directory.
        port: PostgreSQL port.
        user: PostgreSQL user.
        password: PostgreSQL password, or None for trust/peer/.pgpass auth.
        dbname: PostgreSQL database name.
        cp_min: connections the pool keeps open.
        cp_max: most connections (and pool threads); 1 for SQLite, 5 for PostgreSQL.
        connect_timeout_s: how long to wait for a PostgreSQL connection.
        synchronous: SQLite's ``PRAGMA synchronous``: ``full`` (default: a
            commit is on disk before it is acknowledged) or ``normal`` (with
            WAL, the last commits before a power loss or OS crash can be lost;
            a process crash loses nothing). Ignored by PostgreSQL.

    Raises:
        StorageError: when the values are inconsistent (see :meth:`from_dict`
            for the same checks reported as a :class:`ConfigError`).
    """

    engine: EngineName = "sqlite"
    path: str = "synflow.db"
    host: str = "localhost"
    port: int = 5432
    user: str = "synflow"
    password: str | None = attrs.field(default=None, repr=False)
    dbname: str = "synflow"
    cp_min: int = 1
    cp_max: int = attrs.field(default=attrs.Factory(_default_cp_max, takes_self=True))
    connect_timeout_s: float = 10.0
    synchronous: str = "full"

    def __attrs_post_init__(self) -> None:
        problem = _config_problem(attrs.asdict(self))
        if problem is not None:
            raise StorageError(f"database.{problem[0]}: {problem[1]}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DatabaseConfig:
        """Build a config from the ``database`` mapping of a YAML file.

        Args:
            d: the mapping; absent keys take their defaults. ``engine`` also
                accepts Synapse's spellings ``sqlite3`` and ``psycopg2``.

        Returns:
            The validated config.

        Raises:
            ConfigError: naming the key (``database.<key>``) of the first
                unknown, mistyped or inconsistent value.
        """
        if not isinstance(d, Mapping):
            raise ConfigError(f"must be a mapping, got {type(d).__name__}", key="database")
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            expected = _CONFIG_TYPES.get(key)
            if expected is None:
                known = ", ".join(_CONFIG_TYPES)
                raise ConfigError(f"unknown key {key!r}; known keys: {known}", key=f"database.{key}")
            if value is None and key == "password":
                continue
            if isinstance(value, bool) or not isinstance(value, expected):
                names = " or ".join(t.__name__ for t in expected)
                shown = "" if key == "password" else f" {value!r}"  # never echo a secret
                raise ConfigError(
                    f"must be {names}, got {type(value).__name__}{shown}", key=f"database.{key}"
                )
            kwargs[key] = value
        if "engine" in kwargs:
            engine = ENGINE_ALIASES.get(kwargs["engine"])
            if engine is None:
                raise ConfigError(
                    f"unknown engine {kwargs['engine']!r}; use 'sqlite' or 'postgres'",
                    key="database.engine",
                )
            kwargs["engine"] = engine
        values = {a.name: a.default for a in attrs.fields(cls)} | kwargs
        if "cp_max" not in kwargs:
            values["cp_max"] = 1 if values["engine"] == "sqlite" else 5
        problem = _config_problem(values)
        if problem is not None:
            raise ConfigError(problem[1], key=f"database.{problem[0]}")
        return cls(**kwargs)


def _config_problem(v: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first inconsistency in resolved config values as (key, message), or None."""
    if v["engine"] not in ("sqlite", "postgres"):
        return "engine", f"unknown engine {v['engine']!r}; use 'sqlite' or 'postgres'"
    if v["cp_min"] < 1:
        return "cp_min", f"must be at least 1, got {v['cp_min']}"
    if v["cp_max"] < v["cp_min"]:
        return "cp_max", f"must be at least cp_min ({v['cp_min']}), got {v['cp_max']}"
    if not 0 < v["port"] < 65536:
        return "port", f"must be a TCP port number, got {v['port']}"
    if v["connect_timeout_s"] <= 0:
        return "connect_timeout_s", f"must be positive, got {v['connect_timeout_s']}"
    if v["synchronous"] not in SQLITE_SYNCHRONOUS:
        return "synchronous", (f"must be one of {', '.join(SQLITE_SYNCHRONOUS)}, got {v['synchronous']!r} "
                               "(full: every acknowledged commit survives a power loss; normal: the last "
                               "ones may not)")
    if v["engine"] == "sqlite" and v["path"] in _MEMORY_PATHS and v["cp_max"] > 1:
        return "path", (
            f"an in-memory SQLite database ({v['path']!r}) gives each of the "
            f"{v['cp_max']} pool threads its own empty database; use a file path, "
            "or set cp_max: 1"
        )
    return None


_CONFIG_TYPES: Mapping[str, tuple[type, ...]] = {
    "engine": (str,), "path": (str,), "host": (str,), "port": (int,), "user": (str,),
    "password": (str,), "dbname": (str,), "cp_min": (int,), "cp_max": (int,),
    "connect_timeout_s": (int, float), "synchronous": (str,),
}


# ------------------------------------------------------------------ SQL text

_SQLITE_START = re.compile(r"""'|"|`|--|/\*""")
_PG_START = re.compile(r"""'|"|--|/\*|\$(?:[A-Za-z_][A-Za-z0-9_]*)?\$""")


def _is_word_char(ch: str) -> bool:
    return ch.isalnum() or ch in "_$"


def _literal_end(sql: str, start: int, token: str, postgres: bool) -> int:
    """Where the literal or comment opened by ``token`` at ``start`` ends (exclusive)."""
    if token == "--":
        end = sql.find("\n", start)
        return len(sql) if end < 0 else end
    if token == "/*":
        end = sql.find("*/", start + 2)
        return len(sql) if end < 0 else end + 2
    if token.startswith("$"):
        end = sql.find(token, start + len(token))
        return len(sql) if end < 0 else end + len(token)
    # A PostgreSQL E'...' string honours backslash escapes; others only doubling,
    # which scanning handles as two adjacent literals.
    backslash = (
        postgres and token == "'" and start > 0 and sql[start - 1] in "eE"
        and (start < 2 or not _is_word_char(sql[start - 2]))
    )
    i = start + 1
    while i < len(sql):
        if backslash and sql[i] == "\\":
            i += 2
            continue
        if sql[i] == token:
            return i + 1
        i += 1
    return len(sql)


def scan_sql(sql: str, engine: str) -> list[tuple[bool, str]]:
    """Split SQL text into code and non-code pieces.

    Non-code pieces are string literals, quoted identifiers and comments;
    PostgreSQL's ``E'...'`` strings and ``$tag$...$tag$`` dollar quoting are
    understood when ``engine`` is ``"postgres"``. An unterminated literal runs
    to the end of the text. Joining the pieces gives back ``sql``.

    Args:
        sql: the SQL text.
        engine: ``"sqlite"`` or ``"postgres"`` (the dialect's quoting rules).

    Returns:
        ``(is_code, text)`` pairs in order.
    """
    postgres = engine == "postgres"
    start_re = _PG_START if postgres else _SQLITE_START
    pieces: list[tuple[bool, str]] = []
    pos = code_from = 0
    while True:
        m = start_re.search(sql, pos)
        if m is None:
            break
        start, token = m.start(), m.group()
        if token.startswith("$") and start > 0 and _is_word_char(sql[start - 1]):
            pos = start + 1  # a '$' inside an identifier, not a dollar quote
            continue
        if start > code_from:
            pieces.append((True, sql[code_from:start]))
        end = _literal_end(sql, start, token, postgres)
        pieces.append((False, sql[start:end]))
        pos = code_from = end
    if code_from < len(sql):
        pieces.append((True, sql[code_from:]))
    return pieces


@functools.lru_cache(maxsize=2048)
def _to_pyformat(sql: str) -> str:
    out = []
    for is_code, text in scan_sql(sql, "postgres"):
        text = text.replace("%", "%%")  # psycopg2 formats the whole string
        out.append(text.replace("?", "%s") if is_code else text)
    return "".join(out)


# -------------------------------------------------------------------- engines


class Engine(abc.ABC):
    """What differs between the database engines synflow supports."""

    #: The engine's name as used in config: ``"sqlite"`` or ``"postgres"``.
    name: ClassVar[EngineName]
    #: The DB-API module adbapi imports.
    dbapi_name: ClassVar[str]
    #: Whether adbapi should replace a connection that failed a rollback.
    reconnect: ClassVar[bool]

    @abc.abstractmethod
    def convert_placeholders(self, sql: str) -> str:
        """Turn SQL written with ``?`` placeholders into the driver's style."""

    @abc.abstractmethod
    def greatest(self, a: str, b: str) -> str:
        """An SQL expression for the larger of two SQL expressions."""

    @abc.abstractmethod
    def is_transient(self, exc: BaseException) -> bool:
        """Whether running the same interaction again may succeed."""

    @abc.abstractmethod
    def connect_args(self, config: DatabaseConfig) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Positional and keyword arguments for the DB-API ``connect()``."""

    def on_connect(self, conn: Any, config: DatabaseConfig | None = None) -> None:  # noqa: B027 - optional hook
        """Prepare a new connection (adbapi's ``cp_openfun``)."""

    def begin_txn(self, cursor: Any, read_only: bool = False) -> None:  # noqa: B027 - optional hook
        """Start a transaction on a connection that is idle."""

    def rollback_open(self, conn: Any, cursor: Any) -> None:  # noqa: B027 - optional hook
        """Roll back a transaction a Txn opened itself on ``conn`` (autocommit mode), if one is open."""

    @abc.abstractmethod
    def insert_many_txn(
        self, cursor: Any, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], suffix: str = ""
    ) -> None:
        """Insert ``rows`` into ``table`` in as few statements as is sensible (``suffix``: ON CONFLICT ...)."""

    def execute(self, cursor: Any, sql: str, args: Sequence[Any]) -> None:
        """Run one statement in the driver's placeholder style with its parameters."""
        cursor.execute(sql, tuple(args))

    def render_insert_many(
        self, cursor: Any, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], suffix: str = ""
    ) -> list[bytes] | None:
        """The statements :meth:`insert_many_txn` would run, as text with the values in, or None.

        An engine that returns them lets a transaction send its writes
        together, in one round trip (see :meth:`Txn.insert_many`).
        """
        return None

    @abc.abstractmethod
    def table_exists_txn(self, txn: Txn, table: str) -> bool:
        """Whether ``table`` exists (in the current schema)."""

    def lock_schema_txn(self, txn: Txn) -> None:  # noqa: B027 - optional hook
        """Take the cross-process lock that serialises schema migrations."""


class SqliteEngine(Engine):
    """SQLite through :mod:`sqlite3`, in WAL mode, safe for several processes.

    The driver is put in autocommit mode (``isolation_level=None``) and every
    interaction starts with ``BEGIN IMMEDIATE``, taking the write lock up
    front. With ``isolation_level="IMMEDIATE"`` the driver would only begin
    before INSERT/UPDATE/DELETE, so a SELECT-then-INSERT would not be atomic
    and DDL would commit statement by statement; and a deferred transaction
    that upgrades to a write after another process committed fails at once
    with ``SQLITE_BUSY`` instead of waiting.
    """

    name = "sqlite"
    dbapi_name = "sqlite3"
    reconnect = False

    def convert_placeholders(self, sql: str) -> str:
        return sql

    def greatest(self, a: str, b: str) -> str:
        return f"MAX({a}, {b})"

    def is_transient(self, exc: BaseException) -> bool:
        if not isinstance(exc, sqlite3.OperationalError):
            return False
        errname = getattr(exc, "sqlite_errorname", "") or ""
        text = str(exc).lower()
        return errname.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or (
            "database is locked" in text or "database table is locked" in text or "busy" in text
        )

    def connect_args(self, config: DatabaseConfig) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (config.path,), {
            "check_same_thread": False,
            "isolation_level": None,
            "timeout": SQLITE_BUSY_TIMEOUT_S,
        }

    def on_connect(self, conn: Any, config: DatabaseConfig | None = None) -> None:
        synchronous = config.synchronous if config is not None else SQLITE_SYNCHRONOUS[0]
        cur = conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
        cur.execute("PRAGMA journal_mode = WAL")
        mode = cur.fetchone()[0]
        if mode.lower() not in ("wal", "memory"):
            raise StorageError(
                f"SQLite refused WAL mode (got {mode!r}); put the database on a local "
                "filesystem, where several processes can share it"
            )
        # FULL: WAL is synced at every commit, so an acknowledged commit (and
        # with it the stream sequence) survives a power loss; NORMAL syncs
        # only at checkpoints.
        cur.execute(f"PRAGMA synchronous = {synchronous.upper()}")
        cur.execute("PRAGMA foreign_keys = ON")
        cur.close()

    def begin_txn(self, cursor: Any, read_only: bool = False) -> None:
        # A read-only interaction takes no write lock: concurrent readers in
        # other processes never wait for each other (WAL gives a snapshot).
        if read_only:
            cursor.execute("BEGIN")
            return
        # The write lock is polled here, at short intervals, instead of by
        # SQLite's busy handler (see SQLITE_LOCK_POLL_S); every other
        # statement keeps the connection's busy timeout.
        cursor.execute("PRAGMA busy_timeout = 0")
        try:
            delay = SQLITE_LOCK_POLL_S
            deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_S
            while True:
                try:
                    cursor.execute("BEGIN IMMEDIATE")
                    return
                except sqlite3.OperationalError as e:
                    if not self.is_transient(e) or time.monotonic() > deadline:
                        raise
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, SQLITE_LOCK_POLL_MAX_S)
        finally:
            cursor.execute(f"PRAGMA busy_timeout = {int(SQLITE_BUSY_TIMEOUT_S * 1000)}")

    def insert_many_txn(
        self, cursor: Any, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], suffix: str = ""
    ) -> None:
        marks = ", ".join("?" for _ in columns)
        cursor.executemany(f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks}){suffix}", rows)

    def table_exists_txn(self, txn: Txn, table: str) -> bool:
        txn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,))
        return txn.fetchone() is not None


#: Key of the advisory lock held while a migration runs ("synflow" in ASCII).
SCHEMA_LOCK_ID = int.from_bytes(b"synflow", "big")
#: SQLSTATEs that mean the connection or server went away, or a retry may succeed.
_PG_TRANSIENT_CODES = ("57P01", "57P02", "57P03", "53300")


def plain_pg_literals(connection: Any) -> bool:
    """Whether :func:`pg_literal` may quote values for this psycopg2 connection.

    That is when the server reads a string literal as its text with each
    quote doubled (``standard_conforming_strings`` on, PostgreSQL's default
    since 9.1) and the client encoding is UTF-8, both psycopg2's and the
    server's: then a backslash is an ordinary character, and no byte of a
    UTF-8 sequence is a quote. The server's settings are read from what it
    last reported on this connection, so a ``SET`` of either is seen.
    """
    status = connection.get_parameter_status
    return bool(connection.encoding == "UTF8" and status("client_encoding") == "UTF8"
                and status("standard_conforming_strings") == "on")


def pg_literal(value: Any, mogrify: Callable[[bytes, Sequence[Any]], bytes]) -> bytes:
    """``value`` as an SQL literal, byte for byte what psycopg2's ``mogrify(b"%s", (value,))`` gives.

    For a connection where :func:`plain_pg_literals` holds. ``str``, ``int``
    and ``None`` -- most of what synflow writes -- are quoted here, several
    times faster than through psycopg2's adapters; anything else (``bool``,
    ``float``, ``bytes``, adapted types) goes to ``mogrify``.

    Raises:
        ValueError: a string holds a NUL character (as psycopg2 raises).
        UnicodeEncodeError: a string is not encodable as UTF-8 (a lone surrogate).
    """
    kind = type(value)
    if kind is str:
        if "\x00" in value:
            raise ValueError("A string literal cannot contain NUL (0x00) characters.")
        return b"'" + value.replace("'", "''").encode() + b"'"
    if kind is int:
        # A negative number goes out after a space, as psycopg2 writes it: after
        # a minus sign, "--" would start a comment.
        return str(value).encode() if value >= 0 else b" " + str(value).encode()
    if value is None:
        return b"NULL"
    return mogrify(b"%s", (value,))


class PostgresEngine(Engine):
    """PostgreSQL through :mod:`psycopg2`."""

    name = "postgres"
    dbapi_name = "psycopg2"
    reconnect = True

    def convert_placeholders(self, sql: str) -> str:
        return _to_pyformat(sql)

    def greatest(self, a: str, b: str) -> str:
        return f"GREATEST({a}, {b})"

    def is_transient(self, exc: BaseException) -> bool:
        import psycopg2

        if isinstance(exc, psycopg2.InterfaceError):
            return True  # "connection already closed"
        if isinstance(exc, psycopg2.OperationalError):
            code = exc.pgcode
            # A lost connection has no SQLSTATE; class 08 is connection
            # exceptions, class 40 serialization failures and deadlocks.
            return code is None or code[:2] in ("08", "40") or code in _PG_TRANSIENT_CODES
        return False

    def connect_args(self, config: DatabaseConfig) -> tuple[tuple[Any, ...], dict[str, Any]]:
        kwargs: dict[str, Any] = {
            "host": config.host, "port": config.port, "user": config.user,
            "dbname": config.dbname, "application_name": "synflow",
            # libpq takes whole seconds and treats anything below 2 as 2.
            "connect_timeout": max(2, int(round(config.connect_timeout_s))),
        }
        if config.password is not None:
            kwargs["password"] = config.password
        return (), kwargs

    def on_connect(self, conn: Any, config: DatabaseConfig | None = None) -> None:
        # Every interaction runs in autocommit mode: a Txn opens its transaction
        # itself (Database._explicit_txn), a single read runs outside one, and
        # run_autocommit's statements commit one by one. The connection stays
        # so; switching it per interaction cost two calls into the driver each.
        conn.autocommit = True

    def rollback_open(self, conn: Any, cursor: Any) -> None:
        """Roll back the transaction open on ``conn`` (in autocommit mode), if one is; never raises."""
        from psycopg2.extensions import TRANSACTION_STATUS_IDLE

        try:
            if conn.get_transaction_status() != TRANSACTION_STATUS_IDLE:
                cursor.execute("ROLLBACK")
        except Exception:  # the connection is gone; adbapi's rollback replaces it
            pass

    def execute(self, cursor: Any, sql: str, args: Sequence[Any]) -> None:
        # psycopg2 would put the parameters in through its adapters; pg_literal
        # makes the same bytes (psycopg2 formats the statement with "%" too,
        # and sends a statement given without parameters as it is).
        if args and plain_pg_literals(cursor.connection):
            mogrify = cursor.mogrify
            cursor.execute(sql.encode() % tuple([pg_literal(value, mogrify) for value in args]))
        else:
            cursor.execute(sql, tuple(args))

    def insert_many_txn(
        self, cursor: Any, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], suffix: str = ""
    ) -> None:
        for statement in self.render_insert_many(cursor, table, columns, rows, suffix):
            cursor.execute(statement)

    def render_insert_many(
        self, cursor: Any, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], suffix: str = ""
    ) -> list[bytes]:
        # What psycopg2's execute_values sends, page by page, with each value
        # quoted as psycopg2 quotes it (see pg_literal).
        head = f"INSERT INTO {table} ({', '.join(columns)}) VALUES ".encode()
        tail = suffix.encode()
        mogrify = cursor.mogrify
        render: Callable[[Sequence[Any]], bytes]
        if plain_pg_literals(cursor.connection):
            def render(row: Sequence[Any]) -> bytes:
                return b"(" + b",".join([pg_literal(value, mogrify) for value in row]) + b")"
        else:
            row_sql = ("(" + ",".join(["%s"] * len(columns)) + ")").encode()

            def render(row: Sequence[Any]) -> bytes:
                return mogrify(row_sql, row)
        return [head + b",".join([render(row) for row in rows[i:i + INSERT_PAGE_SIZE]]) + tail
                for i in range(0, len(rows), INSERT_PAGE_SIZE)]

    def table_exists_txn(self, txn: Txn, table: str) -> bool:
        txn.execute(
            "SELECT 1 FROM information_schema.tables"
            " WHERE table_schema = current_schema() AND table_name = ?",
            (table,),
        )
        return txn.fetchone() is not None

    def lock_schema_txn(self, txn: Txn) -> None:
        txn.execute("SELECT pg_advisory_xact_lock(?)", (SCHEMA_LOCK_ID,))


_ENGINES: Mapping[str, Engine] = {"sqlite": SqliteEngine(), "postgres": PostgresEngine()}


def get_engine(name: str) -> Engine:
    """The engine called ``name`` (``"sqlite"`` or ``"postgres"``).

    Raises:
        StorageError: for any other name.
    """
    try:
        return _ENGINES[name]
    except KeyError:
        raise StorageError(f"unknown database engine {name!r}; use 'sqlite' or 'postgres'") from None


# ------------------------------------------------------------------------ Txn

Callback = Callable[..., object]


class Txn:
    """The handle a ``_txn`` function gets: a cursor that speaks ``?`` SQL.

    Attributes:
        engine: the :class:`Engine`, for dialect snippets like :meth:`Engine.greatest`.
        desc: the description the interaction was started with.
    """

    def __init__(self, cursor: Any, engine: Engine, desc: str, *, defer_writes: bool = False,
                 begin: bool = False):
        self._cursor = cursor
        self.engine = engine
        self.desc = desc
        self._after: list[tuple[Callback, tuple[Any, ...]]] = []
        self._on_exception: list[tuple[Callback, tuple[Any, ...]]] = []
        #: Writes not yet sent (``defer_writes``): they go out together before the next statement.
        self._deferred: list[bytes] | None = [] if defer_writes else None
        #: ``"BEGIN;"`` until the first statement sent carries it (``begin``: on a connection in
        #: autocommit mode, this Txn opens the transaction itself and ends it with :meth:`_commit`).
        self._begin = "BEGIN;" if begin else ""

    def execute(self, sql: str, args: Sequence[Any] = ()) -> None:
        """Run one statement written with ``?`` placeholders."""
        if self._deferred:
            self.flush_writes()
        sql = self.engine.convert_placeholders(sql)
        if self._begin:
            sql, self._begin = self._begin + sql, ""
        self.engine.execute(self._cursor, sql, args)

    def execute_raw(self, sql: str) -> None:
        """Run one statement exactly as written, without parameters (DDL, migrations)."""
        if self._deferred:
            self.flush_writes()
        if self._begin:
            sql, self._begin = self._begin + sql, ""
        self._cursor.execute(sql)

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        """Run one ``?`` statement once per row of parameters."""
        if self._deferred:
            self.flush_writes()
        self._start()
        self._cursor.executemany(self.engine.convert_placeholders(sql), [tuple(r) for r in rows])

    def _start(self) -> None:
        """Open the transaction now if this Txn opens it and nothing has yet (before a driver call that
        sends statements of its own)."""
        if self._begin:
            self._begin = ""
            self._cursor.execute("BEGIN")

    def _commit(self) -> None:
        """End a transaction this Txn opened: deferred writes and ``COMMIT`` in one round trip (nothing at
        all if no statement was sent)."""
        pending = self._deferred or []
        if self._deferred:
            self._deferred = []
        if self._begin:  # nothing sent: no transaction to end, unless the writes open one now
            self._begin = ""
            if pending:
                self._cursor.execute(b"BEGIN;" + b";".join(pending) + b";COMMIT")
            return
        self._cursor.execute(b";".join([*pending, b"COMMIT"]))

    def flush_writes(self) -> None:
        """Send the writes :meth:`insert_many` and :meth:`upsert_many` deferred, in one round trip.

        Called before any other statement and before :attr:`rowcount` is read;
        what is left when the interaction's function returns goes out with its
        ``COMMIT`` (:meth:`Database._explicit_txn`). Statements run in the
        order they were made, and a failing write fails the transaction as it
        would have at once, its error raised by the call that sends it (this
        one, or the commit) instead of by the call that made it.
        """
        pending = self._deferred
        if pending:
            self._deferred = []
            text = pending[0] if len(pending) == 1 else b";".join(pending)
            if self._begin:
                text, self._begin = b"BEGIN;" + text, ""
            self._cursor.execute(text)

    def insert_many(self, table: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
        """Insert many rows with few statements (multi-row VALUES on PostgreSQL).

        Args:
            table: the table name (a plain, optionally schema-qualified, identifier).
            columns: the column names, in the order of each row's values.
            rows: the rows; ``rowcount`` afterwards is not their total.

        Raises:
            ValueError: if a name is not a plain identifier or a row has the
                wrong number of values.
        """
        for ident in (table, *columns):
            if not _IDENTIFIER.match(ident):
                raise ValueError(f"not a plain SQL identifier: {ident!r}")
        batch = _row_tuples(rows, len(columns))
        if batch:
            self._insert(table, columns, batch, "")

    def _insert(self, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], suffix: str) -> None:
        """Rows checked already: sent now, or deferred to :meth:`flush_writes` when this transaction defers."""
        if self._deferred is not None:
            rendered = self.engine.render_insert_many(self._cursor, table, columns, rows, suffix)
            if rendered is not None:
                self._deferred.extend(rendered)
                return
        self._start()
        self.engine.insert_many_txn(self._cursor, table, columns, rows, suffix)

    def upsert_many(self, table: str, keys: Sequence[str], values: Sequence[str],
                    rows: Iterable[Sequence[Any]]) -> None:
        """Insert rows, or update ``values`` of the rows whose ``keys`` already exist.

        Rows repeating a key are collapsed to the last one (one statement
        may not update a row twice).

        Raises:
            ValueError: if a name is not a plain identifier or a row has the
                wrong number of values.
        """
        latest: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        for row in _row_tuples(rows, len(keys) + len(values)):
            latest[row[: len(keys)]] = row
        if not latest:
            return
        for ident in (table, *keys, *values):
            if not _IDENTIFIER.match(ident):
                raise ValueError(f"not a plain SQL identifier: {ident!r}")
        action = (
            "DO UPDATE SET " + ", ".join(f"{v} = excluded.{v}" for v in values) if values else "DO NOTHING"
        )
        suffix = f" ON CONFLICT ({', '.join(keys)}) {action}"
        self._insert(table, (*keys, *values), list(latest.values()), suffix)

    def fetchone(self) -> tuple[Any, ...] | None:
        """The next result row, or None."""
        row = self._cursor.fetchone()
        return None if row is None else tuple(row)

    def fetchall(self) -> list[tuple[Any, ...]]:
        """All remaining result rows."""
        return [tuple(r) for r in self._cursor.fetchall()]

    @property
    def rowcount(self) -> int:
        """Rows affected by the last statement (driver semantics; deferred writes are sent first)."""
        if self._deferred:
            self.flush_writes()
        return int(self._cursor.rowcount)

    def call_after(self, cb: Callback, *args: Any) -> None:
        """Call ``cb(*args)`` on the reactor thread once this transaction has committed."""
        self._after.append((cb, args))

    def call_on_exception(self, cb: Callback, *args: Any) -> None:
        """Call ``cb(*args)`` on the reactor thread if this transaction rolls back."""
        self._on_exception.append((cb, args))

    def _fire(self, committed: bool) -> None:
        """Run the callbacks for the outcome; a failing callback is logged, not raised."""
        for cb, args in self._after if committed else self._on_exception:
            try:
                cb(*args)
            except Exception:
                log.failure("Callback {cb!r} of database interaction {desc} failed",
                            cb=cb, desc=self.desc)


class _OneStatementTxn(Txn):
    """A :class:`Txn` that runs a single statement (outside a transaction block: one snapshot)."""

    _ran = False

    def _one(self) -> None:
        if self._ran:
            raise StorageError(f"database interaction {self.desc} was declared to run one statement and ran a second")
        self._ran = True

    def execute(self, sql: str, args: Sequence[Any] = ()) -> None:
        self._one()
        super().execute(sql, args)

    def execute_raw(self, sql: str) -> None:
        self._one()
        super().execute_raw(sql)

    def _writes(self) -> None:
        raise StorageError(f"database interaction {self.desc} was declared to only read, with one statement")

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        self._writes()

    def insert_many(self, table: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
        self._writes()

    def upsert_many(self, table: str, keys: Sequence[str], values: Sequence[str],
                    rows: Iterable[Sequence[Any]]) -> None:
        self._writes()


def _row_tuples(rows: Iterable[Sequence[Any]], width: int) -> list[tuple[Any, ...]]:
    """``rows`` as tuples, each checked to hold ``width`` values (one per column).

    Raises:
        ValueError: a row has the wrong number of values.
    """
    batch = [tuple(r) for r in rows]
    for row in batch:
        if len(row) != width:
            raise ValueError(f"row {row!r} has {len(row)} values for {width} columns")
    return batch


# ------------------------------------------------------------------- Database


class Database:
    """A connection pool with transactions, callbacks, retries and statistics.

    Args:
        reactor: an ``IReactorCore``/``IReactorThreads`` provider for the pool.
        config: what to connect to.
        clock: schedules retry backoff; defaults to ``reactor``.

    Raises:
        StorageError: if the SQLite file's directory does not exist.
    """

    def __init__(self, reactor: IReactorCore, config: DatabaseConfig, *,
                 clock: IReactorTime | None = None):
        self.config = config
        self._reactor = reactor
        self.engine = get_engine(config.engine)
        self.clock: IReactorTime = clock if clock is not None else cast(IReactorTime, reactor)
        if self.engine.name == "sqlite" and config.path not in _MEMORY_PATHS:
            parent = os.path.dirname(os.path.abspath(config.path))
            if not os.path.isdir(parent):
                raise StorageError(
                    f"database.path {config.path!r}: directory {parent!r} does not exist"
                )
        args, kwargs = self.engine.connect_args(config)
        self._pool = adbapi.ConnectionPool(
            self.engine.dbapi_name, *args, cp_reactor=reactor, cp_min=config.cp_min,
            cp_max=config.cp_max, cp_reconnect=self.engine.reconnect,
            cp_openfun=functools.partial(self.engine.on_connect, config=config), cp_noisy=False, **kwargs,
        )
        self._stats: dict[str, list[float]] = {}
        self._in_flight = 0
        self._idle_waiters: list[Deferred[None]] = []
        self._sleeps: set[Deferred[None]] = set()
        self._closed = False
        #: SQLite file databases run read-only interactions on the reactor thread (see _read_inline).
        self._inline_reads = self.engine.name == "sqlite" and config.path not in _MEMORY_PATHS
        self._reader: sqlite3.Connection | None = None

    def start(self) -> None:
        """Start the pool's threads now (only needed before the reactor runs)."""
        self._pool.start()

    def run_interaction(self, desc: str, func: Callable[..., Any], *args: Any,
                        idempotent: bool = False, read_only: bool = False, one_statement: bool = False,
                        **kwargs: Any) -> Deferred[Any]:
        """Run ``func(txn, *args, **kwargs)`` in one transaction on a pool thread.

        The transaction commits when ``func`` returns and rolls back when it
        raises; then the :meth:`Txn.call_after` or :meth:`Txn.call_on_exception`
        callbacks run on the reactor thread, and the Deferred fires.

        Args:
            desc: a short name of the interaction, for logs and :meth:`stats`.
            func: a synchronous ``_txn`` function.
            read_only: the function only reads (on SQLite it then takes no
                write lock, so readers in several processes run concurrently,
                and on a SQLite file it runs on the reactor thread's own
                connection, with no thread hand-over).
            one_statement: ``func`` only reads, with a single statement (implies
                ``read_only``). On PostgreSQL it then runs outside a transaction
                block, one round trip and one statement for the server instead
                of three (``BEGIN``, the statement, ``COMMIT``); one statement
                sees one snapshot either way. A second statement raises
                :class:`StorageError` (on every engine).
            idempotent: when True, a transient error (lost connection, lock
                timeout, serialization failure) rolls back and reruns ``func``
                up to :data:`MAX_RETRIES` times, after an exponential backoff
                on ``clock``. Each rolled-back attempt fires its own exception
                callbacks.

        Returns:
            A Deferred firing with ``func``'s result, or failing with its
            exception (the driver's own, for database errors).
        """
        read_only = read_only or one_statement

        def attempt(box: list[Txn]) -> Deferred[Any]:
            if read_only and self._inline_reads:
                return self._read_inline(box, desc, func, args, kwargs, one_statement)
            if self.engine.name == "postgres":
                if one_statement:
                    return self._pool.runWithConnection(self._autocommit_txn, box, desc, func, args, kwargs, True)
                return self._pool.runWithConnection(self._explicit_txn, box, desc, func, args, kwargs, read_only)
            return self._pool.runInteraction(self._interaction_txn, box, desc, func, args, kwargs, read_only,
                                             one_statement)

        return Deferred.fromCoroutine(self._run(desc, attempt, idempotent))

    def _read_inline(self, box: list[Txn], desc: str, func: Callable[..., Any], args: tuple[Any, ...],
                     kwargs: dict[str, Any], one_statement: bool = False) -> Deferred[Any]:
        """A read-only interaction on the reactor thread's own SQLite connection.

        Handing a read to the pool thread and back costs more CPU than most
        reads (the thread wake-up, the GIL hand-over, two Deferred hops), and
        a WAL reader takes no lock, so it never waits for another process's
        write. If the read does meet a lock (a WAL recovery), it is run on the
        pool instead, where waiting does not stall the reactor.
        """
        conn = self._reader
        if conn is None:
            args_, kwargs_ = self.engine.connect_args(self.config)
            conn = self._reader = sqlite3.connect(*args_, **kwargs_)
            self.engine.on_connect(conn, self.config)
            conn.execute("PRAGMA busy_timeout = 0")  # never wait on the reactor thread
        cursor = conn.cursor()
        try:
            result = self._interaction_txn(cursor, box, desc, func, args, kwargs, True, one_statement)
            conn.commit()
        except Exception as exc:
            try:
                conn.rollback()
            except Exception:  # a broken connection: open a new one next time
                self._close_reader()
            if not self.engine.is_transient(exc):
                return fail()
            if box:
                box.pop()._fire(committed=False)
            return self._pool.runInteraction(self._interaction_txn, box, desc, func, args, kwargs, True,
                                             one_statement)
        finally:
            cursor.close()
        return succeed(result)

    def _close_reader(self) -> None:
        conn, self._reader = self._reader, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # already broken
                pass

    def run_autocommit(self, desc: str, func: Callable[..., Any], *args: Any,
                       idempotent: bool = False, **kwargs: Any) -> Deferred[Any]:
        """Like :meth:`run_interaction`, but each statement commits on its own.

        For statements that must not run inside a transaction, or whose effect
        must be visible at once whatever follows (PostgreSQL ``nextval`` ahead
        of a writing transaction, ``VACUUM``, ``CREATE DATABASE``). Nothing is
        rolled back when ``func`` raises; the exception callbacks still run.
        """
        def attempt(box: list[Txn]) -> Deferred[Any]:
            return self._pool.runWithConnection(self._autocommit_txn, box, desc, func, args, kwargs)

        return Deferred.fromCoroutine(self._run(desc, attempt, idempotent))

    def stats(self) -> dict[str, tuple[int, float]]:
        """Calls and total wall-clock seconds (including retries) per ``desc``."""
        return {desc: (int(v[0]), v[1]) for desc, v in self._stats.items()}

    def close(self) -> Deferred[None]:
        """Refuse new work, wait for in-flight interactions, then stop the pool.

        Interactions waiting to retry fail with their last error.
        """
        if self._closed:
            return succeed(None)
        self._closed = True
        for sleep in list(self._sleeps):
            sleep.cancel()
        done: Deferred[None] = Deferred()
        if self._in_flight:
            self._idle_waiters.append(done)
        else:
            done.callback(None)

        def stop(_: None) -> None:
            self._close_reader()
            self._pool.close()

        return done.addCallback(stop)

    # -- on a pool thread

    def _interaction_txn(self, cursor: Any, box: list[Txn], desc: str, func: Callable[..., Any],
                         args: tuple[Any, ...], kwargs: dict[str, Any], read_only: bool = False,
                         one_statement: bool = False) -> Any:
        txn = _OneStatementTxn(cursor, self.engine, desc) if one_statement else Txn(cursor, self.engine, desc)
        box.append(txn)
        self.engine.begin_txn(cursor, read_only)
        return _check_sync(func, func(txn, *args, **kwargs))

    def _explicit_txn(self, conn: Any, box: list[Txn], desc: str, func: Callable[..., Any],
                      args: tuple[Any, ...], kwargs: dict[str, Any], read_only: bool) -> Any:
        """A PostgreSQL transaction whose ``BEGIN`` and ``COMMIT`` ride on its first and last statements.

        psycopg2 sends ``BEGIN`` before a transaction's first statement and
        ``COMMIT`` after its last, a round trip each. Here the connection is
        in autocommit mode (set so on connect) and the Txn opens the
        transaction itself: ``BEGIN;`` goes out in front of its first
        statement, and its deferred writes (:meth:`Txn.flush_writes`) and
        ``COMMIT`` together at the end (a message's persist transaction: 3
        round trips, where sending each write, ``BEGIN`` and ``COMMIT`` on its
        own made 7). If
        ``func`` or a statement fails, the transaction is rolled back here,
        before adbapi's rollback (a no-op in autocommit mode).
        """
        with self._autocommit_cursor(conn) as cursor:
            txn = Txn(cursor, self.engine, desc, defer_writes=not read_only, begin=True)
            box.append(txn)
            try:
                result = _check_sync(func, func(txn, *args, **kwargs))
                txn._commit()
                return result
            except BaseException:
                self.engine.rollback_open(conn, cursor)
                raise

    def _autocommit_txn(self, conn: Any, box: list[Txn], desc: str, func: Callable[..., Any],
                        args: tuple[Any, ...], kwargs: dict[str, Any], one_statement: bool = False) -> Any:
        with self._autocommit_cursor(conn) as cursor:
            txn = _OneStatementTxn(cursor, self.engine, desc) if one_statement else Txn(cursor, self.engine, desc)
            box.append(txn)
            return _check_sync(func, func(txn, *args, **kwargs))

    @contextlib.contextmanager
    def _autocommit_cursor(self, conn: Any) -> Iterator[Any]:
        """A cursor on ``conn`` (in autocommit mode: SQLite's are opened so, PostgreSQL's set so on connect),
        closed afterwards."""
        cursor = conn.cursor()
        try:
            yield cursor
        finally:
            try:
                cursor.close()
            except Exception:  # the connection is gone; adbapi's rollback replaces it
                pass

    # -- on the reactor thread

    async def _run(self, desc: str, attempt: Callable[[list[Txn]], Deferred[Any]],
                   idempotent: bool) -> Any:
        if self._closed:
            raise StorageError(f"database interaction {desc}: the database pool is closed")
        self._in_flight += 1
        started = time.perf_counter()
        try:
            for n in range(MAX_RETRIES + 1):
                box: list[Txn] = []
                try:
                    result = await attempt(box)
                except Exception as exc:
                    # The Txn is missing only if no connection could be had.
                    if box:
                        box[0]._fire(committed=False)
                    if not (idempotent and n < MAX_RETRIES and self.is_transient(exc)):
                        raise
                    await self._backoff(desc, n, exc)
                    continue
                box[0]._fire(committed=True)
                return result
        finally:
            entry = self._stats.setdefault(desc, [0, 0.0])
            entry[0] += 1
            entry[1] += time.perf_counter() - started
            self._in_flight -= 1
            if not self._in_flight and self._idle_waiters:
                # On the next reactor turn, so the caller sees its result first.
                cast(IReactorTime, self._reactor).callLater(0, self._wake_idle_waiters)

    def _wake_idle_waiters(self) -> None:
        if not self._in_flight:
            waiters, self._idle_waiters = self._idle_waiters, []
            for w in waiters:
                w.callback(None)

    async def _backoff(self, desc: str, n: int, exc: BaseException) -> None:
        delay = RETRY_BACKOFF_S * 2**n
        log.warn(
            "Transient database error in {desc} (attempt {attempt} of {attempts}); "
            "retrying in {delay:.2f}s: {error}",
            desc=desc, attempt=n + 1, attempts=MAX_RETRIES + 1, delay=delay,
            error=f"{type(exc).__name__}: {str(exc).strip()}",
        )
        sleep: Deferred[None] = deferLater(self.clock, delay, lambda: None)
        self._sleeps.add(sleep)
        try:
            await sleep
        except BaseException:
            raise exc from None  # cancelled by close(): surface the real error
        finally:
            self._sleeps.discard(sleep)
        if self._closed:
            raise exc

    def is_transient(self, exc: BaseException) -> bool:
        """Whether an interaction that failed with ``exc`` may succeed if rerun."""
        return isinstance(exc, adbapi.ConnectionLost) or self.engine.is_transient(exc)


def _check_sync(func: Callable[..., Any], result: Any) -> Any:
    if isinstance(result, Deferred) or hasattr(result, "__await__"):
        raise TypeError(f"{func!r} returned {result!r}; _txn functions must be synchronous")
    return result


def create_database(reactor: IReactorCore, config: DatabaseConfig) -> Database:
    """A :class:`Database` for ``config`` whose pool starts with the reactor."""
    return Database(reactor, config)
