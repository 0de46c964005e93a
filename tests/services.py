"""Access to the real services the integration tests need.

Each ``require_*`` function makes sure a service is reachable, starting it
with the machine's standard command when it is installed but down. When the
service cannot be had, the test is skipped with the reason -- except under
``CI=true``, where a missing service is a failure: nothing that needs
PostgreSQL, Redis or Spark may skip in CI.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from twisted.trial.unittest import SkipTest

PG_HOST = os.environ.get("SYNFLOW_TEST_PG_HOST", "127.0.0.1")
PG_PORT = int(os.environ.get("SYNFLOW_TEST_PG_PORT", "5432"))
PG_USER = os.environ.get("SYNFLOW_TEST_PG_USER", "postgres")
REDIS_HOST = os.environ.get("SYNFLOW_TEST_REDIS_HOST", "127.0.0.1")
REDIS_PORT = int(os.environ.get("SYNFLOW_TEST_REDIS_PORT", "6379"))

REDIS_START = [
    "redis-server", "--daemonize", "yes", "--bind", "127.0.0.1", "-::1",
    "--port", "6379", "--save", "", "--appendonly", "no",
    "--dir", "/var/lib/redis", "--logfile", "/var/log/redis/ci.log",
]


def in_ci() -> bool:
    """True when running under CI, where service-backed tests must not skip."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def unavailable(reason: str) -> SkipTest:
    """Skip the calling test for ``reason``, or fail it under CI.

    Raises:
        SkipTest: outside CI.
        AssertionError: under ``CI=true``.
    """
    if in_ci():
        raise AssertionError(f"CI=true and a required service is unavailable: {reason}")
    raise SkipTest(reason)


def _port_open(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _wait_port(host: str, port: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _port_open(host, port):
            return True
        time.sleep(0.2)
    return False


def start_postgres() -> None:
    """Start the machine's PostgreSQL cluster if it is installed and down."""
    versions = sorted(os.listdir("/etc/postgresql")) if os.path.isdir("/etc/postgresql") else []
    if not versions or not shutil.which("pg_ctlcluster"):
        return
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", versions[-1], "main", "start"],
        check=False, capture_output=True, timeout=60,
    )


def start_redis() -> None:
    """Start the machine's Redis server if it is installed and down."""
    if not shutil.which("redis-server"):
        return
    os.makedirs("/var/lib/redis", exist_ok=True)
    os.makedirs("/var/log/redis", exist_ok=True)
    subprocess.run(REDIS_START, check=False, capture_output=True, timeout=30)


def require_postgres() -> None:
    """Make sure PostgreSQL answers on its port, or skip (fail under CI)."""
    if _port_open(PG_HOST, PG_PORT):
        return
    start_postgres()
    if not _wait_port(PG_HOST, PG_PORT, 20):
        unavailable(f"PostgreSQL is not reachable at {PG_HOST}:{PG_PORT} and could not be started")


def require_redis() -> None:
    """Make sure Redis answers PING, or skip (fail under CI)."""
    if not _port_open(REDIS_HOST, REDIS_PORT):
        start_redis()
        if not _wait_port(REDIS_HOST, REDIS_PORT, 20):
            unavailable(f"Redis is not reachable at {REDIS_HOST}:{REDIS_PORT} and could not be started")


def require_java() -> None:
    """Make sure a Java runtime for Spark is on the PATH, or skip (fail under CI)."""
    if not shutil.which("java"):
        unavailable("Spark needs Java 17+, and no `java` is on the PATH: apt-get install openjdk-17-jre-headless")
    try:
        import pyspark  # noqa: F401
    except ImportError:
        unavailable("pyspark is not installed (install the project with its `test` extra)")


def pg_connect(dbname: str = "postgres"):
    """Open an autocommit psycopg2 connection to the test server."""
    import psycopg2

    conn = psycopg2.connect(host=PG_HOST, port=PG_PORT, user=PG_USER, dbname=dbname)
    conn.autocommit = True
    return conn


def create_pg_database(prefix: str = "synflow_test") -> str:
    """Create a fresh, uniquely named database and return its name."""
    require_postgres()
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    conn = pg_connect()
    try:
        conn.cursor().execute(f'CREATE DATABASE "{name}"')
    finally:
        conn.close()
    return name


def drop_pg_database(name: str) -> None:
    """Drop a database made by :func:`create_pg_database`, closing its sessions."""
    conn = pg_connect()
    try:
        cur = conn.cursor()
        cur.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            (name,),
        )
        cur.execute(f'DROP DATABASE IF EXISTS "{name}"')
    finally:
        conn.close()


