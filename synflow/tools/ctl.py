"""``synflowctl``: start, stop and inspect a deployment directory.

    synflowctl start   [DIR] [--config FILE]...
    synflowctl stop    [DIR] [--config FILE]...
    synflowctl restart [DIR] [--config FILE]...
    synflowctl status  [DIR] [--config FILE]...
    synflowctl reshard [DIR] (--add NAME | --remove NAME) [--config FILE]...
    synflowctl shards  [DIR] [--config FILE]...
    synflowctl plugins

``reshard --add NAME`` starts the event persister or federation sender
``NAME`` from its file in ``DIR`` (any file with that ``instance_name``)
and, once it is healthy, asks the master to move to it the rooms (or
destinations) it now owns: a new shard-map epoch, handed over with no
restart and nothing lost (see ``docs/operations.md``). ``reshard --remove
NAME`` moves ``NAME``'s rooms or destinations to the others, then stops it.
``shards`` prints, for rooms and for destinations, the current epoch, what
each writer owns, the hand-over in progress and the epochs' history. Both talk to the master's internal RPC with the deployment's secret.

``plugins`` lists the worker types (``app:`` values) and streams installed:
synflow's own and every distribution's ``synflow.apps`` / ``synflow.streams``
entry points.

``DIR`` (default ``workers/``) holds ``shared.yaml`` and one YAML file per
process (any file with an ``app`` or ``instance_name`` key); other YAML files
there are overlays, used only when named with ``--config``. Every file is
read and its top-level keys checked: broken YAML or an unknown key (a
misspelt ``app``) is a configuration error naming the file. Each process runs as
``twistd synflow --config DIR/shared.yaml --config DIR/<proc>.yaml
[--config FILE]...`` -- every ``--config`` given here is appended to every
process's list, so ``--config workers/production.yaml`` switches the whole
deployment to PostgreSQL and Redis. Processes are daemonized with their own
pidfile and logfile (``pid_file``/``log_file``, by default under
``<data_dir>/run`` and ``<data_dir>/log``). ``start`` starts the migrating
process (the master) first and waits until its ``/health`` answers 200, then
starts the others together and waits for each; ``stop`` signals every process
but the master at once, waits for them to exit, then stops the master.
Ports are checked across the processes too: two processes on one port is a
configuration error naming the file and the key of the second.

``start`` first makes sure the deployment's internal-channel secret exists
(``replication.secret_path``, by default ``<data_dir>/replication.secret``,
created 0600 with a random secret on first use). A pidfile is believed only
if its PID is this deployment's process for that instance: its environment
carries ``SYNFLOW_PIDFILE=<its pidfile>`` (set by ``start``) or its command
line runs ``twistd ... --pidfile <its pidfile> ... synflow``. A live PID that
is neither -- reused after a crash -- is reported as a stale pidfile, never
signalled, and the pidfile removed.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import attrs

from synflow import registry
from synflow.config import (
    SynflowConfig,
    core_keys,
    listener_port,
    load_config,
    read_yaml,
)
from synflow.endpoints import tcp_address
from synflow.errors import ConfigError
from synflow.http.rpc import PREFIX as RPC_PREFIX
from synflow.listeners import INTERNAL, effective_listeners
from synflow.tools.prometheus import scrape_config

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
#: How often ``start`` asks a starting process's ``/health`` and ``stop`` looks whether a process has exited.
HEALTH_POLL_S = 0.1
STOP_POLL_S = 0.05
#: The environment variable that marks a started process as one deployment's instance (its pidfile).
PIDFILE_ENV = "SYNFLOW_PIDFILE"
#: Most bytes read from ``/proc/<pid>/cmdline`` or ``environ``.
MAX_PROC_BYTES = 1024 * 1024


@attrs.frozen
class Proc:
    """One process of a deployment: its name, config files and loaded config."""

    name: str
    files: tuple[str, ...]
    config: SynflowConfig

    @property
    def pid_file(self) -> str:
        """The process's pidfile (``pid_file``, by default under ``<data_dir>/run``)."""
        return os.path.abspath(self.config.pid_path)

    @property
    def log_file(self) -> str:
        """The process's log file (``log_file``, by default under ``<data_dir>/log``)."""
        return os.path.abspath(self.config.log_path)

    @property
    def health_url(self) -> str | None:
        """Where the process answers ``/health``: its internal listener if that serves it, else another."""
        return self._url("health")

    @property
    def metrics_url(self) -> str | None:
        """Where the process answers ``/metrics``: a configured ``metrics`` listener, else its internal listener."""
        return self._url("metrics")

    def _url(self, resource: str) -> str | None:
        listeners = effective_listeners(self.config)
        if resource == "health":  # the internal listener first: its address is what instance_map says
            listeners.sort(key=lambda listener: listener.name != INTERNAL)
        listener = next((listener for listener in listeners if listener.serves(resource)), None)
        if listener is None:
            return None
        if listener.name == INTERNAL:
            own = self.config.instance_map[self.name]
            return f"http://{own.host}:{own.port}/{resource}"
        address = tcp_address(listener.endpoint)
        if address is None or not address[1]:
            return None  # a unix or systemd socket: no URL to show
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(address[0], address[0])
        return f"http://{f'[{host}]' if ':' in host else host}:{address[1]}/{resource}"


