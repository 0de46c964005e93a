"""Small services shared by every process type.

* :class:`ListeningService` -- an HTTP or hub listener that exposes its port;
* :class:`DatabaseProbe` -- a periodic ``SELECT 1`` whose last outcome
  ``/health`` reports.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

from typing import Any

from twisted.application.service import Service
from twisted.internet.defer import Deferred, succeed
from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IDelayedCall, IListeningPort, IReactorTime
from twisted.internet.protocol import Factory
from twisted.internet.task import LoopingCall
from twisted.python.failure import Failure

#: How often every process checks that its database answers.
DB_PROBE_INTERVAL_S = 5.0
#: How long ``SELECT 1`` may take before the database counts as unreachable.
DB_PROBE_TIMEOUT_S = 3.0


class ListeningService(Service):
    """Listens on a Twisted server endpoint description while running.

    Unlike ``StreamServerEndpointService`` it exposes the bound port (useful
    with port 0) and fails start-up loudly if the port cannot be bound.

    Args:
        reactor: the reactor to listen with.
        description: a server endpoint string, e.g. ``tcp:8008:interface=127.0.0.1``.
        factory: the protocol factory.
    """

    def __init__(self, reactor: Any, description: str, factory: Factory) -> None:
        self.reactor = reactor
        self.description = description
        self.factory = factory
        self.port: IListeningPort | None = None
        self._listening: Deferred[IListeningPort] | None = None
        self._failure: Failure | None = None

    def startService(self) -> None:
        super().startService()
        endpoint = serverFromString(self.reactor, self.description)
        self._listening = endpoint.listen(self.factory)
        self._listening.addCallbacks(self._bound, self._not_bound)

    def _bound(self, port: IListeningPort) -> IListeningPort:
        self.port = port
        return port

    def _not_bound(self, failure: Failure) -> None:
        # Kept for when_listening (start-up awaits it), not left unhandled in the Deferred.
        self._failure = failure

    def when_listening(self) -> Deferred[IListeningPort]:
        """A Deferred firing with the listening port once it is bound, or failing as the bind did."""
        if self.port is not None:
            return succeed(self.port)
        assert self._listening is not None, "service not started"
        d: Deferred[IListeningPort] = Deferred()

        def relay(_: Any) -> None:
            if self.port is not None:
                d.callback(self.port)
            else:
                d.errback(self._failure)

        self._listening.addBoth(relay)
        return d

    @property
    def bound_port(self) -> int:
        """The TCP port number actually bound (after start-up)."""
        assert self.port is not None, "not listening yet"
        port: int = self.port.getHost().port  # type: ignore[attr-defined]
        return port

    def stopService(self) -> Deferred[None] | None:
        super().stopService()
        if self.port is not None:
            port, self.port = self.port, None
            return port.stopListening()
        return None


def _select_one_txn(txn: Any) -> None:
    txn.execute("SELECT 1")
    txn.fetchall()


class DatabaseProbe(Service):
    """Runs ``SELECT 1`` every ``interval_s`` and remembers whether it answered.

    :attr:`problem` is None while the database answers, else one line for
    ``/health``: ``database unreachable: <error>`` when the query failed, or
    when it has not answered within ``timeout_s`` (a probe still waiting is
    not repeated; its late answer clears the problem).

    Args:
        db: the process's :class:`~synflow.storage.engines.Database` (anything
            with ``run_interaction``).
        clock: schedules the probes and the timeout.
        interval_s: time between probes.
        timeout_s: how long a probe may take.
    """

    def __init__(self, db: Any, clock: IReactorTime, *, interval_s: float = DB_PROBE_INTERVAL_S,
                 timeout_s: float = DB_PROBE_TIMEOUT_S) -> None:
        self.db = db
        self.clock = clock
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.problem: str | None = None
        self._loop: LoopingCall | None = None
        self._waiting: IDelayedCall | None = None
        self._in_flight: Deferred[Any] | None = None

    def startService(self) -> None:
        super().startService()
        self._loop = LoopingCall(self.probe)
        self._loop.clock = self.clock
        self._loop.start(self.interval_s, now=True)

    def stopService(self) -> Deferred[None]:
        super().stopService()
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None
        if self._waiting is not None and self._waiting.active():
            self._waiting.cancel()
        in_flight = self._in_flight
        if in_flight is None:
            return succeed(None)
        # Let a probe in flight finish before the database closes.
        done: Deferred[None] = Deferred()

        def finished(result: Any) -> Any:
            done.callback(None)
            return result

        in_flight.addBoth(finished)
        return done

    def probe(self) -> None:
        """Start one ``SELECT 1`` unless the previous one is still waiting."""
        if self._in_flight is not None:
            return
        self._waiting = self.clock.callLater(self.timeout_s, self._timed_out)
        try:
            d: Deferred[Any] = self.db.run_interaction("health_select_1", _select_one_txn, read_only=True)
        except Exception:
            d = Deferred()
            d.errback(Failure())
        self._in_flight = d
        d.addCallbacks(self._answered, self._failed)

    def _timed_out(self) -> None:
        self._waiting = None
        self.problem = f"database unreachable: no answer to SELECT 1 within {self.timeout_s:g}s"

    def _settle(self) -> None:
        self._in_flight = None
        if self._waiting is not None and self._waiting.active():
            self._waiting.cancel()
        self._waiting = None

    def _answered(self, _: Any) -> None:
        self._settle()
        self.problem = None

    def _failed(self, failure: Failure) -> None:
        self._settle()
        error = " ".join(str(failure.value).split())
        self.problem = f"database unreachable: {type(failure.value).__name__}: {error}"
