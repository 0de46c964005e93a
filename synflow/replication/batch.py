"""One write per connection for the lines a process sends during one unit of work.

A hub relays each line it reads to every other connection, and a writer
announces each committed row as its own RDATA. One ``transport.write`` per
connection per unit of work -- one read, one announcement -- rather than one
per line is most of the difference to a bare relay. While the batch is open,
each TCP connection gathers the lines it sends (``protocol.py``); when the
outermost ``with write_batch:`` closes, every connection that gathered any
writes them, in the order sent. Nothing waits for the reactor: the lines are
written before the ``with`` block returns. Transports that batch on their own
(Redis, once per reactor turn) do not look at it.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

from typing import Any, Final, Protocol


class _Gatherer(Protocol):
    def flush_gathered(self) -> None:
        """Write the lines gathered while the batch was open."""


class WriteBatch:
    """Nested units of work; connections register here when they gather their first line."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending: list[_Gatherer] = []

    def __enter__(self) -> WriteBatch:
        self.depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        self.depth -= 1
        if not self.depth:
            self.flush()  # also after an error: what was sent goes out

    def flush(self) -> None:
        """Write what every gathering connection holds (a flush may send more: loop until none)."""
        while self.pending:
            pending, self.pending = self.pending, []
            for conn in pending:
                conn.flush_gathered()


#: The process's batch: the reactor runs one unit of work at a time.
write_batch: Final = WriteBatch()

__all__ = ["WriteBatch", "write_batch"]
