"""Shared plumbing of the benchmarks: child processes, services, /proc readings, the machine.

Every benchmark drives separate OS processes (a writer, a hub, readers, a
deployment started through twistd, a load driver) so that its figures are
end to end. Children are Python processes started with :class:`Children`;
they talk back by printing JSON events on stdout, one per line, prefixed with
``@@`` (anything else a child prints is ignored), and :meth:`Child.wait_event`
reads them with a deadline. Everything spawned is killed when the
``Children`` block exits, whatever happened.

Resources outside the process tree (a PostgreSQL database, Redis keys) are
recorded with :func:`note_cleanup` as they are made, so the runner can remove
them even if it had to kill a hung benchmark.
"""

from __future__ import annotations

import json
import os
import platform
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from synflow.tools.workload import quantile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
EVENT_PREFIX = "@@ "
PG_HOST, PG_PORT, PG_USER = "127.0.0.1", 5432, "postgres"
REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379

Progress = Callable[[str], None]


class BenchError(Exception):
    """A benchmark could not produce its figures (the message says why)."""


# -- talking to the parent (used inside children) ------------------------------------------


def emit(event: str, **fields: Any) -> None:
    """Print one event for the parent (inside a child process)."""
    sys.stdout.write(EVENT_PREFIX + json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


# -- children -------------------------------------------------------------------------------


class Child:
    """One child process whose stdout carries ``@@ {json}`` events."""

    def __init__(self, name: str, proc: subprocess.Popen[str], log_path: str, group: bool = False) -> None:
        self.name = name
        self.proc = proc
        self.log_path = log_path
        self.group = group  # leads its own process group: signals go to its whole tree
        self._buf = ""
        self._events: list[dict[str, Any]] = []

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _pump(self, timeout: float) -> None:
        out = self.proc.stdout
        assert out is not None
        ready, _, _ = select.select([out], [], [], max(0.0, timeout))
        if not ready:
            return
        chunk = os.read(out.fileno(), 65536).decode("utf-8", "replace")
        if not chunk:
            if self.proc.poll() is None:
                time.sleep(min(timeout, 0.05))
            return
        self._buf += chunk
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            if line.startswith(EVENT_PREFIX):
                try:
                    self._events.append(json.loads(line[len(EVENT_PREFIX):]))
                except ValueError:
                    pass

    def wait_event(self, kind: str, timeout: float) -> dict[str, Any]:
        """The next event of ``kind`` (earlier events of other kinds stay queued).

        Raises:
            BenchError: the child exited or the deadline passed first.
        """
        deadline = time.monotonic() + timeout
        while True:
            for i, ev in enumerate(self._events):
                if ev.get("event") == kind:
                    return self._events.pop(i)
            if self.proc.poll() is not None:
                self._pump(0)  # whatever it printed before exiting
                if any(ev.get("event") == kind for ev in self._events):
                    continue
                errors = "".join(str(e.get("traceback", e)) for e in self._events if e.get("event") == "error")
                raise BenchError(f"{self.name} exited with {self.proc.returncode} before '{kind}':\n"
                                 f"{errors}{self.tail()}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(f"{self.name} sent no '{kind}' within {timeout:.0f}s:\n{self.tail()}")
            self._pump(min(left, 0.5))

    def poll(self, timeout: float) -> None:
        """Read whatever the child printed, waiting at most ``timeout`` seconds."""
        self._pump(timeout)

    def events(self, kind: str) -> list[dict[str, Any]]:
        """Every queued event of ``kind`` so far (without waiting)."""
        self._pump(0)
        got = [e for e in self._events if e.get("event") == kind]
        self._events = [e for e in self._events if e.get("event") != kind]
        return got

    def tail(self, chars: int = 3000) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return "(no log)"

    def signal(self, sig: int) -> None:
        try:
            if self.group:
                os.killpg(self.pid, sig)
            elif self.alive():
                os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM (after SIGCONT, for a stopped one), then SIGKILL after ``timeout``; returns the exit code."""
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait(5)
        if self.group:
            self.signal(signal.SIGKILL)  # whatever of its tree is left
        return self.proc.returncode


class Children:
    """Spawns children and kills every one of them when the block exits."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.children: list[Child] = []
        os.makedirs(workdir, exist_ok=True)

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop_all()

    def spawn(self, name: str, argv: list[str], *, cwd: str | None = None,
              env: dict[str, str] | None = None, group: bool = False, stderr_to_log: bool = True) -> Child:
        """Start ``argv`` with stdout piped for events and stderr to ``<workdir>/<name>.log``.

        With ``group`` the child leads a new process group (its whole tree is
        signalled and killed together); without ``stderr_to_log`` its stderr
        is ours (progress lines reach the terminal).
        """
        log_path = os.path.join(self.workdir, f"{name}.log")
        log = open(log_path, "ab")
        full_env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
        full_env.update(env or {})
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log if stderr_to_log else None,
                                stdin=subprocess.DEVNULL, cwd=cwd or self.workdir, env=full_env, text=True,
                                start_new_session=group)
        log.close()
        if group:  # outside the runner's process group: killed by the runner's cleanup if this process dies
            note_cleanup("process_group", str(proc.pid))
        child = Child(name, proc, log_path, group)
        self.children.append(child)
        return child

    def python(self, name: str, module: str, *args: Any, **kwargs: Any) -> Child:
        """Start ``python -m module args...``."""
        return self.spawn(name, [sys.executable, "-u", "-m", module, *map(str, args)], **kwargs)

    def stop_all(self) -> None:
        for child in reversed(self.children):
            if child.alive():
                child.signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
                child.signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for child in self.children:
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.signal(signal.SIGKILL)
                child.proc.wait(5)
            if child.group:
                child.signal(signal.SIGKILL)
                note_cleanup("process_group_done", str(child.pid))  # its ID may be reused from now on
            if child.proc.stdout is not None:
                child.proc.stdout.close()


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float, child: Child | None = None) -> None:
    """Wait until something accepts connections on 127.0.0.1:``port``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child is not None and not child.alive():
            raise BenchError(f"{child.name} exited with {child.proc.returncode}:\n{child.tail()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise BenchError(f"nothing listened on port {port} within {timeout:.0f}s"
                     + (f":\n{child.tail()}" if child else ""))


# -- /proc -----------------------------------------------------------------------------------

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float | None:
    """VmRSS of a process in MiB (None if it is gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (0 if it is gone)."""
    return stat_cpu_seconds(f"/proc/{pid}/stat")


def stat_cpu_seconds(path: str) -> float:
    """User + system CPU seconds of a ``/proc`` ``stat`` file (a process's, or a thread's under ``task/``); 0 if gone."""
    try:
        with open(path, encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK
    except (OSError, IndexError, ValueError):
        return 0.0


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine since boot, from /proc/stat."""
    with open("/proc/stat", encoding="ascii") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    return float(sum(parts) - idle), float(sum(parts))


def pids_named(fragment: str) -> list[int]:
    """PIDs whose command line contains ``fragment``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if fragment.encode() in f.read():
                        out.append(int(entry))
            except OSError:
                continue
    return out


# -- cleanup records -------------------------------------------------------------------------


def note_cleanup(kind: str, value: str) -> None:
    """Record a resource outside the process tree for the runner to remove if we die."""
    path = os.environ.get("SYNFLOW_BENCH_CLEANUP")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"kind": kind, "value": value}) + "\n")


def run_cleanups(path: str) -> list[str]:
    """Remove every resource recorded in ``path``; returns what was done."""
    done: list[str] = []
    if not os.path.exists(path):
        return done
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    gone = {rec["value"] for rec in records if rec["kind"] == "process_group_done"}
    for rec in records:
        if rec["kind"] == "process_group_done" or (rec["kind"] == "process_group" and rec["value"] in gone):
            continue
        try:
            if rec["kind"] == "pg_db":
                drop_database(rec["value"])
            elif rec["kind"] == "redis_prefix":
                redis_delete_prefix(rec["value"])
            elif rec["kind"] == "process_group":
                if not _kill_group(int(rec["value"])):
                    continue  # long gone: nothing was done
            done.append(f"{rec['kind']} {rec['value']}")
        except Exception as e:  # best effort: report and go on
            done.append(f"{rec['kind']} {rec['value']}: {e}")
    os.unlink(path)
    return done


def _kill_group(pgid: int) -> bool:
    """SIGKILL process group ``pgid`` if it still exists; whether it did."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


# -- PostgreSQL and Redis -----------------------------------------------------------------------


def pg_connect(dbname: str = "postgres") -> Any:
    import psycopg2

    conn = psycopg2.connect(host=PG_HOST, port=PG_PORT, user=PG_USER, dbname=dbname)
    conn.autocommit = True
    return conn


def create_database(prefix: str = "synflow_bench") -> str:
    """A fresh uniquely named database (recorded for cleanup)."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    note_cleanup("pg_db", name)
    conn = pg_connect()
    try:
        conn.cursor().execute(f'CREATE DATABASE "{name}"')
    finally:
        conn.close()
    return name


def drop_database(name: str) -> None:
    conn = pg_connect()
    try:
        cur = conn.cursor()
        cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s "
                    "AND pid <> pg_backend_pid()", (name,))
        cur.execute(f'DROP DATABASE IF EXISTS "{name}"')
    finally:
        conn.close()


def pg_backend_pids(dbname: str) -> list[int]:
    conn = pg_connect()
    try:
        cur = conn.cursor()
        cur.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s", (dbname,))
        return [int(r[0]) for r in cur.fetchall()]
    finally:
        conn.close()


def redis_prefix() -> str:
    """A unique channel/key prefix (recorded for cleanup)."""
    prefix = f"synflow-bench-{uuid.uuid4().hex[:10]}"
    note_cleanup("redis_prefix", prefix)
    return prefix


def redis_delete_prefix(prefix: str) -> int:
    """Delete every Redis key starting with ``prefix``; returns how many."""
    cli = shutil.which("redis-cli")
    if cli is None:
        return 0
    keys = subprocess.run([cli, "-h", REDIS_HOST, "-p", str(REDIS_PORT), "--scan", "--pattern", f"{prefix}*"],
                          capture_output=True, text=True, timeout=30).stdout.split()
    for i in range(0, len(keys), 500):
        subprocess.run([cli, "-h", REDIS_HOST, "-p", str(REDIS_PORT), "DEL", *keys[i:i + 500]],
                       capture_output=True, timeout=30)
    return len(keys)


def service_versions() -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        conn = pg_connect()
        cur = conn.cursor()
        cur.execute("SHOW server_version")
        out["postgresql"] = str(cur.fetchone()[0]).split()[0]
        conn.close()
    except Exception as e:
        out["postgresql"] = f"unavailable ({type(e).__name__})"
    try:
        info = subprocess.run(["redis-cli", "-h", REDIS_HOST, "-p", str(REDIS_PORT), "INFO", "server"],
                              capture_output=True, text=True, timeout=10).stdout
        out["redis"] = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                             if ln.startswith("redis_version:")), "unavailable")
    except Exception as e:
        out["redis"] = f"unavailable ({type(e).__name__})"
    try:
        java = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=20).stderr
        out["java"] = java.splitlines()[0] if java else "unavailable"
    except Exception:
        out["java"] = "unavailable"
    return out


def machine_info() -> dict[str, Any]:
    """CPU model, cores, RAM, OS, Python and service versions, load average."""
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    ram_gb = 0.0
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            ram_gb = int(next(ln for ln in f if ln.startswith("MemTotal")).split()[1]) / 1024 / 1024
    except (OSError, StopIteration):
        pass
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gb": round(ram_gb, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg_at_start": os.getloadavg()[0],
    }
    info.update(service_versions())
    try:
        import twisted

        info["twisted"] = twisted.__version__
    except ImportError:
        pass
    return info


# -- numbers -----------------------------------------------------------------------------------


def percentile(values: Iterable[float], q: float) -> float:
    return quantile(values, q)


def median(values: Iterable[float]) -> float:
    vals = [v for v in values if v is not None]
    return float(statistics.median(vals)) if vals else float("nan")


def ts() -> str:
    return time.strftime("%H:%M:%S")
