"""scripts/_venv.sh: a half-made virtualenv is rebuilt, a missing venv module is named in one line."""

from __future__ import annotations

import os
import subprocess
import sys

from twisted.trial.unittest import SynchronousTestCase

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))

#: Stands in for a python3 whose venv module is broken (as on Debian without
#: python3-venv): ``-m venv DIR`` leaves DIR/bin/python and no activate script.
BROKEN_VENV_PYTHON = f"""#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then mkdir -p "$3/bin"; ln -sf {sys.executable} "$3/bin/python"; exit 1; fi
exec {sys.executable} "$@"
"""


class VenvScriptTest(SynchronousTestCase):
    def run_script(self, venv: str, python: str) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, SYNFLOW_VENV=venv, PYTHON=python, SYNFLOW_EXTRAS="")
        return subprocess.run(["bash", "-c", ". scripts/_venv.sh"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)

    def broken_python(self) -> str:
        path = os.path.abspath(self.mktemp())
        with open(path, "w") as f:
            f.write(BROKEN_VENV_PYTHON)
        os.chmod(path, 0o755)
        return path

    def test_half_made_venv_is_rebuilt(self):
        """A virtualenv without bin/activate is removed and made again, not sourced."""
        venv = os.path.abspath(self.mktemp())
        os.makedirs(os.path.join(venv, "bin"))
        with open(os.path.join(venv, "bin", "python"), "w") as f:
            f.write("")
        result = self.run_script(venv, self.broken_python())
        self.assertIn("half-made", result.stdout)
        self.assertIn("creating virtualenv", result.stdout)

    def test_failed_venv_names_the_package_and_leaves_nothing(self):
        """When ``python -m venv`` fails half-way, one line names python3-venv and no half-made directory is left."""
        venv = os.path.abspath(self.mktemp())
        result = self.run_script(venv, self.broken_python())
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        self.assertEqual(len(result.stderr.strip().splitlines()), 1, result.stderr)
        self.assertIn("apt-get install python3-venv", result.stderr)
        self.assertFalse(os.path.exists(venv))

    def test_old_python_refused(self):
        """A Python older than 3.11 stops the script in one line naming the version needed."""
        path = os.path.abspath(self.mktemp())
        with open(path, "w") as f:
            f.write("#!/bin/sh\nif [ \"$1\" = \"-c\" ]; then case \"$2\" in *version_info*) exit 1;; "
                    "*python_version*) echo 3.9.2; exit 0;; esac; fi\nexit 1\n")
        os.chmod(path, 0o755)
        result = self.run_script(os.path.abspath(self.mktemp()), path)
        self.assertEqual(result.returncode, 1)
        self.assertIn("needs Python 3.11 or newer", result.stderr)
        self.assertIn("3.9.2", result.stderr)
