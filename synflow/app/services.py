"""Small services shared by every process type."""

from __future__ import annotations

from typing import Any

from twisted.application.service import Service
from twisted.internet.defer import Deferred, succeed
from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IListeningPort
from twisted.internet.protocol import Factory


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

    def startService(self) -> None:
        super().startService()
        endpoint = serverFromString(self.reactor, self.description)
        self._listening = endpoint.listen(self.factory)
        self._listening.addCallback(self._bound)

    def _bound(self, port: IListeningPort) -> IListeningPort:
        self.port = port
        return port

    def when_listening(self) -> Deferred[IListeningPort]:
        """A Deferred firing with the listening port once it is bound."""
        if self.port is not None:
            return succeed(self.port)
        assert self._listening is not None, "service not started"
        d: Deferred[IListeningPort] = Deferred()

        def relay(result: Any) -> Any:
            d.callback(result)
            return result

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
