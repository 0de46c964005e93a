"""Outbound address policy: federation never connects to a blacklisted address.

A server name that is not listed in ``federation.destinations`` is reached at
whatever its name resolves to -- which an attacker chooses (an invite to
``@x:10.0.0.5:8443``, an ``X-Matrix`` origin whose keys are fetched). So the
HTTP client used for such servers resolves names through a
:class:`FilteringResolver`: every resolved address inside
``federation.ip_range_blacklist`` (default :data:`DEFAULT_IP_RANGE_BLACKLIST`:
loopback, private, link-local, shared, documentation, multicast and
unspecified ranges, IPv4 and IPv6, the same ranges as Synapse's default) is
dropped *before* the agent connects, so a name resolving only there fails
with a DNS lookup error and no connection is attempted. IP literals go
through the same resolver. IPv4-mapped IPv6 addresses are checked as IPv4.

Destinations listed in ``federation.destinations`` are the operator's own
choice and use an unfiltered client (the demo and the tests list peers on
127.0.0.1 there); :class:`~synflow.federation.transport.TreqFederationTransport`
picks the client per destination.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from twisted.internet.interfaces import (
    IHostnameResolver,
    IHostResolution,
    IReactorPluggableNameResolver,
    IReactorTCP,
    IReactorTime,
    IResolutionReceiver,
)
from zope.interface import implementer

from synflow.metrics import counter

logger = logging.getLogger(__name__)

#: The default ``federation.ip_range_blacklist``.
DEFAULT_IP_RANGE_BLACKLIST: tuple[str, ...] = (
    "0.0.0.0/8",
    "127.0.0.0/8",
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "100.64.0.0/10",
    "192.0.0.0/24",
    "169.254.0.0/16",
    "192.88.99.0/24",
    "198.18.0.0/15",
    "192.0.2.0/24",
    "198.51.100.0/24",
    "203.0.113.0/24",
    "224.0.0.0/4",
    "::/128",
    "::1/128",
    "fe80::/10",
    "fc00::/7",
    "2001:db8::/32",
    "ff00::/8",
    "fec0::/10",
)

ADDRESSES_REFUSED = counter(
    "synflow_federation_addresses_refused_total",
    "Resolved addresses of federation destinations dropped by federation.ip_range_blacklist",
)

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(ranges: Iterable[str]) -> list[Network]:
    """CIDR ranges as networks.

    Raises:
        ValueError: naming the entry that is not a CIDR range.
    """
    networks: list[Network] = []
    for entry in ranges:
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            raise ValueError(f"{entry!r} is not an IP range (CIDR, e.g. 10.0.0.0/8)") from None
    return networks


class AddressPolicy:
    """Which IP addresses federation may connect to.

    Args:
        blacklist: CIDR ranges refused (``federation.ip_range_blacklist``).
    """

    def __init__(self, blacklist: Sequence[str] = DEFAULT_IP_RANGE_BLACKLIST) -> None:
        self.networks = parse_networks(blacklist)

    def blocks(self, host: str) -> bool:
        """Whether the IP address ``host`` lies in a blacklisted range (False for a non-IP)."""
        try:
            ip: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip.version == net.version and ip in net for net in self.networks)


@implementer(IResolutionReceiver)
class _Filter:
    def __init__(self, receiver: IResolutionReceiver, policy: AddressPolicy, hostname: str) -> None:
        self._receiver = receiver
        self._policy = policy
        self._hostname = hostname
        self._dropped: list[str] = []

    def resolutionBegan(self, resolutionInProgress: IHostResolution) -> None:
        self._receiver.resolutionBegan(resolutionInProgress)

    def addressResolved(self, address: Any) -> None:
        host = getattr(address, "host", None)
        if isinstance(host, str) and self._policy.blocks(host):
            self._dropped.append(host)
            ADDRESSES_REFUSED.inc()
            return
        self._receiver.addressResolved(address)

    def resolutionComplete(self) -> None:
        if self._dropped:
            logger.warning("federation: refusing to connect to %s at %s (federation.ip_range_blacklist)",
                           self._hostname, ", ".join(self._dropped))
        self._receiver.resolutionComplete()


@implementer(IHostnameResolver)
class FilteringResolver:
    """An :class:`IHostnameResolver` that drops addresses the policy blocks.

    Args:
        resolver: the real resolver.
        policy: the address policy.
    """

    def __init__(self, resolver: IHostnameResolver, policy: AddressPolicy) -> None:
        self._resolver = resolver
        self._policy = policy

    def resolveHostName(self, resolutionReceiver: IResolutionReceiver, hostName: str, portNumber: int = 0,
                        addressTypes: Sequence[Any] | None = None, transportSemantics: str = "TCP") -> Any:
        receiver = _Filter(resolutionReceiver, self._policy, hostName)
        return self._resolver.resolveHostName(receiver, hostName, portNumber, addressTypes, transportSemantics)


@implementer(IReactorPluggableNameResolver, IReactorTCP, IReactorTime)
class GuardedReactor:
    """A reactor whose name resolution goes through a :class:`FilteringResolver`.

    Everything else is the wrapped reactor's. An agent built on it connects
    only to addresses the policy allows.

    Args:
        reactor: the real reactor (TCP, time, pluggable name resolver).
        policy: the address policy.
    """

    def __init__(self, reactor: Any, policy: AddressPolicy) -> None:
        self._reactor = reactor
        self.nameResolver = FilteringResolver(reactor.nameResolver, policy)

    def installNameResolver(self, resolver: IHostnameResolver) -> IHostnameResolver:
        raise NotImplementedError("GuardedReactor's resolver is fixed")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reactor, name)
