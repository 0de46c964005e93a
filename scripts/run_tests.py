#!/usr/bin/env python3
"""Run synflow's trial suite and end with a closing line CI harnesses read.

trial's own summary (``PASSED (successes=N)``) is printed as usual; after it
this wrapper prints ``N passed, N failed, N skipped`` and exits non-zero if
anything failed, if trial printed no summary, or if no test ran at all. The
whole suite run in parallel is two trial runs side by side (see
:func:`trial_runs`), whose counts the closing line adds up.

Usage: python scripts/run_tests.py [trial options] [test modules...]
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterable

#: trial's closing line: ``PASSED (successes=3, skips=1)``, or a bare ``PASSED`` when nothing ran.
#: Most trial workers for ``SYNFLOW_TEST_JOBS=auto`` (the default): two per CPU.
#: Most of the suite's time is spent waiting on real processes (twistd, the JVM,
#: pip), so workers beyond the CPU count still overlap that waiting.
MAX_JOBS = 4
WORKERS_PER_CPU = 2

#: The slowest test modules, longest first (one-process timings on 2 cores,
#: 2026-11-26). Workers take tests in suite order, so running the whole suite
#: in parallel starts these first and the short tests fill in behind them,
#: instead of one long test starting last and running alone.
SLOW_FIRST = (
    "tests.integration.test_faults",
    "tests.integration.test_reshard",
    "tests.integration.test_federation",
    "tests.spark.test_cli",
    "tests.spark.test_cluster",
    "tests.integration.test_multiwriter",
    "tests.integration.test_persisters",
    "tests.integration.test_main_job",
    "tests.integration.test_deployment",
    "tests.integration.test_internal_channels",
    "tests.integration.test_plugins",
    "tests.test_fuzz",
    "tests.spark.test_inputs",
    "tests.spark.test_validate",
    "tests.integration.test_federation_catch_up",
    "tests.integration.test_audit_disk_full",
)

#: A test module that imports this one uses the in-process Spark session: a JVM of its own in
#: every trial worker that runs such a module, started cold (about 10 CPU-s) and slow on its
#: first validator runs until the JIT has compiled Spark's planner (about 30 CPU-s more).
SPARK_SESSION_MODULE = "tests.spark._session"

#: Spark-session modules run in the main lane all the same. Each runs the validator in the session
#: once, in one long test: the worker that takes it starts a cold session JVM for that run (about
#: 15 CPU-s), while in the spark lane the test's wall time made that lane finish over a minute
#: after the main lane (two runs on 2 cores, 2026-11-27: spark lane 531 s and 522 s busy per
#: worker, main lane 449 s and 443 s).
MAIN_LANE = ("tests.spark.test_cluster",)

SUMMARY = re.compile(r"^(PASSED|FAILED)(?: \((.*)\))?\s*$")


def summarize(output: Iterable[str], returncode: int) -> tuple[list[str], int]:
    """Read trial's output and decide the closing lines and the exit code.

    Args:
        output: trial's output lines (stdout and stderr together).
        returncode: trial's exit code.

    Returns:
        The lines to print last (the final one is ``N passed, N failed,
        N skipped``) and the exit code: 0 only if trial exited 0, at least
        one test passed, and none failed.
    """
    return summarize_runs([(output, returncode)])


def summarize_runs(runs: Iterable[tuple[Iterable[str], int]]) -> tuple[list[str], int]:
    """:func:`summarize` for several trial runs (the suite's lanes) together: their counts add up.

    Args:
        runs: each run's output lines and exit code.

    Returns:
        The closing lines and the exit code: 0 only if every run exited 0 with a
        ``PASSED`` summary, at least one test passed, and none failed.
    """
    passed = failed = skipped = 0
    notes: list[str] = []
    ok = True
    for output, returncode in runs:
        summary = None
        for line in output:
            match = SUMMARY.match(line.strip())
            if match:
                summary = match
        if summary is None:
            notes.append(f"trial printed no summary (exit code {returncode})")
            continue
        counts: dict[str, int] = {}
        for part in (summary.group(2) or "").split(","):
            if "=" in part:
                key, _, value = part.strip().partition("=")
                counts[key] = int(value)
        passed += counts.get("successes", 0) + counts.get("expectedFailures", 0)
        failed += counts.get("failures", 0) + counts.get("errors", 0) + counts.get("unexpectedSuccesses", 0)
        skipped += counts.get("skips", 0)
        ok = ok and returncode == 0 and summary.group(1) == "PASSED"
    if notes:
        return [*notes, f"{passed} passed, {failed + len(notes)} failed"], 1
    lines = [f"{passed} passed, {failed} failed, {skipped} skipped"]
    if passed + failed == 0:
        return ["no test ran", *lines], 1
    return lines, 0 if failed == 0 and ok else 1


def trial_args(argv: list[str], jobs: str | None, cpus: int | None, modules: list[str] | None = None) -> list[str]:
    """trial's arguments: ``argv`` (default ``tests``), run by ``-j N`` workers.

    Args:
        argv: the arguments given to this script.
        jobs: ``SYNFLOW_TEST_JOBS``: unset or ``auto`` for two workers per CPU,
            at most :data:`MAX_JOBS`; a count; ``1`` runs the suite in one process.
        cpus: the machine's CPU count.
        modules: the suite's test modules; when the whole suite runs in
            parallel they are named one by one, :data:`SLOW_FIRST` first.
    """
    args = argv or ["tests"]
    if any(a == "-j" or a.startswith(("-j", "--jobs")) for a in args):
        return args
    n = min(MAX_JOBS, WORKERS_PER_CPU * (cpus or 1)) if jobs in (None, "", "auto") else int(jobs)
    if n < 1:
        raise ValueError(f"SYNFLOW_TEST_JOBS must be at least 1, got {jobs!r}")
    if n == 1:
        return args
    if args == ["tests"] and modules:
        args = slow_first(modules)
    return ["-j", str(n), *args]


def slow_first(modules: list[str]) -> list[str]:
    """``modules`` with those of :data:`SLOW_FIRST` first, in its order, then the rest sorted."""
    known = [m for m in SLOW_FIRST if m in modules]
    return known + sorted(set(modules) - set(known))


def test_modules(root: str = "tests") -> list[str]:
    """Every ``test_*.py`` module under the package directory ``root``, as dotted names (``tests.x.test_y``)."""
    top = os.path.dirname(os.path.abspath(root))
    found = []
    for directory, _, files in os.walk(root):
        for name in files:
            if name.startswith("test_") and name.endswith(".py"):
                relative = os.path.relpath(os.path.join(directory, name[:-3]), top)
                found.append(relative.replace(os.sep, "."))
    return sorted(found)


def uses_spark_session(module: str, top: str = ".") -> bool:
    """Whether the test module ``module`` (dotted, under the directory ``top``) imports :data:`SPARK_SESSION_MODULE`."""
    with open(os.path.join(top, *module.split(".")) + ".py", encoding="utf-8") as f:
        return SPARK_SESSION_MODULE in f.read()


def spark_lane_modules(modules: Iterable[str], top: str = ".") -> list[str]:
    """The modules of ``modules`` for the spark lane: those that use the session, but for :data:`MAIN_LANE`."""
    return [m for m in modules if m not in MAIN_LANE and uses_spark_session(m, top)]


def trial_runs(argv: list[str], jobs: str | None, cpus: int | None, modules: list[str] | None = None,
               session_modules: Iterable[str] = ()) -> list[tuple[str, list[str]]]:
    """The trial runs to start side by side, each as ``(lane name, trial arguments)``.

    A named subset, or a run in one process, is one run of :func:`trial_args`. The whole suite
    run by two workers or more is split into two lanes run at once, the workers shared between
    them: ``spark``, the modules of ``session_modules`` (those that use the in-process Spark
    session), and ``main``, the others. Only the spark lane's workers then start a session JVM
    and warm it, instead of every worker of the suite.

    Args:
        argv, jobs, cpus, modules: as for :func:`trial_args`.
        session_modules: the modules of ``modules`` that use the in-process Spark session.
    """
    args = trial_args(argv, jobs, cpus, modules)
    spark = [m for m in modules or () if m in set(session_modules)]
    rest = [m for m in modules or () if m not in set(spark)]
    whole_in_parallel = args[:1] == ["-j"] and modules and args[2:] == slow_first(modules)
    if not whole_in_parallel or not spark or not rest or int(args[1]) < 2:
        return [("main", args)]
    n = int(args[1])
    return [("spark", ["-j", str(n // 2), *slow_first(spark)]),
            ("main", ["-j", str(n - n // 2), *slow_first(rest)])]


def prepare_lanes_directory(temp: str) -> None:
    """Make ``temp`` the lanes' parent directory: emptied if trial made it before, and marked as trial's.

    trial refuses to reuse a directory without its marker file, so the marker lets a later run in
    one process (``scripts/test tests.x``) take ``temp`` over again.
    """
    if os.path.exists(os.path.join(temp, "_trial_marker")):
        shutil.rmtree(temp)
    os.makedirs(temp, exist_ok=True)
    with open(os.path.join(temp, "_trial_marker"), "w", encoding="utf-8"):
        pass


def slowest_report(path: str, count: int = 15) -> list[str]:
    """The slowest modules and tests of a run, from the ``SYNFLOW_TEST_TIMES`` file at ``path``.

    Each line of the file is ``test id, start, end, worker pid, CPU seconds`` (tab-separated),
    written by ``tests/__init__.py`` as each test ends.
    """
    tests: list[tuple[float, float, str]] = []
    modules: dict[str, list[float]] = {}
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                parts = line.rstrip("\n").split("\t")
                if len(parts) != 5:
                    continue
                wall, cpu = float(parts[2]) - float(parts[1]), float(parts[4])
                tests.append((wall, cpu, parts[0]))
                sums = modules.setdefault(".".join(parts[0].split(".")[:-2]), [0.0, 0.0])
                sums[0] += wall
                sums[1] += cpu
    except OSError as e:
        return [f"test times: cannot read {path}: {e.strerror}"]
    total = sum(cpu for _, cpu, _ in tests)
    lines = [f"slowest modules ({len(tests)} tests timed, {total:.0f} CPU-s in all; wall s, CPU s):"]
    lines += [f"  {w:7.1f} {c:7.1f}  {m}" for m, (w, c) in sorted(modules.items(), key=lambda kv: -kv[1][0])[:count]]
    lines.append("slowest tests (wall s, CPU s):")
    lines += [f"  {w:7.1f} {c:7.1f}  {t}" for w, c, t in sorted(tests, reverse=True)[:count]]
    return lines


def _describe(args: list[str]) -> str:
    return " ".join(args[:2]) if args[:1] == ["-j"] else "one process"


def main(argv: list[str]) -> int:
    modules = test_modules()
    runs = trial_runs(argv, os.environ.get("SYNFLOW_TEST_JOBS"), os.cpu_count(), modules,
                      spark_lane_modules(modules))
    temp = os.environ.get("SYNFLOW_TRIAL_TEMP", "_trial_temp")
    if os.environ.get("SYNFLOW_TEST_TIMES"):
        open(os.environ["SYNFLOW_TEST_TIMES"], "w", encoding="utf-8").close()
    started = time.monotonic()
    lock = threading.Lock()
    seen: dict[str, list[str]] = {name: [] for name, _ in runs}
    finished: dict[str, float] = {}
    procs = []
    if len(runs) > 1:
        prepare_lanes_directory(temp)
    for name, args in runs:
        # Each lane has its own temporary directory: one trial run at a time may use one.
        directory = temp if len(runs) == 1 else os.path.join(temp, name)
        if len(runs) > 1:
            print(f"trial lane {name}: {_describe(args)}, {len(args) - 2} modules", flush=True)
        cmd = [sys.executable, "-m", "twisted.trial", "--temp-directory", directory, *args]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1))

    def relay(name: str, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with lock:
                sys.stdout.write(line)
                sys.stdout.flush()
            if SUMMARY.match(line.strip()):
                seen[name].append(line)
        finished[name] = time.monotonic() - started

    threads = [threading.Thread(target=relay, args=(name, proc)) for (name, _), proc in zip(runs, procs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    codes = [proc.wait() for proc in procs]
    elapsed = time.monotonic() - started
    if os.environ.get("SYNFLOW_TEST_TIMES"):
        for line in slowest_report(os.environ["SYNFLOW_TEST_TIMES"]):
            print(line)
    if len(runs) == 1:
        print(f"trial phase: {elapsed:.0f} s ({_describe(runs[0][1])})")
    else:
        lanes = ", ".join(f"{name} {_describe(args)} {finished.get(name, elapsed):.0f} s" for name, args in runs)
        print(f"trial phase: {elapsed:.0f} s (-j {sum(int(args[1]) for _, args in runs)}: {lanes})")
    closing, code = summarize_runs([(seen[name], rc) for (name, _), rc in zip(runs, codes)])
    for line in closing:
        print(line)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
