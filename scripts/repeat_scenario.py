#!/usr/bin/env python3
"""Run a fault scenario N times in a row and report how many passed.

Each repetition runs every named test once, in order, each in a fresh
``python -m twisted.trial`` with ``CI=true`` (so a missing service fails
rather than skips) and a temporary directory of its own. The scenario's
``fault-result`` line is echoed after each run. The first failure stops the
loop; its output is kept and its path printed. The last line is
``k/N passed`` (k repetitions passed, N asked for); the exit status is 0
only when all N passed.

Usage: python scripts/repeat_scenario.py [--count N] [--timeout S] [TEST ...]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The SIGKILL-a-persister scenario, on both deployments of the fault suite.
DEFAULT_TESTS = (
    "tests.integration.test_faults.SqliteTcpFaultTest.test_sigkill_persister",
    "tests.integration.test_faults.PostgresRedisFaultTest.test_sigkill_persister",
)
_RAN = re.compile(r"^Ran (\d+) tests? in ", re.MULTILINE)


def run_once(test: str, timeout: float) -> tuple[bool, str, str]:
    """Run ``test`` once under trial; return (passed, its output, its temporary directory)."""
    workdir = tempfile.mkdtemp(prefix="synflow-repeat-")
    env = dict(os.environ, CI="true", SPARK_LOCAL_IP=os.environ.get("SPARK_LOCAL_IP", "127.0.0.1"))
    cmd = [sys.executable, "-m", "twisted.trial", "--temp-directory", os.path.join(workdir, "trial"), test]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        output, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        output += f"\n(timed out after {timeout:.0f}s)"
        code = -1
    ran = _RAN.search(output)
    passed = code == 0 and ran is not None and int(ran.group(1)) > 0 and "PASSED" in output
    with open(os.path.join(workdir, "output.txt"), "w", encoding="utf-8") as f:
        f.write(output)
    return passed, output, workdir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tests", nargs="*", default=list(DEFAULT_TESTS), help="trial test names")
    parser.add_argument("--count", type=int, default=20, help="repetitions (default 20)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds allowed per test run")
    args = parser.parse_args(argv)
    if args.count < 1:
        parser.error("--count must be at least 1")
    passed = 0
    for n in range(1, args.count + 1):
        ok = True
        for test in args.tests:
            started = time.monotonic()
            ok, output, workdir = run_once(test, args.timeout)
            took = time.monotonic() - started
            print(f"run {n}/{args.count} {test}: {'PASSED' if ok else 'FAILED'} in {took:.0f}s", flush=True)
            for line in output.splitlines():
                if line.startswith("fault-result "):
                    print(f"  {line}", flush=True)
            if not ok:
                print(output[-6000:])
                print(f"stopped at the first failure; output and logs kept in {workdir}", flush=True)
                break
            shutil.rmtree(workdir, ignore_errors=True)
        if not ok:
            break
        passed += 1
    print(f"{passed}/{args.count} passed", flush=True)
    return 0 if passed == args.count else 1


if __name__ == "__main__":
    sys.exit(main())
