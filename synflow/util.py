"""Small Deferred helpers shared across synflow.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

from typing import Any, TypeVar

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.python.failure import Failure

T = TypeVar("T")


def observe(shared: Deferred[T]) -> Deferred[T]:
    """A new Deferred with ``shared``'s result, leaving ``shared``'s chain untouched."""
    follower: Deferred[T] = Deferred()

    def relay(result: Any) -> Any:
        if isinstance(result, Failure):
            follower.errback(result)
        else:
            follower.callback(result)
        return result

    shared.addBoth(relay)
    return follower


def sleep(clock: IReactorTime, seconds: float) -> Deferred[None]:
    """Fires after ``seconds`` on ``clock``."""
    if seconds <= 0:
        return succeed(None)
    d: Deferred[None] = Deferred()
    clock.callLater(seconds, d.callback, None)
    return d


def cancel_timer_when_done(d: Deferred[T], call: IDelayedCall) -> Deferred[T]:
    """Cancel ``call`` (a timeout) once ``d`` fires."""

    def cancel(result: Any) -> Any:
        if call.active():
            call.cancel()
        return result

    d.addBoth(cancel)
    return d
