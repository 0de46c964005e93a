"""Size limits every layer shares.

The replication line limit bounds what a stream row may be: a writer that
records a row checks it against the limit here, so no layer above the wire
needs to import the replication package to know it.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

from typing import Final

__all__ = ["MAX_LINE_LENGTH"]

#: Longest replication line accepted or sent, in bytes of UTF-8, excluding the newline.
MAX_LINE_LENGTH: Final = 16 * 1024
