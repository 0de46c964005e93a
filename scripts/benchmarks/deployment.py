"""A real synflow deployment on PostgreSQL for the persist, audit and latency benchmarks.

:class:`Deployment` writes a deployment's YAML files into a work directory
(as ``tests/cluster.py`` does), creates a fresh PostgreSQL database with a
unique name, and starts every process with ``twistd -n synflow --config
shared.yaml --config <name>.yaml``: the master (hub, migrations, client
listener) and ``persisters`` event persisters, each with its own client
listener, all on loopback ports picked free. Leaving the ``with`` block stops
the processes and drops the database.
"""

from __future__ import annotations

import os
import sys
import urllib.request
from typing import Any

import yaml

from scripts.benchmarks.common import (
    PG_HOST,
    PG_PORT,
    PG_USER,
    Child,
    Children,
    create_database,
    drop_database,
    free_port,
    pg_backend_pids,
    wait_port,
)

TWISTD = os.path.join(os.path.dirname(sys.executable), "twistd")
SERVER_NAME = "bench.local"


class Deployment:
    """Master + N event persisters under twistd, on a fresh PostgreSQL database.

    Args:
        workdir: where configs, logs and audit logs go.
        persisters: how many event persisters.
        events_writers: how many of them are listed in ``stream_writers.events`` (all by default).
        audit: ``audit.enabled``.
        client_on_persisters: give every persister a client listener too.
    """

    def __init__(self, workdir: str, *, persisters: int, audit: bool = True,
                 client_on_persisters: bool = True, events_writers: int | None = None) -> None:
        self.workdir = workdir
        self.writers = [f"persister{i + 1}" for i in range(persisters)]
        #: ``stream_writers.events``: the first ``events_writers`` persisters (all by default); the others
        #: run idle until resharded in.
        self.events_writers = self.writers[:events_writers]
        self.audit = audit
        self.client_on_persisters = client_on_persisters
        self.children = Children(workdir)
        self.dbname = ""
        self.client_ports: dict[str, int] = {}
        #: Each process's internal listener (``instance_map``: internal RPC, ``/health``, ``/metrics``).
        self.internal_ports: dict[str, int] = {}
        self.procs: dict[str, Child] = {}
        self.shared_path = ""

    def __enter__(self) -> Deployment:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def urls(self, *names: str) -> list[str]:
        """Client API base URLs of the named processes (all with a client listener if none named)."""
        names = names or tuple(self.client_ports)
        return [f"http://127.0.0.1:{self.client_ports[n]}" for n in names]

    def start(self) -> None:
        self.dbname = create_database()
        instances = self.internal_ports = {name: free_port() for name in ("master", *self.writers)}
        hub_port = free_port()
        var = os.path.join(self.workdir, "var")
        os.makedirs(var, exist_ok=True)
        shared = {
            "server_name": SERVER_NAME,
            "data_dir": var,
            "database": {"engine": "postgres", "host": PG_HOST, "port": PG_PORT, "user": PG_USER,
                         "dbname": self.dbname},
            "replication": {"transport": "tcp", "hub": {"host": "127.0.0.1", "port": hub_port}},
            "instance_map": {n: {"host": "127.0.0.1", "port": p} for n, p in instances.items()},
            "stream_writers": {"events": self.events_writers},
            "audit": {"enabled": self.audit, "dir": os.path.join(var, "audit")},
        }
        shared_path = self.shared_path = self._write("shared.yaml", shared)
        with_client = ["master", *(self.writers if self.client_on_persisters else [])]
        for name in ("master", *self.writers):
            own: dict[str, Any] = {"app": "master" if name == "master" else "event_persister",
                                   "instance_name": name, "log_file": os.path.join(self.workdir, f"{name}.twistd.log")}
            if name in with_client:
                port = self.client_ports[name] = free_port()
                own["listeners"] = [{"endpoint": f"tcp:{port}:interface=127.0.0.1", "resources": ["client"]}]
            own_path = self._write(f"{name}.yaml", own)
            self.procs[name] = self.children.spawn(
                name, [TWISTD, "-n", "--pidfile", os.path.join(self.workdir, f"{name}.pid"), "--logfile",
                       os.path.join(self.workdir, f"{name}.twistd.log"), "synflow", "--config", shared_path,
                       "--config", own_path])
            if name == "master":
                wait_port(hub_port, 90, self.procs[name])
        for name in with_client:
            wait_port(self.client_ports[name], 90, self.procs[name])

    def _write(self, name: str, data: dict[str, Any]) -> str:
        path = os.path.join(self.workdir, name)
        with open(path, "w", encoding="utf-8") as f:
            yaml.safe_dump(data, f)
        return path

    def metrics(self, name: str) -> str:
        """The Prometheus text of process ``name`` (its internal listener's ``/metrics``)."""
        url = f"http://127.0.0.1:{self.internal_ports[name]}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text: str = response.read().decode()
        return text

    def pids(self) -> dict[str, int]:
        """Our processes and this database's PostgreSQL backends, by name."""
        out = {name: c.pid for name, c in self.procs.items() if c.alive()}
        for i, pid in enumerate(pg_backend_pids(self.dbname)):
            out[f"postgres{i}"] = pid
        return out

    def check_alive(self) -> None:
        for name, child in self.procs.items():
            if not child.alive():
                raise RuntimeError(f"{name} exited with {child.proc.returncode}:\n{child.tail()}")

    def close(self) -> None:
        self.children.stop_all()
        if self.dbname:
            drop_database(self.dbname)
            self.dbname = ""
