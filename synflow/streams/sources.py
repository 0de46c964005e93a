"""The old home of :class:`~synflow.storage.sources.DatabaseSource`.

Catch-up sources read the database, so they live in the storage layer
(:mod:`synflow.storage.sources`). The old names resolve from there on first
use (so importing the streams package never imports storage) only until
``synflow.testing.conformance`` imports them from their new home; then this
module goes. New code imports from :mod:`synflow.storage.sources`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from synflow.storage.sources import PAGE_ROWS, DatabaseSource, Updates

__all__ = ["PAGE_ROWS", "DatabaseSource", "Updates"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from synflow.storage import sources

        return getattr(sources, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
