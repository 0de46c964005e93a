"""Domain refusals at the HTTP edge: the one table from refusal to status, in JsonResource and over the internal RPC."""

from __future__ import annotations

from typing import Any

from treq.testing import StubTreq
from twisted.trial.unittest import SynchronousTestCase

from synflow.errors import (
    BadEvent,
    Conflict,
    Forbidden,
    NotFound,
    NotStored,
    PersistRefused,
    WrongPersister,
)
from synflow.events.persist import PersistResult
from synflow.events.router import result_from_json, result_to_json
from synflow.http.server import JsonResource, http_error, refusal_from_status, refusal_status


class RefusalStatusTest(SynchronousTestCase):
    def test_each_kind_has_its_status(self) -> None:
        """Each refusal kind maps to the status clients have always seen; a subclass takes its base's."""
        cases = [(BadEvent, 400), (Forbidden, 403), (NotFound, 404), (Conflict, 409), (NotStored, 500),
                 (PersistRefused, 400)]
        for cls, status in cases:
            self.assertEqual(refusal_status(cls("M_X", "why")), status, cls.__name__)
        self.assertEqual(refusal_status(WrongPersister("!r:hs", "p2", "p1")), 409)

    def test_http_error_keeps_errcode_message_and_extra(self) -> None:
        """The HTTP error carries the refusal's errcode, message and extra fields (the owner of a room)."""
        error = http_error(WrongPersister("!r:hs", "p2", "p1"))
        self.assertEqual((error.code, error.errcode, error.extra), (409, "M_WRONG_PERSISTER", {"owner": "p2"}))
        self.assertEqual(error.msg, "room !r:hs belongs to event persister 'p2', not 'p1'")

    def test_result_round_trips_the_rpc_wire(self) -> None:
        """A persist result crosses the internal RPC as ``[status, errcode, message]`` and comes back the same kind."""
        refused = PersistResult(None, None, "p1", Forbidden("M_FORBIDDEN", "not joined"))
        wire = result_to_json(refused)
        self.assertEqual(wire, {"event_id": None, "stream_ordering": None, "instance_name": "p1",
                                "error": [403, "M_FORBIDDEN", "not joined"], "duplicate": False})
        back = result_from_json(wire)
        assert back.error is not None
        self.assertIsInstance(back.error, Forbidden)
        self.assertEqual((back.error.errcode, back.error.msg), ("M_FORBIDDEN", "not joined"))
        ok = PersistResult("$e", 7, "p1", duplicate=True)
        self.assertEqual(result_from_json(result_to_json(ok)), ok)
        self.assertRaises(ValueError, refusal_from_status, 418, "M_X", "a teapot")


class JsonResourceRefusalTest(SynchronousTestCase):
    def test_handler_refusal_is_answered_with_its_status(self) -> None:
        """A handler that raises a domain refusal answers its status with ``{errcode, error}``."""
        resource = JsonResource()

        async def refuse(request: Any) -> tuple[int, Any]:
            raise NotFound("M_NOT_FOUND", "unknown room !r:hs")

        resource.route("GET", "/room", refuse)
        stub = StubTreq(resource)
        d = stub.get("http://hs/room")
        stub.flush()
        response = self.successResultOf(d)
        self.assertEqual(response.code, 404)
        self.assertEqual(self.successResultOf(response.json()), {"errcode": "M_NOT_FOUND", "error": "unknown room !r:hs"})

    def test_each_answer_is_timed_under_its_route_and_status(self) -> None:
        """Every answer, a handler's or a refusal's, adds one observation to the request-time histogram's series
        for its route and status."""
        from prometheus_client import REGISTRY

        resource = JsonResource()

        async def ok(request: Any) -> tuple[int, Any]:
            return 200, {}

        async def refuse(request: Any) -> tuple[int, Any]:
            raise NotFound("M_NOT_FOUND", "no such thing")

        resource.route("GET", "/timed_ok", ok)
        resource.route("GET", "/timed_refused", refuse)

        def count(route: str, code: str) -> float:
            value = REGISTRY.get_sample_value("synflow_http_request_seconds_count", {"route": route, "code": code})
            return value or 0.0

        before = (count("ok", "200"), count("refuse", "404"))
        stub = StubTreq(resource)
        for path in ("/timed_ok", "/timed_ok", "/timed_refused"):
            d = stub.get(f"http://hs{path}")
            stub.flush()
            self.successResultOf(d)
        self.assertEqual((count("ok", "200") - before[0], count("refuse", "404") - before[1]), (2.0, 1.0))
