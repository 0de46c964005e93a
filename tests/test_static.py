"""The code passes the project's linter (ruff) and type checker (mypy).

Both are part of the ``lint`` extra that ``scripts/test`` installs, so they
run with the suite (and therefore in CI). Outside CI a missing tool skips
with its reason; under ``CI=true`` it fails.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

from twisted.trial import unittest

from tests.services import unavailable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: The paths ruff checks, as in tox.ini's ``lint`` environment.
RUFF_PATHS = ["synflow", "tests", "spark", "scripts", "twisted", "examples"]


def _run_tool(module: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec(module) is None:
        raise unavailable(f"{module} is not installed (pip install -e '.[lint]')")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)


class StaticChecksTest(unittest.TestCase):
    def test_ruff(self) -> None:
        proc = _run_tool("ruff", ["check", "--no-cache", *RUFF_PATHS])
        self.assertEqual(proc.returncode, 0, f"ruff found problems:\n{proc.stdout}{proc.stderr}")

    def test_mypy(self) -> None:
        proc = _run_tool("mypy", [])  # files and options come from pyproject.toml
        self.assertEqual(proc.returncode, 0, f"mypy found problems:\n{proc.stdout}{proc.stderr}")
        self.assertIn("Success", proc.stdout)
