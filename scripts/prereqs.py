"""Prerequisite checks of the main job, run before anything starts.

Each check returns one line per missing thing, naming it and how to get it,
so ``scripts/demo`` stops before any traffic instead of failing at the end
(no Java means the validator cannot run; a busy port means a process cannot
listen).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Iterable

#: Spark 4 runs on Java 17 or newer.
MIN_JAVA = 17
JAVA_PACKAGE = "openjdk-17-jre-headless"


def java_binary() -> str | None:
    """The java Spark will run: ``$JAVA_HOME/bin/java`` when JAVA_HOME is set, else ``java`` on the PATH."""
    home = os.environ.get("JAVA_HOME")
    if home:
        candidate = os.path.join(home, "bin", "java")
        return candidate if os.access(candidate, os.X_OK) else None
    return shutil.which("java")


def java_major(version_output: str) -> int | None:
    """The major version in ``java -version`` output (``"17.0.9"`` → 17, ``"1.8.0_392"`` → 8)."""
    match = re.search(r'version "(\d+)(?:\.(\d+))?', version_output)
    if not match:
        return None
    major = int(match.group(1))
    return int(match.group(2) or 0) if major == 1 else major


def check_java() -> list[str]:
    """A line naming Java when no Java ≥ 17 is where Spark looks for it."""
    java = java_binary()
    if java is None:
        where = f"JAVA_HOME={os.environ['JAVA_HOME']} has no bin/java" if os.environ.get("JAVA_HOME") else "no java on the PATH"
        return [f"Java {MIN_JAVA}+ is needed for the Spark validator ({where}): apt-get install {JAVA_PACKAGE}"]
    try:
        result = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [f"Java at {java} does not run ({e}): apt-get install {JAVA_PACKAGE}"]
    major = java_major(result.stderr + result.stdout)
    if major is None or major < MIN_JAVA:
        return [f"Java {MIN_JAVA}+ is needed for the Spark validator, {java} is version {major}: apt-get install {JAVA_PACKAGE}"]
    return []


def port_holder(port: int) -> str | None:
    """Who listens on a local TCP port, as ``name (pid N)``, from ``ss``; None if unknown."""
    try:
        out = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r'users:\(\("([^"]+)",pid=(\d+)', out)
    return f"{match.group(1)} (pid {match.group(2)})" if match else None


def check_ports(ports: Iterable[int], host: str = "127.0.0.1") -> list[str]:
    """A line for each port on ``host`` that is already taken, naming the process holding it."""
    problems = []
    for port in sorted(set(ports)):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise
                holder = port_holder(port)
                by = f" by {holder}" if holder else ""
                problems.append(f"port {port} on {host} is in use{by}: stop it, or run the demo with --free-ports")
    return problems