#: Keys that make a YAML file in the deployment directory a process file.
PROCESS_KEYS = ("app", "instance_name")


def discover(directory: str, extra: list[str]) -> list[Proc]:
    """The processes of a deployment directory, the migrating one (the master) first.

    Args:
        directory: holds ``shared.yaml`` and one file per process.
        extra: config files appended to every process's list. A directory
            here is an **overlay deployment** (a plugin package's
            ``workers/``, say): its ``shared.yaml``, if any, is appended to
            every process's list, and each of its process files adds a
            process.

    Raises:
        ConfigError: naming the file (and key) of broken YAML, an unknown
            top-level key, an invalid process config or a port two
            processes use.
    """
    shared = os.path.join(directory, "shared.yaml")
    if not os.path.exists(shared):
        raise ConfigError(f"no shared.yaml in {directory!r}", path=directory)
    overlays = [e for e in extra if os.path.isdir(e)]
    files_after: list[str] = []
    for e in extra:
        if os.path.isdir(e):
            if os.path.exists(os.path.join(e, "shared.yaml")):
                files_after.append(os.path.join(e, "shared.yaml"))
        else:
            files_after.append(e)
    procs = []
    for process_dir in (directory, *overlays):
        for path in _process_files(process_dir):
            files = (shared, path, *files_after)
            config = load_config(list(files))
            procs.append(Proc(config.instance_name, files, config))
    if not procs:
        raise ConfigError(f"no process files (YAML with an 'app' key) in {directory!r}", path=directory)
    names = [p.name for p in procs]
    for proc in procs:
        if names.count(proc.name) > 1:
            raise ConfigError(f"instance_name {proc.name!r} is used by two process files", path=proc.files[1],
                              key="instance_name")
    order = [name for name, _ in registry.sorted_for_start((p.name, p.config) for p in procs)]
    procs.sort(key=lambda p: order.index(p.name))
    _check_ports(procs)
    return procs


def _process_files(directory: str) -> list[str]:
    """The process files of ``directory`` (YAML with ``app`` or ``instance_name``), their keys checked."""
    known = sorted(core_keys() | set(registry.config_sections()))
    found = []
    for entry in sorted(os.listdir(directory)):
        path = os.path.join(directory, entry)
        if not entry.endswith((".yaml", ".yml")) or entry == "shared.yaml":
            continue
        data = read_yaml(path)
        for key in data:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
                raise ConfigError(f"unknown key ({hint})", path=path, key=str(key))
        if not any(key in data for key in PROCESS_KEYS):
            continue  # an overlay such as production.yaml: used only through --config
        if "app" not in data:
            apps = ", ".join(sorted(registry.discover().apps))
            raise ConfigError(f"is required in a process file (one of {apps}, or package.module:Class)", path=path, key="app")
        found.append(path)
    return found


