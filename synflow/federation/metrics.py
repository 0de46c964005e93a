"""Prometheus metrics of the federation sender and receiver.

Per destination (gauges read from the queue at scrape time):

* ``synflow_federation_pending_pdus{destination}`` -- PDUs queued;
* ``synflow_federation_pending_edus{destination}`` -- EDUs queued;
* ``synflow_federation_in_flight{destination}`` -- 1 while a transaction is in flight;
* ``synflow_federation_backing_off{destination}`` -- 1 while the destination is in backoff;
* ``synflow_federation_backoff_interval_seconds{destination}`` -- the current retry interval;
* ``synflow_federation_catching_up{destination}`` -- 1 in catch-up mode.

Totals (counters, no destination label, so cardinality stays bounded):

* ``synflow_federation_pdus_sent_total{mode}`` -- ``mode`` is ``queue`` or ``catch_up``;
* ``synflow_federation_edus_sent_total``;
* ``synflow_federation_transactions_sent_total``;
* ``synflow_federation_transactions_failed_total{retriable}``;
* ``synflow_federation_pdus_failed_total`` / ``synflow_federation_edus_failed_total``
  -- PDUs / EDUs carried by failed attempts (a transaction retried three
  times counts its PDUs three times);
* ``synflow_federation_catch_up_entered_total``;
* ``synflow_federation_catch_ups_total{mode}`` -- catch-ups begun, by what
  they send: ``every_event`` or ``latest_per_room`` (past
  ``catch_up_max_events``);
* ``synflow_federation_missing_events_pulled_total{outcome}`` -- events the
  receiver pulled with ``get_missing_events`` (``persisted``, ``refused``),
  and ``synflow_federation_missing_events_requests_total{outcome}``
  (``ok``, ``failed``, ``gap_left``: the gap was larger than the bound);
* ``synflow_federation_missing_events_served_total`` -- events served to
  remote servers' ``get_missing_events``;
* ``synflow_federation_transaction_seconds`` -- a histogram of round trips;
* ``synflow_federation_inbound_transactions_total{outcome}`` -- ``accepted``,
  ``duplicate``, ``rejected`` or ``retry`` (answered 503: a PDU could not be
  persisted now).

EDU counters label the EDU type only from :data:`KNOWN_EDU_TYPES`; any other
type (a remote server chooses it) is counted as ``other`` (:func:`edu_type_label`),
so no input can grow the number of series.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

from synflow.metrics import counter, gauge, histogram

PENDING_PDUS = gauge("synflow_federation_pending_pdus", "PDUs queued per destination", ["destination"])
PENDING_EDUS = gauge("synflow_federation_pending_edus", "EDUs queued per destination", ["destination"])
IN_FLIGHT = gauge(
    "synflow_federation_in_flight", "1 while a transaction to the destination is in flight", ["destination"]
)
BACKING_OFF = gauge(
    "synflow_federation_backing_off", "1 while the destination is in backoff", ["destination"]
)
BACKOFF_INTERVAL = gauge(
    "synflow_federation_backoff_interval_seconds", "Current retry interval per destination", ["destination"]
)
CATCHING_UP = gauge(
    "synflow_federation_catching_up", "1 while the destination is in catch-up mode", ["destination"]
)

#: Every per-destination gauge (the sender registers and removes its queues' children).
PER_DESTINATION = (PENDING_PDUS, PENDING_EDUS, IN_FLIGHT, BACKING_OFF, BACKOFF_INTERVAL, CATCHING_UP)

PDUS_SENT = counter("synflow_federation_pdus_sent_total", "PDUs sent in successful transactions", ["mode"])
EDUS_SENT = counter("synflow_federation_edus_sent_total", "EDUs sent in successful transactions")
TRANSACTIONS_SENT = counter("synflow_federation_transactions_sent_total", "Successful /send transactions")
TRANSACTIONS_FAILED = counter(
    "synflow_federation_transactions_failed_total", "Failed /send transactions", ["retriable"]
)
PDUS_FAILED = counter("synflow_federation_pdus_failed_total", "PDUs carried by failed /send attempts")
EDUS_FAILED = counter("synflow_federation_edus_failed_total", "EDUs carried by failed /send attempts")
CATCH_UP_ENTERED = counter(
    "synflow_federation_catch_up_entered_total", "Times a destination's queue was dropped for catch-up"
)
CATCH_UPS = counter("synflow_federation_catch_ups_total", "Catch-ups begun, by what they send", ["mode"])
MISSING_EVENTS_PULLED = counter(
    "synflow_federation_missing_events_pulled_total", "Events pulled with get_missing_events", ["outcome"]
)
MISSING_EVENTS_REQUESTS = counter(
    "synflow_federation_missing_events_requests_total", "Gaps the receiver tried to fill", ["outcome"]
)
MISSING_EVENTS_SERVED = counter(
    "synflow_federation_missing_events_served_total", "Events served to get_missing_events requests"
)
TRANSACTION_SECONDS = histogram(
    "synflow_federation_transaction_seconds",
    "Round trip of /send transactions",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
INBOUND_TRANSACTIONS = counter(
    "synflow_federation_inbound_transactions_total", "Inbound /send transactions by outcome", ["outcome"]
)


#: The EDU types that get their own metric label; every other type is ``other``.
KNOWN_EDU_TYPES = frozenset({
    "m.typing", "m.receipt", "m.presence", "m.device_list_update", "m.direct_to_device",
    "m.signing_key_update",
})


def edu_type_label(edu_type: object) -> str:
    """The metric label for an EDU type: itself if known, else ``other`` (a fixed set)."""
    return edu_type if isinstance(edu_type, str) and edu_type in KNOWN_EDU_TYPES else "other"
