"""systemd readiness notification (``Type=notify``), without libsystemd.

When systemd starts a unit with ``Type=notify`` it sets ``NOTIFY_SOCKET`` to
a Unix datagram socket (a path, or an abstract name written ``@name``) and
waits for ``READY=1`` before it counts the unit as started and starts the
units ordered after it. :class:`SystemdNotifier` sends ``READY=1`` once the
process's health check has no problem left -- the moment ``/health`` would
answer 200 -- and ``STOPPING=1`` when the process begins to stop. Without
``NOTIFY_SOCKET`` it does nothing. Internal: the process bootstrap adds it.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable

from twisted.application.service import Service
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall

logger = logging.getLogger(__name__)

__all__ = ["SystemdNotifier", "notify"]

#: How often the health check is polled until the process is ready.
POLL_INTERVAL_S = 0.2


def notify(socket_path: str, message: str) -> bool:
    """Send one sd_notify datagram (``KEY=value`` lines); False if it could not be sent."""
    address = "\0" + socket_path[1:] if socket_path.startswith("@") else socket_path
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(message.encode("utf-8"), address)
    except OSError as e:
        logger.warning("could not notify systemd at %s: %s", socket_path, e)
        return False
    return True


class SystemdNotifier(Service):
    """Tells systemd the process is ready once ``problems()`` is empty, and when it stops.

    Args:
        problems: the process's health check (what ``/health`` reports).
        clock: schedules the polling.
        socket_path: ``$NOTIFY_SOCKET``; None disables the notifier.
    """

    def __init__(self, problems: Callable[[], list[str]], clock: IReactorTime, socket_path: str | None) -> None:
        self._problems = problems
        self._socket = socket_path or None
        self._poll = LoopingCall(self._check)
        self._poll.clock = clock
        self.ready = False

    def startService(self) -> None:
        super().startService()
        if self._socket is not None:
            self._poll.start(POLL_INTERVAL_S, now=True)

    def _check(self) -> None:
        problems = self._problems()
        if problems:
            return
        self._poll.stop()
        assert self._socket is not None
        self.ready = notify(self._socket, f"READY=1\nSTATUS=healthy\nMAINPID={os.getpid()}")

    def stopService(self) -> None:
        if self._poll.running:
            self._poll.stop()
        if self._socket is not None:
            notify(self._socket, "STOPPING=1\nSTATUS=stopping")
        super().stopService()
