"""Create the PostgreSQL database on the master's first start, when the role may.

synflow needs a UTF-8 database with the ``C`` collation (byte order: stream
and room ordering must not depend on a locale). The master checks for its
database through the ``postgres`` maintenance database and, when it is
missing, creates it if its role has ``CREATEDB`` (or is a superuser);
otherwise start-up stops with one line giving the exact ``createdb`` command
an administrator runs. Internal: the master's bootstrap calls it.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import shlex
from typing import Any

from twisted.logger import Logger

from synflow.errors import StorageError
from synflow.storage.engines import DatabaseConfig, get_engine

log = Logger()

__all__ = ["createdb_command", "ensure_database_txn"]

#: The database every PostgreSQL server has, used to look for and create ours.
MAINTENANCE_DB = "postgres"


def createdb_command(config: DatabaseConfig) -> str:
    """The ``createdb`` command line that makes the database synflow expects."""
    args = ["createdb", "--host", config.host, "--port", str(config.port), "--username", config.user,
            "--template", "template0", "--encoding", "UTF8", "--lc-collate", "C", "--lc-ctype", "C",
            "--owner", config.user, config.dbname]
    return shlex.join(args)


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def ensure_database_txn(config: DatabaseConfig) -> bool:
    """Create ``config.dbname`` if it is missing (blocking: run it in a thread).

    Returns:
        True if the database was created now, False if it was already there.

    Raises:
        StorageError: the database is missing and this role may not create
            it (the message gives the ``createdb`` command), or the server
            cannot be reached.
    """
    import psycopg2

    _, kwargs = get_engine("postgres").connect_args(config)
    kwargs["dbname"] = MAINTENANCE_DB
    try:
        conn: Any = psycopg2.connect(**kwargs)
    except psycopg2.Error as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StorageError(f"cannot reach PostgreSQL at {config.host}:{config.port} to check for database "
                           f"{config.dbname!r}: {first}") from None
    try:
        conn.autocommit = True
        cur = conn.cursor()
        cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (config.dbname,))
        if cur.fetchone() is not None:
            return False
        cur.execute("SELECT rolcreatedb OR rolsuper FROM pg_roles WHERE rolname = current_user")
        row = cur.fetchone()
        if not (row and row[0]):
            raise StorageError(f"database {config.dbname!r} does not exist and role {config.user!r} may not create it; "
                               f"create it with: {createdb_command(config)}")
        try:
            cur.execute(f"CREATE DATABASE {_quote_ident(config.dbname)} TEMPLATE template0 "
                        "ENCODING 'UTF8' LC_COLLATE 'C' LC_CTYPE 'C'")
        except psycopg2.errors.DuplicateDatabase:
            return False  # another master created it meanwhile
        except psycopg2.Error as e:
            raise StorageError(f"could not create database {config.dbname!r} ({str(e).strip()}); "
                               f"create it with: {createdb_command(config)}") from None
        log.info("created PostgreSQL database {dbname!r} (UTF8, C collation)", dbname=config.dbname)
        return True
    finally:
        conn.close()