def _ports(proc: Proc) -> list[tuple[int, str]]:
    """Every TCP port ``proc`` listens on, with the dotted key that sets it."""
    ports = [(listener_port(listener.endpoint), listener.key) for listener in effective_listeners(proc.config)]
    return [(port, key) for port, key in ports if port]


def _check_ports(procs: list[Proc]) -> None:
    """Refuse two processes listening on one port, naming the second one's file and key."""
    seen: dict[int, tuple[str, str, str | None]] = {}
    for proc in procs:
        for port, key in _ports(proc):
            file = proc.config.origin(key)
            if port in seen and seen[port][:2] != (proc.name, key):
                other, other_key, other_file = seen[port]
                raise ConfigError(f"port {port} is already used by {other} ({other_file}: {other_key})",
                                  path=file, key=key)
            seen[port] = (proc.name, key, file)


def read_pidfile(proc: Proc) -> int | None:
    """The PID in ``proc``'s pidfile, if it holds one."""
    try:
        with open(proc.pid_file, encoding="ascii") as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return pid if pid > 0 else None


def _alive_pid(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie waiting to be reaped by another parent is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """Whether ``pid`` has exited and only waits for its parent (init, for a daemon) to reap it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read(4096)
    except OSError:
        return False
    # The state follows the command name, which is in parentheses and may hold spaces.
    state = stat.rfind(b")") + 2
    return stat[state:state + 1] in (b"Z", b"X")


def _proc_words(pid: int, name: str) -> list[str] | None:
    """``/proc/<pid>/<name>`` split on NULs; None if it cannot be read."""
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            data = f.read(MAX_PROC_BYTES)
    except OSError:
        return None
    return [w.decode("utf-8", "replace") for w in data.split(b"\0") if w]


def _command_line(pid: int) -> list[str] | None:
    """The process's arguments, from ``/proc`` or else ``ps`` (None if it cannot be told)."""
    words = _proc_words(pid, "cmdline")
    if words is not None or os.path.isdir("/proc/self"):
        return words
    try:
        result = subprocess.run(["ps", "-o", "args=", "-p", str(pid)], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.split() if result.returncode == 0 else None


def is_deployment_process(proc: Proc, pid: int) -> bool:
    """Whether the live process ``pid`` is ``proc``'s synflow process, not a stranger that reused the PID.

    It is if its environment carries the mark ``synflowctl start`` gives each
    process (``SYNFLOW_PIDFILE=<its pidfile>``), or if its command line runs
    ``twistd ... --pidfile <its pidfile> ... synflow`` (a process started by
    hand, or before the mark existed). A process that cannot be inspected
    (another user's) is not.
    """
    environ = _proc_words(pid, "environ")
    if environ is not None and f"{PIDFILE_ENV}={proc.pid_file}" in environ:
        return True
    args = _command_line(pid)
    if not args or "synflow" not in args:
        return False
    for i, arg in enumerate(args):
        if arg == "--pidfile" and i + 1 < len(args) and os.path.abspath(args[i + 1]) == proc.pid_file:
            return True
        if arg.startswith("--pidfile=") and os.path.abspath(arg[len("--pidfile="):]) == proc.pid_file:
            return True
    return False


def stale_pid(proc: Proc) -> int | None:
    """A live PID in ``proc``'s pidfile that is not its process (PID reuse after a crash)."""
    pid = read_pidfile(proc)
    if pid is None or not _alive_pid(pid) or is_deployment_process(proc, pid):
        return None
    return pid


def pid_of(proc: Proc) -> int | None:
    """The PID of ``proc``'s running process: its pidfile's, if alive and really its process."""
    pid = read_pidfile(proc)
    if pid is None or not _alive_pid(pid) or not is_deployment_process(proc, pid):
        return None
    return pid


def _drop_stale_pidfile(proc: Proc, out: Any) -> None:
    """Report and remove a pidfile naming an unrelated live process; that process is left alone."""
    pid = stale_pid(proc)
    if pid is None:
        return
    out.write(f"  {proc.name:<22} stale pidfile: pid {pid} is not this deployment's {proc.name} "
              f"(not signalled); removing {proc.pid_file}\n")
    try:
        os.unlink(proc.pid_file)
    except FileNotFoundError:
        pass


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


def start(procs: list[Proc], out: Any = None) -> int:
    """Start each process not running through twistd and wait until it is healthy.

    The first process (the migrating one, the master) is started and waited
    for alone; the others then start together, since each only needs the
    master. Lines are printed in the deployment's order.

    Returns:
        0 if every process is up, else 1 (after printing the failing one's log tail).
    """
    out = out if out is not None else sys.stdout
    for proc in procs:
        try:
            proc.config.replication_secret()  # the deployment's secret, created on first use
        except ConfigError as e:
            out.write(f"  {proc.name:<22} FAILED to start: configuration error: {e}\n")
            return 1
    for group in (procs[:1], procs[1:]):
        launched: list[tuple[Proc, subprocess.Popen[str]]] = []
        for proc in group:
            running = pid_of(proc)
            if running is not None:
                out.write(f"  {proc.name:<22} already running (pid {running})\n")
                continue
            launched.append((proc, _launch(proc, out)))
        failed = False
        for proc, child in launched:
            stdout, stderr = child.communicate()
            if child.returncode != 0:
                out.write(f"  {proc.name:<22} FAILED to start:\n{stderr or stdout}\n")
                failed = True
        if failed:
            return 1
        for proc, _ in launched:
            if not _wait_healthy(proc, out):
                return 1
    return 0


def _launch(proc: Proc, out: Any) -> subprocess.Popen[str]:
    """Run ``twistd`` for ``proc``; it daemonizes, and its parent exits once the daemon is forked."""
    _drop_stale_pidfile(proc, out)
    os.makedirs(os.path.dirname(proc.pid_file), exist_ok=True)
    os.makedirs(os.path.dirname(proc.log_file), exist_ok=True)
    cmd = [twistd(), "--pidfile", proc.pid_file, "--logfile", proc.log_file, "synflow"]
    for f in proc.files:
        cmd += ["--config", f]
    env = dict(os.environ, **{PIDFILE_ENV: proc.pid_file})
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _wait_healthy(proc: Proc, out: Any) -> bool:
    """Poll ``proc``'s ``/health`` until it answers 200; print the outcome (and the log tail on failure)."""
    out.write(f"  {proc.name:<22} starting ")
    out.flush()
    started = time.monotonic()
    deadline = started + START_TIMEOUT_S
    state = "down"
    dots = started
    while time.monotonic() < deadline:
        if pid_of(proc) is None and time.monotonic() > started + 2:
            break
        state, _ = health(proc)
        # Healthy means the process its pidfile names answers: until the pidfile is written, a
        # 200 proves nothing about this start.
        if state == "healthy" and pid_of(proc) is not None:
            break
        if time.monotonic() - dots >= 0.5:
            out.write(".")
            out.flush()
            dots = time.monotonic()
        time.sleep(HEALTH_POLL_S)
    pid = pid_of(proc)
    if state != "healthy" or pid is None:
        why = state if state != "healthy" else f"answering /health, but {proc.pid_file} names no live process"
        out.write(f" {why}\n{_tail(proc.log_file)}\n")
        return False
    out.write(f" healthy (pid {pid})\n")
    return True


def stop(procs: list[Proc], out: Any = None) -> int:
    """SIGTERM the running processes and wait for them to exit (SIGKILL after a timeout).

    Every process but the first (the master) is signalled at once; the master
    is stopped last, after they have exited. Lines are printed in reverse
    start order.

    Returns:
        0, or 1 if a process had to be killed.
    """
    out = out if out is not None else sys.stdout
    code = 0
    for group in (list(reversed(procs[1:])), procs[:1]):
        signalled: list[tuple[Proc, int]] = []
        for proc in group:
            pid = pid_of(proc)
            if pid is None:
                if stale_pid(proc) is not None:
                    _drop_stale_pidfile(proc, out)
                else:
                    out.write(f"  {proc.name:<22} not running\n")
                continue
            os.kill(pid, signal.SIGTERM)
            signalled.append((proc, pid))
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc, pid in signalled:
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(STOP_POLL_S)
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
    """Whether ``pid`` still runs: reaped here if it is our child, else as :func:`_alive_pid` tells."""
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
        return waited == 0
    except ChildProcessError:
        return _alive_pid(pid)


STATUS_HEADER = ("instance", "app", "pid", "health", "metrics", "positions")


def format_positions(positions: dict[str, dict[str, int]]) -> str:
    """Every stream's writer positions, e.g. ``caches: master=3; events: p1=9 p2=7``."""
    parts = []
    for stream, writers in sorted(positions.items()):
        if isinstance(writers, dict) and writers:
            parts.append(f"{stream}: " + " ".join(f"{k}={v}" for k, v in sorted(writers.items())))
    return "; ".join(parts) or "-"


def status(procs: list[Proc], out: Any = None) -> int:
    """Print one row per process; 0 if every process is healthy, else 3."""
    out = out if out is not None else sys.stdout
    rows = [STATUS_HEADER]
    all_up = True
    for proc in procs:
        pid = pid_of(proc)
        state, body = health(proc) if pid else ("stopped", {})
        all_up &= state == "healthy"
        positions = body.get("positions", {})
        rows.append((proc.name, registry.app_name(proc.config), str(pid or "-"), state, proc.metrics_url or "-",
                     format_positions(positions if isinstance(positions, dict) else {})))
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


class RpcCallError(Exception):
    """An internal RPC that synflowctl made failed; the message says why."""


def call_rpc(config: SynflowConfig, instance: str, name: str, args: Any, timeout: float = 60.0) -> Any:
    """Call ``name`` on ``instance``'s internal listener with the deployment's secret; returns its result.

    Raises:
        RpcCallError: the instance is unreachable or answered an error.
    """
    address = config.instance_map.get(instance)
    if address is None:
        raise RpcCallError(f"{instance!r} is not in instance_map")
    secret = config.replication_secret()
    url = f"http://{address.host}:{address.port}{RPC_PREFIX}/{name}/{secrets.token_urlsafe(12)}"
    headers = {"Content-Type": "application/json"}
    if secret is not None:
        headers["Authorization"] = f"Bearer {secret}"
    request = urllib.request.Request(url, data=json.dumps({"args": args, "positions": {}}).encode(),
                                     headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read()).get("result")
    except urllib.error.HTTPError as e:
        try:
            body = json.loads(e.read())
        except ValueError:
            body = {}
        raise RpcCallError(f"{instance} answered {e.code} {body.get('errcode', '')}: "
                           f"{body.get('error', e.reason)}") from None
    except (OSError, ValueError) as e:
        raise RpcCallError(f"cannot reach {instance} at {address.host}:{address.port} ({e})") from None


def _master(procs: list[Proc]) -> Proc:
    for proc in procs:
        if proc.config.instance_name == "master":
            return proc
    raise RpcCallError("no master in this deployment directory")


def _proc_named(procs: list[Proc], name: str) -> Proc:
    for proc in procs:
        if proc.config.instance_name == name:
            return proc
    raise RpcCallError(f"no process {name!r} in this deployment directory (add {name}.yaml first)")


def _shard_group(proc: Proc) -> str:
    """What ``proc`` owns a share of: rooms (an events writer) or destinations (a federation stream follower)."""
    from synflow.streams import EVENTS

    cls = registry.worker_type_for(proc.config)
    if cls.declares_writer_of(EVENTS):
        return "events"
    if "federation" in cls.follows:
        return "federation"
    raise RpcCallError(f"{proc.name} ({cls.name}) neither persists events nor sends federation: it does not reshard")


def reshard(procs: list[Proc], op: str, name: str, out: Any = None) -> int:
    """``reshard --add NAME`` / ``--remove NAME`` (see the module docstring); 0 on success, 1 on failure.

    An event persister moves rooms (group ``events``), a federation sender destinations (``federation``).
    """
    out = out if out is not None else sys.stdout
    try:
        master, proc = _master(procs), _proc_named(procs, name)
        group = _shard_group(proc)
        args: dict[str, Any] = {"op": op, "writer": name, "group": group}
        if op == "add":
            if start([proc], out) != 0:
                return 1
            address = proc.config.instance_map.get(name)
            if address is None:
                raise RpcCallError(f"{name} is not in its own instance_map")
            args["address"] = [address.host, address.port]
        result = call_rpc(master.config, "master", "reshard", args)
    except (RpcCallError, ConfigError) as e:
        out.write(f"synflowctl: reshard failed: {e}\n")
        return 1
    out.write(f"  {group} epoch {result['epoch']}: {op} {name}; {result['moved']} of {result['total']} "
              f"{result['keys']} moved in {result['seconds'] * 1000:.0f} ms; writers {', '.join(result['writers'])}\n")
    if op == "remove":
        return stop([proc], out)
    return 0


def shards(procs: list[Proc], out: Any = None) -> int:
    """``shards``: per group, the current epoch, keys per owner, the hand-over in progress, the history."""
    out = out if out is not None else sys.stdout
    try:
        master = _master(procs)
        infos = [call_rpc(master.config, "master", "shards", {"group": "events"})]
        if master.config.federation_sender_instances:
            infos.append(call_rpc(master.config, "master", "shards", {"group": "federation"}))
    except (RpcCallError, ConfigError) as e:
        out.write(f"synflowctl: {e}\n")
        return 1
    for info in infos:
        out.write(f"{info['group']}: epoch {info['epoch']}, writers {', '.join(info['writers'])}\n")
        for writer, owned in sorted(info["owned"].items()):
            out.write(f"  {writer:<22} {owned} {info['keys']}\n")
        pending = info.get("pending")
        out.write("  hand-over in progress: " + ("none" if pending is None else
                  f"epoch {pending['epoch']} ({pending['moving']} {info['keys']} moving)") + "\n")
        for h in info["history"]:
            moved = "" if h["moved"] is None else f", {h['moved']}/{h['total']} {info['keys']} moved"
            out.write(f"  epoch {h['epoch']}: {h['op']} {h['writer'] or '-'} -> {', '.join(h['writers'])} "
                      f"[{h['state']}{moved}]\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="synflowctl", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("command", choices=("start", "stop", "restart", "status", "prometheus-config", "plugins",
                                            "reshard", "shards"))
    parser.add_argument("directory", nargs="?", default="workers")
    parser.add_argument("--config", action="append", default=[],
                        help="a file appended to every process's config list, or an overlay directory of more processes")
    change = parser.add_mutually_exclusive_group()
    change.add_argument("--add", metavar="NAME", help="reshard: start event persister NAME and move rooms to it")
    change.add_argument("--remove", metavar="NAME", help="reshard: move NAME's rooms away, then stop it")
    parser.epilog = "plugins: list the worker types and streams installed (synflow.apps / synflow.streams entry points)"
    args = parser.parse_args(argv)
    if args.command == "plugins":
        try:
            sys.stdout.write("\n".join(registry.discover().listing()) + "\n")
        except ConfigError as e:
            sys.stderr.write(f"synflowctl: {e}\n")
            return 78
        return 0
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
    if args.command == "prometheus-config":
        sys.stdout.write(scrape_config(procs))
        return 0
    if args.command == "reshard":
        if not (args.add or args.remove):
            parser.error("reshard needs --add NAME or --remove NAME")
        return reshard(procs, "add" if args.add else "remove", args.add or args.remove)
    if args.command == "shards":
        return shards(procs)
    return status(procs)


if __name__ == "__main__":
    sys.exit(main())
