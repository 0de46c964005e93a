"""The validator's checks: names, severities and the fields that identify one violation.

This module imports nothing from Spark so that the reference checker, the generator and the
tests can share it. The order of :data:`CHECKS` is the order of the report.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Severity(StrEnum):
    """How bad a violation is; ``--fail-on`` picks the lowest severity that fails the run."""

    WARNING = "warning"
    ERROR = "error"

    @property
    def rank(self) -> int:
        """A number that orders severities (higher is worse)."""
        return {"warning": 1, "error": 2}[self.value]


@dataclass(frozen=True)
class Check:
    """One check.

    Attributes:
        name: the name written in the ``check`` column.
        severity: its severity.
        key: the output columns that identify one violation (one row per distinct key).
        group: the stage that computes it.
        summary: a one-line definition, used in the report.
    """

    name: str
    severity: Severity
    key: tuple[str, ...]
    group: str
    summary: str


_TOKEN_KEY = ("stream", "reader", "seq")
_DELIVERY_KEY = ("stream", "reader", "seq", "event_id")

CHECKS: tuple[Check, ...] = (
    Check("malformed_token", Severity.ERROR, _TOKEN_KEY, "syntax",
          "the token does not parse, repeats an instance id or names an unknown one"),
    Check("noncanonical_component", Severity.WARNING, _TOKEN_KEY, "syntax",
          "a listed component is at or below the token's minimum"),
    Check("broken_chain", Severity.WARNING, _TOKEN_KEY, "syntax",
          "the request's `since` is not the reader's previous token"),
    Check("duplicate_stream_id", Severity.ERROR, ("stream", "stream_id"), "writer",
          "two facts of one stream share a stream id"),
    Check("duplicate_event_id", Severity.ERROR, ("stream", "event_id"), "writer",
          "two facts of one stream share an event id"),
    Check("invalid_interval", Severity.ERROR, ("stream", "writer", "stream_id"), "writer",
          "a fact completed before it was reserved"),
    Check("writer_sid_regression", Severity.ERROR, ("stream", "writer", "stream_id"), "writer",
          "a writer reserved a lower stream id after a higher one"),
    Check("sharding_violation", Severity.ERROR, ("stream", "room_id", "writer", "stream_id"),
          "writer", "a room was written by two writers with overlapping reservations"),
    Check("unresolved_reservation", Severity.WARNING, ("stream", "writer", "stream_id"), "writer",
          "a reservation was never completed, long before the end of the log"),
    Check("gap_skip", Severity.ERROR, ("stream", "reader", "writer", "stream_id"), "tokens",
          "a token covered a fact that was not yet completed when it was issued (data loss)"),
    Check("future_position", Severity.ERROR, _TOKEN_KEY, "tokens",
          "a token claimed a stream id nobody had allocated when it was issued"),
    Check("non_monotonic", Severity.ERROR, _TOKEN_KEY, "tokens",
          "a reader's token went backwards for some writer"),
    Check("phantom_delivery", Severity.ERROR, _DELIVERY_KEY, "delivery",
          "a delivered event id is not a fact of the stream"),
    Check("aborted_delivery", Severity.ERROR, _DELIVERY_KEY, "delivery",
          "a delivered fact was aborted"),
    Check("premature_delivery", Severity.ERROR, _DELIVERY_KEY, "delivery",
          "a fact was delivered before it completed"),
    Check("duplicate_delivery", Severity.ERROR, _DELIVERY_KEY, "delivery",
          "a reader was given one event twice"),
    Check("delivered_beyond_token", Severity.ERROR, _DELIVERY_KEY, "delivery",
          "a fact was delivered with a token that does not cover it"),
    Check("undelivered", Severity.ERROR, ("stream", "reader", "writer", "stream_id", "event_id"),
          "undelivered", "a completed fact covered by the reader's final position was never delivered"),
)

BY_NAME: dict[str, Check] = {c.name: c for c in CHECKS}
CHECK_NAMES: tuple[str, ...] = tuple(c.name for c in CHECKS)

#: Every column of a violation row, in output order.
OUTPUT_COLUMNS: tuple[str, ...] = (
    "check", "severity", "stream", "reader", "seq", "token", "prev_seq", "prev_token",
    "writer", "stream_id", "event_id", "room_id", "issued_at", "reserved_at", "completed_at",
    "claimed_pos", "expected_seq", "reason", "explanation",
)

#: Stream ids at or below this are never "in the future" (synflow's sequences start at 2).
DEFAULT_FIRST_ID = 2
#: A reservation still open this long before the end of the log is ``unresolved_reservation``.
DEFAULT_UNRESOLVED_AFTER_S = 60.0
#: Width of the time buckets of the as-of computations (a tuning knob, not a semantic one).
DEFAULT_BUCKET_S = 1.0

MAX_LONG = 2**63 - 1
MAX_INT = 2**31 - 1


def violation_key(check: str, row: dict) -> tuple:
    """The identifying tuple of a violation row (a dict with the output columns).

    Args:
        check: the check name.
        row: the row, with at least the key columns of the check.

    Returns:
        ``(check, *key values)``.
    """
    return (check, *(row.get(k) for k in BY_NAME[check].key))


def fails(severity: str, fail_on: str) -> bool:
    """Whether a violation of ``severity`` fails a run with ``--fail-on fail_on``."""
    if fail_on == "never":
        return False
    return Severity(severity).rank >= Severity(fail_on).rank
