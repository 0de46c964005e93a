#!/usr/bin/env python3
"""Run synflow's trial suite and end with a closing line CI harnesses read.

trial's own summary (``PASSED (successes=N)``) is printed as usual; after it
this wrapper prints ``N passed, N failed, N skipped`` and exits non-zero if
anything failed or if no test ran at all.

Usage: python scripts/run_tests.py [trial options] [test modules...]
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

SUMMARY = re.compile(r"^(PASSED|FAILED) \((.*)\)\s*$")


def main(argv: list[str]) -> int:
    args = argv or ["tests"]
    cmd = [sys.executable, "-m", "twisted.trial", "--temp-directory", os.environ.get("SYNFLOW_TRIAL_TEMP", "_trial_temp"), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    assert proc.stdout is not None
    summary = None
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        match = SUMMARY.match(line.strip())
        if match:
            summary = match
    rc = proc.wait()
    if summary is None:
        print(f"trial printed no summary (exit code {rc})")
        print("0 passed, 1 failed")
        return 1
    counts = {}
    for part in summary.group(2).split(","):
        if "=" in part:
            key, _, value = part.strip().partition("=")
            counts[key] = int(value)
    passed = counts.get("successes", 0) + counts.get("expectedFailures", 0)
    failed = counts.get("failures", 0) + counts.get("errors", 0) + counts.get("unexpectedSuccesses", 0)
    skipped = counts.get("skips", 0)
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    if passed + failed == 0:
        return 1
    return 0 if failed == 0 and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
