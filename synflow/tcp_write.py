"""A write to a TCP connection that goes to the socket at once when nothing is queued before it.

twisted's TCP transport queues every ``write`` until the reactor's next
pass finds the socket writable: for a connection that writes one message
and then waits for the answer (an HTTP response, an RPC request, a batch
of replication lines), each write costs two ``epoll_ctl`` calls (start and
stop watching for writability), a further turn of the reactor loop and a
copy, and leaves a turn later than it could. :func:`write_now` sends what
the socket takes straight away, as asyncio's transports do, when the
transport holds nothing unsent; what the socket does not take, and every
other kind of transport (TLS, a test transport), go through
``transport.write`` as before, so the order of the bytes, the transport's
buffer limits and its producer's pausing are unchanged.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

from typing import Any

from twisted.internet import tcp

__all__: list[str] = []

#: The transports of plain TCP connections, accepted and made: exactly these types (a subclass may buffer).
_TCP = (tcp.Server, tcp.Client)


def write_now(transport: Any, data: bytes) -> None:
    """``transport.write(data)``, with what the socket takes sent now if nothing is queued before ``data``."""
    if type(transport) in _TCP and data:
        try:
            idle = (transport.connected and not transport._writeDisconnected and not transport._tempDataBuffer
                    and transport.offset == len(transport.dataBuffer))
        except AttributeError:  # a Twisted that keeps its write buffer otherwise: its own write, as before
            idle = False
        if idle:
            try:
                sent = transport.socket.send(data)
            except OSError:
                # The socket would block (it is full), or the connection broke: queued as before, where the
                # transport's own write finds and reports whatever is wrong.
                sent = 0
            if sent == len(data):
                return
            data = data[sent:]
    transport.write(data)
