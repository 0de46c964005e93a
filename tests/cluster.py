"""Real-process deployments for integration tests.

:class:`Cluster` writes a deployment's config files into a temporary
directory (SQLite or a fresh PostgreSQL database; TCP hub or Redis with its
own channel prefix; every port on loopback, picked free), starts the master
with ``twistd -n synflow`` and other processes as subprocesses, and kills
whatever is left in cleanup. A :class:`DroppingProxy` sits between a process
and the hub when a test needs to cut connections. :meth:`Cluster.metrics`,
:meth:`Cluster.healthy` and :meth:`Cluster.rss_kib` read a running process's
``/metrics``, ``/health`` and resident memory; :meth:`Cluster.all_output`
returns everything the processes wrote, for checks that no secret leaked.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import yaml
from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred, inlineCallbacks
from twisted.internet.task import deferLater
from twisted.protocols.portforward import ProxyFactory, ProxyServer

from synflow.tools.deploy import free_port
from tests import services

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PYTHON = sys.executable
TWISTD = os.path.join(os.path.dirname(sys.executable), "twistd")




def sleep(seconds: float):
    return deferLater(reactor, seconds, lambda: None)


def _polling(predicate: Callable[[], Any], timeout: float, what: str, pause: Callable[[], Any]) -> Any:
    """Call ``predicate`` until it is truthy (its value is the generator's return), yielding ``pause()``
    between calls; fail after ``timeout``. :func:`wait_until` and :func:`poll_until` drive it."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        yield pause()


@inlineCallbacks
def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1):
    """Poll ``predicate`` on the reactor until it is truthy; fail after ``timeout``."""
    return (yield from _polling(predicate, timeout, what, lambda: sleep(interval)))


def poll_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """:func:`wait_until` for a test without a running reactor: block, polling ``predicate``."""
    polling = _polling(predicate, timeout, what, lambda: time.sleep(interval))
    try:
        while True:
            next(polling)
    except StopIteration as done:
        return done.value


@inlineCallbacks
def single_master(testcase: Any, extra_yaml: str = "", server_name: str = "api.test",
                  resources: tuple[str, ...] = ("client", "federation")):
    """An in-process master on SQLite that persists its own events, with one listener on a free port serving
    ``resources`` (the client API and federation); returns ``(service, base_url)`` (the URL of that listener)."""
    from synflow.app.build import build_service
    from synflow.config import load_config

    base = os.path.abspath(testcase.mktemp())
    os.makedirs(base)
    path = os.path.join(base, "master.yaml")
    with open(path, "w") as f:
        f.write(
            f"server_name: {server_name}\napp: master\ninstance_name: master\n"
            f"data_dir: {base}/var\naudit: {{dir: {base}/var/audit}}\n"
            "instance_map: {master: {host: 127.0.0.1, port: 0}}\nstream_writers: {events: [master]}\n"
            "replication: {hub: {host: 127.0.0.1, port: 0}}\n"
            f"listeners: [{{resources: [{', '.join(resources)}], endpoint: 'tcp:0:interface=127.0.0.1'}}]\n" + extra_yaml
        )
    master = build_service(load_config([path]), reactor, exit_on_failure=False)
    master.startService()
    testcase.addCleanup(master.stopService)
    yield master.ready
    listener = master.listeners[resources[0]]
    yield listener.when_listening()
    return master, f"http://127.0.0.1:{listener.bound_port}"


@inlineCallbacks
def single_master_with_user(testcase: Any, username: str = "alice"):
    """:func:`single_master` plus one registered user; returns ``(service, client)``.

    The client's connection pool is closed when the test ends."""
    from synflow.tools.client import Client, new_pool

    master, url = yield single_master(testcase)
    pool = new_pool()
    testcase.addCleanup(pool.closeCachedConnections)
    client = yield ensureDeferred(Client(url, pool).register(username))
    return master, client


def scrape_metrics(port: int, timeout: float = 5.0) -> dict[str, float]:
    """The samples of the ``/metrics`` page on a loopback port, keyed ``name{label="v",...}``.

    Labels are sorted by name, so ``synflow_replication_stream_position{instance="p1",stream="events"}``
    finds one writer's position; a sample without labels is keyed by its bare name.
    """
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as response:
        text = response.read().decode("utf-8")
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    # One read, then split: iterating a file that is still being appended to could
    # return a partly written last line and then, once the writer finishes it, its
    # remainder as a line of its own. Only whole lines (ending in a newline) count.
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return [json.loads(line) for line in text.split("\n")[:-1] if line]


