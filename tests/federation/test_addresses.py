"""Outbound address policy: blacklisted addresses are refused before any connection.

The real transport, treq client and agent run on a ``MemoryReactorClock``
whose name resolver is a fake answering from a table: no packet leaves the
process, and ``reactor.tcpClients`` shows every connection the agent tried.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.interfaces import IHostnameResolver, IResolutionReceiver
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer

from synflow.config import FederationConfig
from synflow.federation.addresses import DEFAULT_IP_RANGE_BLACKLIST, AddressPolicy
from synflow.federation.interfaces import TransactionFailed
from synflow.federation.transport import TreqFederationTransport

BODY = {"origin": "local.test", "origin_server_ts": 1, "pdus": []}


@implementer(IHostnameResolver)
class TableResolver:
    """Resolves names from a table (IP literals to themselves) and records every query."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table
        self.queries: list[str] = []

    def resolveHostName(self, resolutionReceiver: IResolutionReceiver, hostName: str, portNumber: int = 0,
                        addressTypes: Any = None, transportSemantics: str = "TCP") -> Any:
        self.queries.append(hostName)
        resolutionReceiver.resolutionBegan(None)  # type: ignore[arg-type]
        for host in self.table.get(hostName, [hostName]):
            cls = IPv6Address if ":" in host else IPv4Address
            resolutionReceiver.addressResolved(cls("TCP", host, portNumber))
        resolutionReceiver.resolutionComplete()
        return None


class PolicyTest(SynchronousTestCase):
    def test_default_blacklist(self):
        """Loopback, private, link-local, CGNAT, unspecified and their IPv6 forms are blocked; public is not."""
        policy = AddressPolicy()
        for host in ("127.0.0.1", "10.0.0.5", "172.16.3.4", "192.168.1.1", "100.64.0.1", "169.254.169.254",
                     "0.0.0.0", "224.0.0.1", "::1", "::", "fe80::1", "fc00::1", "fd12::1", "::ffff:10.0.0.5",
                     "::ffff:127.0.0.1", "fe80::1%eth0"):
            self.assertTrue(policy.blocks(host), host)
        for host in ("8.8.8.8", "1.1.1.1", "2606:4700::1111", "not-an-ip"):
            self.assertFalse(policy.blocks(host), host)

    def test_custom_list(self):
        """A configured list replaces the default."""
        policy = AddressPolicy(["10.0.0.0/8"])
        self.assertTrue(policy.blocks("10.1.2.3"))
        self.assertFalse(policy.blocks("127.0.0.1"))

    def test_bad_range_is_a_value_error(self):
        """A blacklist entry that is not a CIDR range is a ValueError naming it."""
        with self.assertRaisesRegex(ValueError, "nope"):
            AddressPolicy(["nope"])


class TransportPolicyTest(SynchronousTestCase):
    """The transport built from config refuses blacklisted destinations before connecting."""

    def transport(self, table: dict[str, list[str]], **config: Any) -> tuple[TreqFederationTransport, Any]:
        self.reactor = MemoryReactorClock()
        self.resolver = TableResolver(table)
        self.reactor.installNameResolver(self.resolver)
        config.setdefault("destinations", {"peer.test": "http://127.0.0.1:8448"})
        return TreqFederationTransport.from_config(self.reactor, FederationConfig(**config)), self.reactor

    def refused(self, d: Any) -> TransactionFailed:
        self.reactor.advance(0)
        failure = self.failureResultOf(d, TransactionFailed)
        self.assertEqual(self.reactor.tcpClients, [], "a connection was attempted")
        return failure.value

    def test_invite_to_an_internal_address_is_refused(self):
        """A server name that is a private IP literal (an invite to @x:10.0.0.5:8443) gets no connection."""
        transport, _ = self.transport({})
        error = self.refused(transport.send_transaction("10.0.0.5:8443", "t1", BODY))
        self.assertIn("DNSLookupError", error.reason)
        self.assertEqual(self.resolver.queries, ["10.0.0.5"])

    def test_name_resolving_to_internal_addresses_is_refused(self):
        """A name whose every address is blacklisted (loopback, private, IPv6 ULA) gets no connection."""
        transport, _ = self.transport({"evil.test": ["10.0.0.5", "127.0.0.1", "fd00::1"]})
        self.refused(transport.send_transaction("evil.test", "t1", BODY))

    def test_key_fetch_is_guarded_too(self):
        """Fetching the keys of an unlisted origin follows the same policy."""
        transport, _ = self.transport({"evil.test": ["169.254.169.254"]})
        self.refused(transport.get_server_keys("evil.test"))

    def test_blacklisted_addresses_are_dropped_others_kept(self):
        """Of a name's addresses only those outside the blacklist are connected to."""
        transport, reactor = self.transport({"mixed.test": ["10.0.0.5", "127.0.0.1"]},
                                            ip_range_blacklist=["10.0.0.0/8"])
        transport.send_transaction("mixed.test", "t1", BODY)
        reactor.advance(0)
        self.assertEqual([(host, port) for host, port, *_ in reactor.tcpClients], [("127.0.0.1", 443)])

    def test_listed_destinations_are_exempt(self):
        """A destination listed in federation.destinations is reached at its loopback address."""
        transport, reactor = self.transport({})
        transport.send_transaction("peer.test", "t1", BODY)
        reactor.advance(0)
        self.assertEqual([(host, port) for host, port, *_ in reactor.tcpClients], [("127.0.0.1", 8448)])
        self.assertIn("127.0.0.0/8", DEFAULT_IP_RANGE_BLACKLIST)

    def test_empty_blacklist_allows_everything(self):
        """ip_range_blacklist: [] turns the policy off."""
        transport, reactor = self.transport({"local.test": ["127.0.0.1"]}, ip_range_blacklist=[])
        transport.send_transaction("local.test", "t1", BODY)
        reactor.advance(0)
        self.assertEqual(len(reactor.tcpClients), 1)
