"""Profiles of benchmark processes with py-spy, and a text summary of them.

``scripts/bench --profile`` attaches ``py-spy record --gil`` (pip-installed
into the venv: ``pip install py-spy``; it needs ptrace rights over the
processes) to the processes on the slowest hot paths for a while during the
measured phase -- sampling only the thread holding the GIL, so the profile is
where the interpreter's time goes, not threads waiting on PostgreSQL -- writing collapsed stacks to ``DIR/profiles/<bench>-<process>.txt``
(load them into speedscope.app or flamegraph.pl) and a summary of the
functions with the most samples, self and inclusive, to
``DIR/profiles/<bench>-<process>.summary.txt``.

``python -m scripts.benchmarks.profile FILE [--top N]`` prints the summary of
any py-spy ``--format raw`` file.

Across processes, :func:`paths_table` puts every sample of every process in
the first of :data:`PATHS` its stack enters, weighted by that process's
measured CPU per unit of work, and tells where a unit's CPU goes over the
whole deployment (``mainjob`` writes it to
``DIR/profiles/mainjob-paths.md``): the order to work in, when no single
function stands out.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def _short(frame: str) -> str:
    """``func (path/to/module.py:123)`` -> ``func (module.py)``, dropping the line."""
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    path = m.group("file")
    for marker in ("site-packages/", "/work/main/", "python3.11/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{m.group('func')} ({path})"


#: Leaf frames that are waits, not work (py-spy's idle detection misses them with --nonblocking).
WAITS = ("EPollReactor.doPoll", "Condition.wait", "Event.wait", "Thread.join", "_wait_for_tstate_lock",
         "Queue.get", "select ")


def _samples(path: str) -> Iterator[tuple[list[str], int, bool]]:
    """Each stack of a collapsed-stack file: its frames (shortened, without py-spy's process and thread
    frames), its samples, and whether it is a wait (:data:`WAITS`)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = [_short(fr) for fr in stack.split(";") if fr and not fr.startswith(("process ", "thread "))]
            if frames:
                yield frames, int(count), frames[-1].startswith(WAITS)


def summarize(path: str, top: int = 25) -> str:
    """The functions with the most samples in a collapsed-stack file, self and inclusive (waits left out)."""
    self_c: Counter[str] = Counter()
    incl_c: Counter[str] = Counter()
    total = waiting = 0
    for frames, n, wait in _samples(path):
        if wait:
            waiting += n
            continue
        total += n
        self_c[frames[-1]] += n
        for fr in set(frames):
            incl_c[fr] += n
    if not total:
        return f"{path}: no samples\n"
    out = [f"{os.path.basename(path)}: {total} samples working, {waiting} waiting (epoll, locks; left out); "
           "percentages of the working samples", "", "self %   function"]
    out += [f"{100 * c / total:6.1f}  {fn}" for fn, c in self_c.most_common(top)]
    # Inclusive: synflow's own code and the benchmark's, below the reactor loop.
    ours = [(fn, c) for fn, c in incl_c.most_common() if ("synflow/" in fn or "scripts/" in fn) and c < 0.97 * total]
    out += ["", "incl %   function (synflow and harness frames: time in it and in what it calls)"]
    out += [f"{100 * c / total:6.1f}  {fn}" for fn, c in ours[:top]]
    return "\n".join(out) + "\n"


#: The paths of a deployment's work, each with the frames (as py-spy names them, a substring) that put a
#: sample in it; a sample goes to the first path whose frame its stack holds, else to :data:`OTHER`.
PATHS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("sync", ("ClientApi.on_sync ",)),
    ("client send", ("ClientApi.on_send ",)),
    ("the persisters' RPC server", ("RpcServer._",)),
    ("inbound federation", ("SendResource.render_PUT ", "FederationAuthResource.")),
    ("federation senders", ("synflow/federation/queue.py", "synflow/federation/transport.py",
                            "synflow/federation/worker.py", "synflow/federation/sender.py", "twisted/web/_newclient.py")),
    ("the router's RPC calls", ("EventRouter.",)),
    ("the RPC client", ("RpcConnection.", "RpcClient.")),
    ("replication", ("ReplicationProtocol.", "ReplicationHub.", "ReplicationHandler.")),
    ("database threads", ("ThreadWorker.",)),
    ("persist batch", ("EventPersister.",)),
    ("audit log", ("AuditLog.",)),
    ("synflow's HTTP layer around the handlers", ("JsonResource._dispatch ",)),
    ("twisted.web outside the handlers", ("twisted/web/http.py", "twisted/web/server.py")),
)
#: Where a sample on none of :data:`PATHS` goes: the reactor loop, its I/O and Deferred chains, the rest.
OTHER = "the reactor and the rest"


