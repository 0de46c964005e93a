#!/usr/bin/env python3
"""Run synflow's trial suite and end with a closing line CI harnesses read.

trial's own summary (``PASSED (successes=N)``) is printed as usual; after it
this wrapper prints ``N passed, N failed, N skipped`` and exits non-zero if
anything failed, if trial printed no summary, or if no test ran at all.

Usage: python scripts/run_tests.py [trial options] [test modules...]
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
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
    summary = None
    for line in output:
        match = SUMMARY.match(line.strip())
        if match:
            summary = match
    if summary is None:
        return [f"trial printed no summary (exit code {returncode})", "0 passed, 1 failed"], 1
    counts: dict[str, int] = {}
    for part in (summary.group(2) or "").split(","):
        if "=" in part:
            key, _, value = part.strip().partition("=")
            counts[key] = int(value)
    passed = counts.get("successes", 0) + counts.get("expectedFailures", 0)
    failed = counts.get("failures", 0) + counts.get("errors", 0) + counts.get("unexpectedSuccesses", 0)
    skipped = counts.get("skips", 0)
    lines = [f"{passed} passed, {failed} failed, {skipped} skipped"]
    if passed + failed == 0:
        return ["no test ran", *lines], 1
    return lines, 0 if failed == 0 and returncode == 0 and summary.group(1) == "PASSED" else 1


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


def main(argv: list[str]) -> int:
    args = trial_args(argv, os.environ.get("SYNFLOW_TEST_JOBS"), os.cpu_count(), test_modules())
    cmd = [sys.executable, "-m", "twisted.trial", "--temp-directory", os.environ.get("SYNFLOW_TRIAL_TEMP", "_trial_temp"), *args]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    assert proc.stdout is not None
    seen: list[str] = []
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        if SUMMARY.match(line.strip()):
            seen.append(line)
    rc = proc.wait()
    print(f"trial phase: {time.monotonic() - started:.0f} s ({' '.join(args[:2]) if args[:1] == ['-j'] else 'one process'})")
    closing, code = summarize(seen, rc)
    for line in closing:
        print(line)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