@contextmanager
def pg_database(prefix: str = "synflow_test") -> Iterator[str]:
    """A context manager yielding a fresh database name, dropped on exit."""
    name = create_pg_database(prefix)
    try:
        yield name
    finally:
        drop_pg_database(name)


def redis_prefix() -> str:
    """A unique channel/key prefix so tests never see each other's traffic."""
    return f"synflow-test-{uuid.uuid4().hex[:10]}"


def leftover_test_databases() -> list[str]:
    """Names of databases left behind by crashed test runs (for cleanup scripts)."""
    conn = pg_connect()
    try:
        cur = conn.cursor()
        cur.execute("SELECT datname FROM pg_database WHERE datname LIKE 'synflow_test_%'")
        return [r[0] for r in cur.fetchall()]
    finally:
        conn.close()


def java_home() -> str | None:
    """The JAVA_HOME of the newest installed JDK, if one is found."""
    candidates = sorted(glob.glob("/usr/lib/jvm/java-*-openjdk-*"))
    return candidates[-1] if candidates else None


class PrivateRedis:
    """A redis-server of the test's own, on a loopback port, that the test may stop and restart.

    ``start()`` launches it (again on the same port after ``stop()``); ``up()`` tells whether it
    accepts connections, for polling with ``tests.cluster.wait_until``. Nothing is kept on disk.
    The server is stopped by the cleanup the constructor registers.

    Args:
        testcase: the trial test (for mktemp and cleanups).
        port: the port to listen on.
        args: further ``redis-server`` arguments (e.g. ``["--requirepass", "s3cret"]``).
        tls: listen for TLS only, on ``port`` (``--port 0 --tls-port <port>``); ``args`` must
            carry the ``--tls-cert-file``, ``--tls-key-file`` and ``--tls-ca-cert-file``.
    """

    def __init__(self, testcase, port: int, args: tuple[str, ...] = (), tls: bool = False) -> None:
        require_redis()
        if not shutil.which("redis-server"):
            unavailable("redis-server is not installed, so the test cannot run a Redis of its own")
        self.port = port
        self.args = args
        self.tls = tls
        self.dir = os.path.abspath(testcase.mktemp())
        os.makedirs(self.dir)
        self.proc: subprocess.Popen | None = None
        testcase.addCleanup(self.stop)

    def start(self) -> None:
        """Start the server (non-blocking; poll ``up()``)."""
        self.proc = subprocess.Popen(
            ["redis-server", *(("--port", "0", "--tls-port") if self.tls else ("--port",)), str(self.port),
             "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir, *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )

    def up(self) -> bool:
        """True when the server accepts connections."""
        return self.proc is not None and self.proc.poll() is None and _port_open("127.0.0.1", self.port, 0.2)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s); every client connection drops."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None


def processes_of(directory: str) -> list[str]:
    """The command lines of the running processes a deployment in ``directory`` started (their pidfiles are under it).

    Raises:
        RuntimeError: ``pgrep`` failed (not "nothing matched"), so an empty answer would prove nothing.
    """
    found = subprocess.run(["pgrep", "-a", "-f", "--", f"--pidfile {os.path.abspath(directory)}/"],
                           capture_output=True, text=True)
    if found.returncode not in (0, 1):
        raise RuntimeError(f"pgrep failed ({found.returncode}): {found.stderr.strip()}")
    return found.stdout.splitlines()