class Cluster:
    """A deployment directory plus the processes running from it.

    Args:
        testcase: the trial test (for mktemp and cleanups).
        engine: ``sqlite`` or ``postgres``.
        transport: ``tcp`` or ``redis``.
        writers: the event persisters (``stream_writers.events``).
        server_name: the deployment's server name.
        extra_instances: further processes in ``instance_map`` (federation senders, ...).
        shared: merged into ``shared.yaml`` (nested dicts merge key by key).
        secret: when given, ``replication.secret`` (internal RPC and the hub then require it).
    """

    def __init__(self, testcase: Any, *, engine: str = "sqlite", transport: str = "tcp",
                 writers: tuple[str, ...] = ("persister1", "persister2"), server_name: str = "test.local",
                 extra_instances: tuple[str, ...] = (), shared: dict | None = None,
                 secret: str | None = None) -> None:
        self.testcase = testcase
        self.killed_at: dict[str, list[int]] = {}
        self.dir = os.path.abspath(testcase.mktemp())
        os.makedirs(self.dir)
        self.engine = engine
        self.transport = transport
        self.server_name = server_name
        self.writers = writers
        self.procs: dict[str, subprocess.Popen] = {}
        self.hub_port = free_port()
        instances = {"master": free_port()}
        for name in (*writers, *extra_instances):
            instances[name] = free_port()
        self.instance_ports = instances
        database: dict[str, Any]
        if engine == "postgres":
            self.dbname = services.create_pg_database()
            testcase.addCleanup(services.drop_pg_database, self.dbname)
            database = {"engine": "postgres", "host": services.PG_HOST, "port": services.PG_PORT,
                        "user": services.PG_USER, "dbname": self.dbname}
        else:
            database = {"engine": "sqlite", "path": os.path.join(self.dir, "var", "synflow.db")}
        replication: dict[str, Any] = {"transport": transport, "hub": {"host": "127.0.0.1", "port": self.hub_port},
                                       "idle_announce_interval_s": 0.2}
        if secret is not None:
            replication["secret"] = secret
        if transport == "redis":
            services.require_redis()
            replication["redis"] = {"host": services.REDIS_HOST, "port": services.REDIS_PORT,
                                    "channel_prefix": services.redis_prefix()}
        self.shared = {
            "server_name": server_name,
            "data_dir": os.path.join(self.dir, "var"),
            "database": database,
            "replication": replication,
            "instance_map": {n: {"host": "127.0.0.1", "port": p} for n, p in instances.items()},
            "stream_writers": {"events": list(writers)},
            "audit": {"dir": os.path.join(self.dir, "var", "audit")},
        }
        if shared:
            deep_update(self.shared, shared)
        os.makedirs(self.shared["data_dir"], exist_ok=True)
        self.shared_path = self.write("shared.yaml", self.shared)
        testcase.addCleanup(self.kill_all)

    def query(self, sql: str, args: tuple = ()) -> list[tuple]:
        """Run one read query against the deployment's database (``?`` placeholders)."""
        if self.engine == "postgres":
            conn = services.pg_connect(self.dbname)
            try:
                cur = conn.cursor()
                cur.execute(sql.replace("?", "%s"), args)
                return [tuple(r) for r in cur.fetchall()]
            finally:
                conn.close()
        import sqlite3

        conn = sqlite3.connect(self.shared["database"]["path"])
        try:
            return [tuple(r) for r in conn.execute(sql, args).fetchall()]
        finally:
            conn.close()

    def write(self, name: str, data: dict) -> str:
        path = os.path.join(self.dir, name)
        with open(path, "w", encoding="utf-8") as f:
            yaml.safe_dump(data, f)
        return path

    def process_config(self, name: str, app: str, **extra: Any) -> str:
        data = {"app": app, "instance_name": name, "log_file": self.log_path(name)}
        data.update(extra)
        return self.write(f"{name}.yaml", data)

    def log_path(self, name: str) -> str:
        return os.path.join(self.dir, f"{name}.log")

    def out_path(self, name: str) -> str:
        return os.path.join(self.dir, f"{name}.out.jsonl")

    # -- processes -------------------------------------------------------------------

    def start_twistd(self, name: str, app: str, *configs: str, **extra: Any) -> subprocess.Popen:
        """Start ``twistd -n synflow`` for one process of this deployment."""
        own = self.process_config(name, app, **extra)
        cmd = [TWISTD, "-n", "--pidfile", os.path.join(self.dir, f"{name}.pid"), "--logfile",
               self.log_path(name), "synflow", "--config", self.shared_path, "--config", own]
        for c in configs:
            cmd += ["--config", c]
        return self._spawn(name, cmd)

    def start_script(self, name: str, app: str, script: str, *args: str, configs: tuple[str, ...] = (),
                     **extra: Any) -> subprocess.Popen:
        """Start a test harness script as a process of this deployment."""
        own = self.process_config(name, app, **extra)
        cmd = [PYTHON, os.path.join(ROOT, script), "--config", self.shared_path, "--config", own]
        for c in configs:
            cmd += ["--config", c]
        return self._spawn(name, cmd + list(args))

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        stderr = open(os.path.join(self.dir, f"{name}.stderr"), "ab")
        env = dict(os.environ, PYTHONPATH=ROOT)
        proc = subprocess.Popen(cmd, cwd=self.dir, stdout=stderr, stderr=stderr, env=env)
        self.procs[name] = proc
        return proc

    def stderr_of(self, name: str) -> str:
        path = os.path.join(self.dir, f"{name}.stderr")
        if not os.path.exists(path):
            return ""
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()[-4000:]

    def log_tail(self, name: str, chars: int = 4000) -> str:
        path = self.log_path(name)
        if not os.path.exists(path):
            return self.stderr_of(name)
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()[-chars:] + self.stderr_of(name)

    def all_output(self) -> dict[str, str]:
        """Every file the processes wrote to (logs and captured stdout/stderr), whole, by file name."""
        out: dict[str, str] = {}
        for entry in sorted(os.listdir(self.dir)):
            if entry.endswith((".log", ".stderr")) or ".log." in entry:
                with open(os.path.join(self.dir, entry), encoding="utf-8", errors="replace") as f:
                    out[entry] = f.read()
        return out

    def metrics(self, name: str) -> dict[str, float]:
        """``name``'s ``/metrics`` samples, read from its internal listener (see :func:`scrape_metrics`)."""
        return scrape_metrics(self.instance_ports[name])

    def healthy(self, name: str) -> bool:
        """Whether ``name``'s ``/health`` answers 200 (started, replication and database connected)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.instance_ports[name]}/health", timeout=2) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def rss_kib(self, name: str) -> int:
        """``name``'s resident set size in KiB (from ``/proc``)."""
        with open(f"/proc/{self.procs[name].pid}/status", encoding="ascii") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

    def check_alive(self, *names: str) -> None:
        for name in names or tuple(self.procs):
            proc = self.procs[name]
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")

    @inlineCallbacks
    def wait_for_port(self, port: int, name: str, timeout: float = 60):
        def up():
            self.check_alive(name)
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return True
            except OSError:
                return False

        yield wait_until(up, timeout, f"{name} to listen on {port}")

    @inlineCallbacks
    def start_master(self, **extra: Any):
        """Start the master and wait until its hub (or internal listener) answers."""
        # The log file is appended to across restarts: look only at what this start writes.
        path = self.log_path("master")
        offset = os.path.getsize(path) if os.path.exists(path) else 0
        self.start_twistd("master", "master", **extra)
        if self.transport == "tcp":
            yield self.wait_for_port(self.hub_port, "master")
        else:
            yield wait_until(lambda: self._log_has("master", "started", offset), 60, "master to start")

    def _log_has(self, name: str, text: str, offset: int = 0) -> bool:
        self.check_alive(name)
        path = self.log_path(name)
        if not os.path.exists(path):
            return False
        with open(path, encoding="utf-8", errors="replace") as f:
            f.seek(offset)
            return text in f.read()

    def signal(self, name: str, sig: int) -> None:
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)

    @inlineCallbacks
    def stop(self, name: str, timeout: float = 20):
        """SIGTERM one process and wait for it to exit."""
        proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            return proc.returncode if proc else None
        proc.send_signal(signal.SIGTERM)
        yield wait_until(lambda: proc.poll() is not None, timeout, f"{name} to stop")
        return proc.returncode

    def kill(self, name: str) -> None:
        """SIGKILL ``name``; the wall time of each kill is kept in ``killed_at[name]`` (µs)."""
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is None:
            self.killed_at.setdefault(name, []).append(int(time.time() * 1_000_000))
            proc.kill()
            proc.wait(10)

    def kill_all(self) -> None:
        for name in list(self.procs):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def deep_update(into: dict, data: dict) -> None:
    """Merge ``data`` into ``into``, recursing into nested dicts (later values win)."""
    for k, v in data.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            deep_update(into[k], v)
        else:
            into[k] = v


class _TrackedProxy(ProxyServer):
    def connectionMade(self):
        self.factory.live.add(self)
        super().connectionMade()

    def connectionLost(self, reason):
        self.factory.live.discard(self)
        super().connectionLost(reason)


class DroppingProxy(ProxyFactory):
    """A TCP forwarder to the hub whose connections a test can cut at will."""

    protocol = _TrackedProxy

    def __init__(self, host: str, port: int) -> None:
        super().__init__(host, port)
        self.live: set[_TrackedProxy] = set()
        self.listening = None

    def listen(self) -> int:
        self.listening = reactor.listenTCP(0, self, interface="127.0.0.1")
        return self.listening.getHost().port

    def drop_all(self) -> int:
        """Abort every proxied connection; returns how many were cut."""
        live = list(self.live)
        for proto in live:
            proto.transport.abortConnection()
            if proto.peer is not None:
                proto.peer.transport.abortConnection()
        return len(live)

    def close(self):
        self.drop_all()
        if self.listening is not None:
            return self.listening.stopListening()
        return None
