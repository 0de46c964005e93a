"""``synflowctl``: start, stop and inspect a deployment directory.

    synflowctl start   [DIR] [--config FILE]...
    synflowctl stop    [DIR] [--config FILE]...
    synflowctl restart [DIR] [--config FILE]...
    synflowctl status  [DIR] [--config FILE]...

``DIR`` (default ``workers/``) holds ``shared.yaml`` and one YAML file per
process (any file with an ``app`` key). Each process runs as
``twistd synflow --config DIR/shared.yaml --config DIR/<proc>.yaml
[--config FILE]...`` -- every ``--config`` given here is appended to every
process's list, so ``--config workers/production.yaml`` switches the whole
deployment to PostgreSQL and Redis. Processes are daemonized with their own
pidfile and logfile (``pid_file``/``log_file``, by default under
``<data_dir>/run`` and ``<data_dir>/log``), started master first, each
waited for until its ``/health`` answers 200, and stopped in reverse order.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import attrs
import yaml

from synflow.config import SynflowConfig, listener_port, load_config
from synflow.errors import ConfigError

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


@attrs.frozen
class Proc:
    name: str
    files: tuple[str, ...]
    config: SynflowConfig

    @property
    def pid_file(self) -> str:
        return os.path.abspath(self.config.pid_file or os.path.join(self.config.data_dir, "run", f"{self.name}.pid"))

    @property
    def log_file(self) -> str:
        return os.path.abspath(self.config.log_file or os.path.join(self.config.data_dir, "log", f"{self.name}.log"))

    @property
    def health_url(self) -> str | None:
        own = self.config.instance_map.get(self.name)
        return f"http://{own.host}:{own.port}/health" if own else None

    @property
    def metrics_url(self) -> str | None:
        listener = self.config.listener("metrics")
        if listener is not None:
            port = listener_port(listener.endpoint)
            host = _interface(listener.endpoint)
            return f"http://{host}:{port}/metrics"
        own = self.config.instance_map.get(self.name)
        return f"http://{own.host}:{own.port}/metrics" if own else None


def _interface(endpoint: str) -> str:
    for part in endpoint.split(":"):
        if part.startswith("interface="):
            return part[len("interface="):]
    return "127.0.0.1"


def discover(directory: str, extra: list[str]) -> list[Proc]:
    """The processes of a deployment directory, master first."""
    shared = os.path.join(directory, "shared.yaml")
    if not os.path.exists(shared):
        raise ConfigError(f"no shared.yaml in {directory!r}", path=directory)
    procs = []
    for entry in sorted(os.listdir(directory)):
        path = os.path.join(directory, entry)
        if not entry.endswith((".yaml", ".yml")) or entry == "shared.yaml":
            continue
        with open(path, encoding="utf-8") as f:
            try:
                data = yaml.safe_load(f)
            except yaml.YAMLError:
                data = None
        if not isinstance(data, dict) or "app" not in data:
            continue
        files = (shared, path, *extra)
        config = load_config(list(files))
        procs.append(Proc(config.instance_name, files, config))
    if not procs:
        raise ConfigError(f"no process files (YAML with an 'app' key) in {directory!r}", path=directory)
    procs.sort(key=lambda p: (p.config.app != "master", p.name))
    _check_ports(procs)
    return procs


def _check_ports(procs: list[Proc]) -> None:
    seen: dict[int, str] = {}
    for proc in procs:
        ports = [(listener_port(listener.endpoint), f"listeners of {proc.name}") for listener in proc.config.listeners]
        if proc.config.app == "master" and proc.config.replication.transport.value == "tcp":
            ports.append((proc.config.replication.hub.port, "replication.hub"))
        own = proc.config.instance_map.get(proc.name)
        if own is not None:
            ports.append((own.port, f"instance_map.{proc.name}"))
        for port, what in ports:
            if port and seen.get(port, what) != what:
                raise ConfigError(f"port {port} is used by both {seen[port]} and {what}", path=proc.files[1])
            if port:
                seen[port] = what


def pid_of(proc: Proc) -> int | None:
    try:
        with open(proc.pid_file, encoding="ascii") as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return pid


def health(proc: Proc, timeout: float = 2.0) -> tuple[str, dict[str, Any]]:
    url = proc.health_url
    if url is None:
        return "no listener", {}
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return "healthy", json.loads(response.read())
    except urllib.error.HTTPError as e:
        try:
            body = json.loads(e.read())
        except ValueError:
            body = {}
        return "unhealthy: " + "; ".join(body.get("problems", [str(e.code)])), body
    except (OSError, ValueError) as e:
        return f"down ({type(e).__name__})", {}


def twistd() -> str:
    candidate = os.path.join(os.path.dirname(sys.executable), "twistd")
    return candidate if os.path.exists(candidate) else "twistd"


def start(procs: list[Proc], out: Any = sys.stdout) -> int:
    for proc in procs:
        if pid_of(proc) is not None:
            out.write(f"  {proc.name:<22} already running (pid {pid_of(proc)})\n")
            continue
        os.makedirs(os.path.dirname(proc.pid_file), exist_ok=True)
        os.makedirs(os.path.dirname(proc.log_file), exist_ok=True)
        cmd = [twistd(), "--pidfile", proc.pid_file, "--logfile", proc.log_file, "synflow"]
        for f in proc.files:
            cmd += ["--config", f]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            out.write(f"  {proc.name:<22} FAILED to start:\n{result.stderr or result.stdout}\n")
            return 1
        out.write(f"  {proc.name:<22} starting ")
        out.flush()
        deadline = time.monotonic() + START_TIMEOUT_S
        state = "down"
        while time.monotonic() < deadline:
            if pid_of(proc) is None and time.monotonic() > deadline - START_TIMEOUT_S + 2:
                break
            state, _ = health(proc)
            if state == "healthy":
                break
            out.write(".")
            out.flush()
            time.sleep(0.5)
        if state != "healthy":
            out.write(f" {state}\n{_tail(proc.log_file)}\n")
            return 1
        out.write(f" healthy (pid {pid_of(proc)})\n")
    return 0


def stop(procs: list[Proc], out: Any = sys.stdout) -> int:
    code = 0
    for proc in reversed(procs):
        pid = pid_of(proc)
        if pid is None:
            out.write(f"  {proc.name:<22} not running\n")
            continue
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.2)
        if _alive(pid):
            out.write(f"  {proc.name:<22} did not stop in {STOP_TIMEOUT_S:.0f}s; killing pid {pid}\n")
            os.kill(pid, signal.SIGKILL)
            code = 1
        else:
            out.write(f"  {proc.name:<22} stopped\n")
        if os.path.exists(proc.pid_file):
            os.unlink(proc.pid_file)
    return code


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
        return waited == 0
    except ChildProcessError:
        return True


def status(procs: list[Proc], out: Any = sys.stdout) -> int:
    rows = [("instance", "app", "pid", "health", "metrics", "events positions")]
    all_up = True
    for proc in procs:
        pid = pid_of(proc)
        state, body = health(proc) if pid else ("stopped", {})
        all_up &= state == "healthy"
        positions = body.get("positions", {}).get("events", {})
        rows.append((proc.name, proc.config.app, str(pid or "-"), state, proc.metrics_url or "-",
                     " ".join(f"{k}={v}" for k, v in sorted(positions.items())) or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        out.write("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() + "\n")
    return 0 if all_up else 3


def _tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="synflowctl", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("command", choices=("start", "stop", "restart", "status"))
    parser.add_argument("directory", nargs="?", default="workers")
    parser.add_argument("--config", action="append", default=[], help="appended to every process's config list")
    args = parser.parse_args(argv)
    try:
        procs = discover(args.directory, [os.path.abspath(c) for c in args.config])
    except ConfigError as e:
        sys.stderr.write(f"synflowctl: configuration error: {e}\n")
        return 78
    if args.command == "start":
        return start(procs)
    if args.command == "stop":
        return stop(procs)
    if args.command == "restart":
        stop(procs)
        return start(procs)
    return status(procs)


if __name__ == "__main__":
    sys.exit(main())
