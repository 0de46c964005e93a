"""free_port: a port handed out by one live process is not handed out by another."""

from __future__ import annotations

import os
import subprocess
import sys

from twisted.trial.unittest import TestCase

from synflow.tools import deploy

CHILD = (
    "import sys\n"
    "from synflow.tools.deploy import free_port\n"
    "print(free_port(), flush=True)\n"
    "sys.stdin.read()\n"
)


class FreePortTest(TestCase):
    def setUp(self) -> None:
        self.dir = os.path.abspath(self.mktemp())
        self.patch(deploy, "PORT_LOCKS_DIR", os.path.join(self.dir, "synflow-ports"))
        self.patch(deploy, "_reservations", {})
        self.addCleanup(self._release)

    def _release(self) -> None:
        for fd in deploy._reservations.values():
            os.close(fd)

    def child(self) -> tuple[subprocess.Popen[str], int]:
        """A process that hands out a port with the same lock directory and keeps living."""
        os.makedirs(self.dir, exist_ok=True)
        proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, env={**os.environ, "TMPDIR": self.dir})
        self.addCleanup(proc.wait)
        self.addCleanup(proc.stdin.close)  # type: ignore[union-attr]
        port = int(proc.stdout.readline())  # type: ignore[union-attr]
        return proc, port

    def test_a_port_another_live_process_handed_out_is_skipped(self) -> None:
        proc, port = self.child()
        self.assertFalse(deploy._reserve(port))
        picks = iter([port, port, port + 1 if port + 1 < deploy.FREE_PORT_RANGE[1] else port - 1])
        self.patch(deploy._random, "randrange", lambda low, high: next(picks))
        self.patch(deploy, "_HANDED_OUT", set())
        self.patch(deploy, "_ephemeral_low", lambda: 32768)  # the random range, as on Linux's defaults
        self.assertNotEqual(deploy.free_port(), port)
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait()
        self.assertTrue(deploy._reserve(port))  # its process is gone: the mark went with it

    def test_reservations_are_bounded(self) -> None:
        self.patch(deploy, "_MAX_RESERVATIONS", 3)
        for port in range(25000, 25006):
            self.assertTrue(deploy._reserve(port))
            self.assertLessEqual(len(deploy._reservations), 3)
        self.assertEqual(list(deploy._reservations), [25003, 25004, 25005])

    def test_no_lock_directory_means_no_marks(self) -> None:
        blocker = os.path.join(self.dir, "file")
        os.makedirs(self.dir, exist_ok=True)
        with open(blocker, "w"):
            pass
        self.patch(deploy, "PORT_LOCKS_DIR", os.path.join(blocker, "synflow-ports"))  # under a file: cannot exist
        self.assertTrue(deploy._reserve(25000))
        self.assertEqual(deploy._reservations, {})


