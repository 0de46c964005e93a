"""Copies of a deployment directory, for the main job, tests and benchmarks.

:func:`make_deployment` copies ``workers/`` (or another deployment) into a new
directory with its ports remapped (to run beside the original, or on free
ports in tests), optionally federating with a peer server and keeping only
some of the processes.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import fcntl
import os
import random
import re
import socket
import tempfile

import yaml

WORKERS = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "workers"))

#: Every port the default deployment in workers/ uses.
DEFAULT_PORTS = [8008, 8448, 9092, 9093, 9094, 9095, 9096, 9097, 9101, 9102, 9103, 9104, 9105]
#: The master's client API listener in workers/.
CLIENT_PORT = 8008
#: The master's federation listener in workers/ (where a peer server sends).
FEDERATION_PORT = 8448


#: Ports :func:`free_port` has handed out in this process: none is handed out twice, since
#: the kernel may offer a port again as soon as the probing socket is closed.
_HANDED_OUT: set[int] = set()


#: Where :func:`free_port` picks ports when the kernel's ephemeral range starts above it: ports
#: the kernel never hands to outgoing connections, so a port probed free stays free until the
#: process it is meant for binds it (an outgoing connection's local port could take an ephemeral
#: one in between, and did, once, under the whole test suite).
FREE_PORT_RANGE = (20000, 32000)
_random = random.SystemRandom()
#: Where :func:`free_port` marks the ports it hands out for every process of the machine (a lock
#: file per port, ``flock``-ed while the process that handed it out lives): two processes probing at
#: once would otherwise both find a port free and both hand it out, and the second deployment would
#: talk to the first one's process on it.
PORT_LOCKS_DIR = os.path.join(tempfile.gettempdir(), "synflow-ports")
#: The newest reservations a process keeps (older ones are released: their ports are bound by now).
_MAX_RESERVATIONS = 512
_reservations: dict[int, int] = {}  # port -> the fd holding its lock, oldest first


def _reserve(port: int) -> bool:
    """Mark ``port`` handed out for the machine; False if another live process has it marked.

    Where the lock files cannot be made (another user's directory, a read-only temp dir) every port
    counts as unmarked, as before there were marks.
    """
    try:
        os.makedirs(PORT_LOCKS_DIR, exist_ok=True)
        fd = os.open(os.path.join(PORT_LOCKS_DIR, str(port)), os.O_CREAT | os.O_RDWR, 0o600)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    _reservations[port] = fd
    while len(_reservations) > _MAX_RESERVATIONS:
        oldest = next(iter(_reservations))
        os.close(_reservations.pop(oldest))
    return True


def _ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def free_port() -> int:
    """A loopback TCP port nobody listens on right now, never one this process was given before.

    Taken at random from :data:`FREE_PORT_RANGE` when that is below the kernel's ephemeral range
    (Linux's default starts at 32768), else from the kernel (``bind`` to port 0).
    """
    low, high = FREE_PORT_RANGE
    ephemeral = _ephemeral_low()
    below_ephemeral = ephemeral is not None and high <= ephemeral
    for _ in range(200 if below_ephemeral else 0):
        port = _random.randrange(low, high)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        if not _reserve(port):
            continue  # another process handed it out and has not bound it yet
        return port
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            if _reserve(port):
                return port


def make_deployment(target: str, server_name: str, port_map: dict[int, int], *, peer: str | None = None,
                    peer_url: str | None = None, processes: list[str] | None = None,
                    writers: list[str] | None = None, source: str = WORKERS) -> None:
    """Copy the deployment in ``source`` into ``target``.

    Ports are remapped through ``port_map``; with ``peer`` the copy federates
    with that server at ``peer_url``; with ``processes`` only those process
    files are kept (and ``writers`` become the event persisters).
    """
    os.makedirs(target, exist_ok=True)
    for name in sorted(os.listdir(source)):
        if name == "production.yaml" or not name.endswith(".yaml"):
            continue
        if processes is not None and name != "shared.yaml" and name[:-5] not in processes:
            continue
        with open(os.path.join(source, name), encoding="utf-8") as f:
            text = f.read()
        text = re.sub(r"\b(\d{4,5})\b", lambda m: str(port_map.get(int(m.group(1)), m.group(1))), text)
        data = yaml.safe_load(text)
        if name == "shared.yaml":
            data["server_name"] = server_name
            if peer is not None:
                data["federation"] = {
                    "destinations": {peer: peer_url}, "wakeup_interval_s": 2.0, "request_timeout_s": 10.0,
                    "backoff": {"initial_s": 0.5, "multiplier": 2.0, "max_s": 10.0, "jitter": 0.1},
                }
            if processes is not None:
                data["instance_map"] = {k: v for k, v in data["instance_map"].items() if k in processes}
                data["stream_writers"] = {"events": writers}
                data["federation_sender_instances"] = [p for p in processes if p.startswith("federation_sender")]
                data["caches"] = {"cache_invalidator_instances": [p for p in processes if p.startswith("cache_")]}
        with open(os.path.join(target, name), "w", encoding="utf-8") as f:
            yaml.safe_dump(data, f, sort_keys=False)


