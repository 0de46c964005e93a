"""Federation: sending events to remote servers, and receiving theirs.

* :mod:`~synflow.federation.policy` -- the pure rules (bounds, retry state,
  vector-clock positions), tested with hypothesis;
* :mod:`~synflow.federation.interfaces` -- the values and store/transport
  protocols the lead process implements;
* :mod:`~synflow.federation.queue` -- one destination's queue: transactions,
  backoff, catch-up;
* :mod:`~synflow.federation.sender` -- the queues this sender instance owns,
  the periodic wake-up, ``REMOTE_SERVER_UP``;
* :mod:`~synflow.federation.transport` -- ``/send`` over treq;
* :mod:`~synflow.federation.inbound` -- inbound ``/send`` validation,
  dedupe and the twisted.web resource;
* :mod:`~synflow.federation.keys`, :mod:`~synflow.federation.signing`,
  :mod:`~synflow.federation.keyring`, :mod:`~synflow.federation.auth` --
  server keys, signed requests, remote keys, and the gate every inbound
  federation request passes;
* :mod:`~synflow.federation.addresses` -- the outbound address policy
  (``federation.ip_range_blacklist``);
* :mod:`~synflow.federation.metrics` -- the Prometheus metrics.

See ``docs/federation.md``.

Internal to synflow: not part of the public API (``synflow.api``).
"""
