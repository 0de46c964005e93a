#!/usr/bin/env python3
"""A plain federation receiver for integration tests: it records what it is sent and never pulls.

It serves ``PUT /_matrix/federation/v1/send/{txnId}`` on ``--port``
(loopback) and appends one JSON line per accepted transaction to ``--out``:
``{"txn_id", "origin", "pdus": [...], "edus": [...]}``, flushed before the
200 reply (``{"pdus": {event_id: {}}}``) is written. ``--fail-first N``
answers 500 to the first N transactions this process receives, recording
nothing for them. It has no ``get_missing_events`` client: an event it is
not sent, it never has. Anything else is 404. It runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from twisted.internet import reactor
from twisted.web.resource import Resource
from twisted.web.server import Site


class Recorder(Resource):
    """The ``/send`` endpoint: record, then answer 200 (or 500 for the first ``fail_first``)."""

    isLeaf = True

    def __init__(self, out: str, fail_first: int) -> None:
        super().__init__()
        self.out = open(out, "a", encoding="utf-8")
        self.fail_first = fail_first
        self.received = 0

    def render_PUT(self, request: Any) -> bytes:
        request.setHeader(b"Content-Type", b"application/json")
        if not request.path.startswith(b"/_matrix/federation/v1/send/"):
            request.setResponseCode(404)
            return b'{"errcode":"M_UNRECOGNIZED","error":"not here"}'
        self.received += 1
        if self.received <= self.fail_first:
            request.setResponseCode(500)
            return b'{"errcode":"M_UNKNOWN","error":"injected failure"}'
        body = json.loads(request.content.read())
        txn_id = request.path.rsplit(b"/", 1)[-1].decode()
        record = {"txn_id": txn_id, "origin": body.get("origin"), "pdus": body.get("pdus", []),
                  "edus": body.get("edus", [])}
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()
        return json.dumps({"pdus": {p["event_id"]: {} for p in record["pdus"]}}).encode()

    def render_POST(self, request: Any) -> bytes:
        request.setResponseCode(404)
        request.setHeader(b"Content-Type", b"application/json")
        return b'{"errcode":"M_UNRECOGNIZED","error":"not here"}'


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--fail-first", type=int, default=0)
    args = parser.parse_args(argv)
    site = Site(Recorder(args.out, args.fail_first))
    site.noisy = False
    reactor.listenTCP(args.port, site, interface="127.0.0.1")  # type: ignore[attr-defined]
    reactor.run()  # type: ignore[attr-defined]


if __name__ == "__main__":
    main(sys.argv[1:])
