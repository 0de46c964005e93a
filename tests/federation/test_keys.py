"""Server keys: the key file, the published key response, and the check of a remote's response."""

from __future__ import annotations

import logging
import os
import stat

from signedjson.key import generate_signing_key, read_signing_keys
from twisted.trial.unittest import SynchronousTestCase

from synflow.errors import ConfigError
from synflow.federation.keys import (
    KEY_VALIDITY_MS,
    MAX_KEY_VALIDITY_MS,
    MAX_VERIFY_KEYS,
    KeyResponseError,
    key_id,
    load_or_create_signing_key,
    parse_server_keys,
    public_key_base64,
    server_keys_response,
)

NOW = 1_700_000_000_000


class KeyFileTest(SynchronousTestCase):
    def test_created_owner_only_and_reused(self):
        """The first start creates the key file with mode 0600; later starts load the same key."""
        path = os.path.join(self.mktemp(), "sub", "signing.key")
        key = load_or_create_signing_key(path)
        self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), 0o600)
        again = load_or_create_signing_key(path)
        self.assertEqual((key_id(again), again.encode()), (key_id(key), key.encode()))
        with open(path) as f:
            (stored,) = read_signing_keys(f)
        self.assertEqual(stored.encode(), key.encode())
        self.assertEqual(os.listdir(os.path.dirname(path)), ["signing.key"])

    def test_private_key_never_logged(self):
        """Creating and loading the key logs its ID, never its private seed."""
        path = os.path.join(self.mktemp(), "signing.key")
        with self.assertLogs("synflow.federation.keys", logging.DEBUG) as logs:
            key = load_or_create_signing_key(path)
            load_or_create_signing_key(path)
        with open(path) as f:
            seed = f.read().split()[2]
        text = "\n".join(logs.output)
        self.assertIn(key_id(key), text)
        self.assertNotIn(seed, text)

    def test_loose_mode_tightened(self):
        """A key file readable by others is made owner-only on load."""
        path = os.path.join(self.mktemp(), "signing.key")
        load_or_create_signing_key(path)
        os.chmod(path, 0o644)
        load_or_create_signing_key(path)
        self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), 0o600)

    def test_garbage_file_is_a_config_error(self):
        """A key file without an ed25519 key is a ConfigError naming the file."""
        path = self.mktemp()
        with open(path, "w") as f:
            f.write("not a key\n")
        with self.assertRaises(ConfigError) as cm:
            load_or_create_signing_key(path)
        self.assertIn(path, str(cm.exception))


class KeyResponseTest(SynchronousTestCase):
    key = generate_signing_key("a_1")

    def response(self, **overrides):
        body = server_keys_response("a.test", self.key, NOW)
        body.update(overrides)
        return body

    def test_published_response_parses(self):
        """The published response is self-signed, valid for a day, and lists the public key only."""
        body = self.response()
        self.assertEqual(body["valid_until_ts"], NOW + KEY_VALIDITY_MS)
        self.assertEqual(body["verify_keys"], {"ed25519:a_1": {"key": public_key_base64(self.key)}})
        keys = parse_server_keys("a.test", body, NOW)
        self.assertEqual(keys.valid_until_ts, NOW + KEY_VALIDITY_MS)
        self.assertEqual(keys.keys["ed25519:a_1"].encode(), self.key.verify_key.encode())

    def test_validity_capped_at_seven_days(self):
        """A response valid for a year is trusted for seven days only."""
        body = server_keys_response("a.test", self.key, NOW, validity_ms=365 * 86_400_000)
        self.assertEqual(parse_server_keys("a.test", body, NOW).valid_until_ts, NOW + MAX_KEY_VALIDITY_MS)

    def test_bad_responses_refused(self):
        """Wrong server, expired, unsigned, tampered, signed by another key, bad keys or too many are refused."""
        other = generate_signing_key("a_1")
        forged = server_keys_response("a.test", other, NOW)
        forged["verify_keys"] = self.response()["verify_keys"]
        too_many = {f"ed25519:k{i}": {"key": public_key_base64(self.key)} for i in range(MAX_VERIFY_KEYS + 1)}
        cases = {
            "not an object": [],
            "another server": server_keys_response("c.test", self.key, NOW),
            "expired": server_keys_response("a.test", self.key, NOW - KEY_VALIDITY_MS - 1),
            "unsigned": {k: v for k, v in self.response().items() if k != "signatures"},
            "tampered": self.response(old_verify_keys={"ed25519:x": {"key": "AAAA", "expired_ts": 1}}),
            "signed by an unlisted key": forged,
            "valid_until_ts a float": self.response(valid_until_ts=1e999),
            "valid_until_ts past 2^53": self.response(valid_until_ts=2**60),
            "key not base64": self.response(verify_keys={"ed25519:a_1": {"key": "!!"}}),
            "key too short": self.response(verify_keys={"ed25519:a_1": {"key": "AAAA"}}),
            "too many keys": self.response(verify_keys=too_many),
            "no keys": self.response(verify_keys={}),
        }
        for name, body in cases.items():
            with self.assertRaises(KeyResponseError, msg=name):
                parse_server_keys("a.test", body, NOW)