def path_of(stack: str) -> str:
    """The first of :data:`PATHS` whose frames ``stack`` holds (:data:`OTHER` if none)."""
    for name, markers in PATHS:
        if any(marker in stack for marker in markers):
            return name
    return OTHER


def paths_table(profiles: Mapping[str, tuple[str, float]], unit: str = "message") -> str:
    """Where a unit of work's CPU goes over processes, as Markdown.

    ``profiles`` maps each process's name to its collapsed-stack file and
    the CPU it measured per unit (ms); each process's working samples share
    its CPU equally, and go to their path (:func:`path_of`).
    """
    by_path: Counter[str] = Counter()
    by_process: dict[str, Counter[str]] = {}
    for name, (path, cpu_ms) in sorted(profiles.items()):
        stacks = [(";".join(frames), n) for frames, n, wait in _samples(path) if not wait] if os.path.exists(path) else []
        samples = sum(n for _, n in stacks)
        mine: Counter[str] = Counter()
        for stack, n in stacks:
            mine[path_of(stack)] += n * cpu_ms * 1000 / samples
        by_process[name] = mine
        by_path.update(mine)
    total = sum(by_path.values())
    if not total:
        return "No samples.\n"
    out = [f"CPU a {unit} over {len(by_process)} processes, {total:,.0f} µs: each process's py-spy samples share "
           "its measured CPU, each sample on the first path its stack enters.", "",
           f"| path | µs a {unit} | share |", "|---|---|---|"]
    out += [f"| {name} | {us:,.0f} | {100 * us / total:.1f}% |" for name, us in by_path.most_common()]
    out += ["", f"| process | µs a {unit} | its largest paths (µs) |", "|---|---|---|"]
    for name, mine in sorted(by_process.items(), key=lambda kv: -sum(kv[1].values())):
        top = ", ".join(f"{p} {us:,.0f}" for p, us in mine.most_common(4))
        out.append(f"| {name} | {sum(mine.values()):,.0f} | {top} |")
    return "\n".join(out) + "\n"


def _py_spy() -> str | None:
    """py-spy from the running virtualenv, else from PATH."""
    local = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return local if os.access(local, os.X_OK) else shutil.which("py-spy")


class Profiler:
    """Attaches py-spy to processes for a fixed time; writes raw stacks and summaries."""

    def __init__(self, directory: str | None) -> None:
        self.directory = directory
        self.procs: list[tuple[subprocess.Popen[bytes], str]] = []

    @property
    def enabled(self) -> bool:
        return bool(self.directory) and _py_spy() is not None

    def attach(self, name: str, pid: int, seconds: float) -> None:
        if not self.enabled:
            return
        assert self.directory is not None
        os.makedirs(self.directory, exist_ok=True)
        out = os.path.join(self.directory, f"{name}.txt")
        proc = subprocess.Popen([_py_spy() or "py-spy", "record", "--pid", str(pid), "--rate", "200", "--duration", str(int(seconds)),
                                 "--format", "raw", "--nonblocking", "--gil", "-o", out],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append((proc, out))

    def finish(self) -> list[str]:
        """Wait for every recording; write and return the summaries' paths."""
        done = []
        for proc, out in self.procs:
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
            if os.path.exists(out):
                summary = out[:-4] + ".summary.txt"
                with open(summary, "w", encoding="utf-8") as f:
                    f.write(summarize(out))
                done.append(summary)
        self.procs = []
        return done


def from_env() -> Profiler:
    """The profiler ``scripts/bench --profile`` asks for (disabled otherwise)."""
    return Profiler(os.environ.get("SYNFLOW_BENCH_PROFILE") or None)


def main(argv: Any = None) -> None:
    p = argparse.ArgumentParser(description="Summarise a py-spy raw (collapsed stacks) file.")
    p.add_argument("file")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    print(summarize(args.file, args.top))


if __name__ == "__main__":
    main()
