"""Signed requests: the X-Matrix header round trip, and every way a signature must fail."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from signedjson.key import generate_signing_key, get_verify_key
from twisted.trial.unittest import SynchronousTestCase

from synflow.federation.signing import (
    MAX_AUTH_HEADER_BYTES,
    AuthError,
    XMatrixAuth,
    auth_header,
    parse_auth_header,
    verify_request,
)

KEY = generate_signing_key("a_1")
OTHER_KEY = generate_signing_key("a_1")
URI = "/_matrix/federation/v1/send/t1"
CONTENT = {"origin": "a.test", "origin_server_ts": 1, "pdus": []}


def signed(**overrides) -> XMatrixAuth:
    args = {"origin": "a.test", "destination": "b.test", "signing_key": KEY, "method": "PUT", "uri": URI,
            "content": CONTENT}
    args.update(overrides)
    return parse_auth_header(auth_header(**args))


class HeaderTest(SynchronousTestCase):
    def test_header_shape(self):
        """The header is X-Matrix with quoted origin, destination, key and sig, in that order."""
        value = auth_header("a.test", "b.test", KEY, "PUT", URI, CONTENT).decode()
        self.assertRegex(value, r'^X-Matrix origin="a\.test",destination="b\.test",key="ed25519:a_1",sig="[A-Za-z0-9+/]+"$')

    def test_round_trip_verifies(self):
        """A header made by auth_header parses and verifies against the request it signs."""
        auth = signed()
        self.assertEqual((auth.origin, auth.destination, auth.key_id), ("a.test", "b.test", "ed25519:a_1"))
        verify_request(auth, get_verify_key(KEY), "b.test", "PUT", URI, CONTENT)

    def test_request_without_body(self):
        """A GET without content signs and verifies with no content field."""
        auth = signed(method="GET", uri="/_matrix/federation/v1/x?y=1", content=None)
        verify_request(auth, get_verify_key(KEY), "b.test", "GET", "/_matrix/federation/v1/x?y=1", None)
        with self.assertRaises(AuthError):
            verify_request(auth, get_verify_key(KEY), "b.test", "GET", "/_matrix/federation/v1/x?y=1", {})

    def test_unquoted_and_spaced_parameters_parse(self):
        """Unquoted values, spaces around commas and any parameter order are accepted, as the spec allows."""
        auth = parse_auth_header(b'X-Matrix key=ed25519:k , sig=abc,origin=a.test:8448, destination="b.test"')
        self.assertEqual(auth, XMatrixAuth("a.test:8448", "b.test", "ed25519:k", "abc"))

    def test_every_way_a_signature_fails(self):
        """Wrong key, other destination, other method, URI or content, and no signature at all are refused."""
        good = get_verify_key(KEY)
        cases = {
            "wrong key": (signed(), get_verify_key(OTHER_KEY), "b.test", "PUT", URI, CONTENT),
            "signed for another destination": (signed(destination="c.test"), good, "b.test", "PUT", URI, CONTENT),
            "header destination omitted, signed for another": (
                XMatrixAuth("a.test", None, "ed25519:a_1", signed(destination="c.test").sig),
                good, "b.test", "PUT", URI, CONTENT),
            "other method": (signed(), good, "b.test", "POST", URI, CONTENT),
            "other URI": (signed(), good, "b.test", "PUT", URI + "x", CONTENT),
            "other content": (signed(), good, "b.test", "PUT", URI, {**CONTENT, "pdus": [{}]}),
            "claims another origin": (XMatrixAuth("c.test", "b.test", "ed25519:a_1", signed().sig),
                                      good, "b.test", "PUT", URI, CONTENT),
            "garbage signature": (XMatrixAuth("a.test", "b.test", "ed25519:a_1", "AAAA"),
                                  good, "b.test", "PUT", URI, CONTENT),
        }
        for name, (auth, key, me, method, uri, content) in cases.items():
            with self.assertRaises(AuthError, msg=name):
                verify_request(auth, key, me, method, uri, content)

    def test_malformed_headers_refused(self):
        """Other schemes, missing fields, bad server names, non-ASCII and oversized headers are AuthErrors."""
        bad = [
            b"Bearer abc",
            b'X-Matrix origin="a.test",key="ed25519:k"',
            b'X-Matrix origin="a test",key="ed25519:k",sig="x"',
            b'X-Matrix origin="a.test",destination="b/test",key="ed25519:k",sig="x"',
            b'X-Matrix origin="a.test",key="ed25519:k",sig="\xff"',
            b'X-Matrix origin="a.test",key="ed25519:k",sig="' + b"x" * MAX_AUTH_HEADER_BYTES + b'"',
            b'X-Matrix origin="' + b"a" * 300 + b'",key="ed25519:k",sig="x"',
            b'X-Matrix origin="a.test" key="ed25519:k" sig="x"',
        ]
        for value in bad:
            with self.assertRaises(AuthError, msg=value[:60]):
                parse_auth_header(value)

    @given(st.binary(max_size=300))
    def test_arbitrary_bytes_never_crash(self, value: bytes):
        """Any header value either parses or raises AuthError."""
        try:
            parse_auth_header(b"X-Matrix " + value)
        except AuthError:
            pass
