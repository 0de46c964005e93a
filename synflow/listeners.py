"""What each listener of a process serves: the configured ``listeners`` plus the two synflow adds.

A listener serves exactly the resources it names, from a fixed set
(:data:`synflow.config.RESOURCES`); a request for anything else is answered 404:

* ``client`` -- the client API (``/_synflow/client/v1``);
* ``federation`` -- inbound federation (``/_matrix/federation/...``);
* ``metrics`` -- Prometheus ``/metrics``;
* ``health`` -- ``/health``;
* ``rpc`` -- internal RPC between the processes of one server (``/_synflow/internal``);
* ``replication`` -- the master's replication hub (the line protocol of
  docs/protocol.md, not HTTP, so it shares its listener with nothing).

Besides the configured listeners, a process has two that the config implies,
each replaced by a configured listener naming its resource:

* the **internal listener**, on the process's own ``instance_map`` address,
  serving :data:`INTERNAL_RESOURCES` (``rpc``, ``health``, ``metrics``) --
  unless a configured listener names ``rpc``, which then is the internal
  listener (it must listen on the ``instance_map`` port, where the other
  processes call it) and serves only what it lists;
* the **hub**, on the master with ``replication.transport: tcp``, at
  ``replication.hub`` serving ``replication`` -- unless a configured listener
  names ``replication`` (only on that master, on ``replication.hub.port``,
  e.g. to bind another interface than the host the workers connect to).

:func:`effective_listeners` lists them all; :func:`check_listeners` is the
config validation of these rules (called by :func:`synflow.config.validate`).

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from synflow.config import RESOURCES, Transport, listener_port

if TYPE_CHECKING:
    from synflow.config import SynflowConfig

#: What the internal listener (``instance_map.<instance>``) serves unless a configured listener names ``rpc``.
INTERNAL_RESOURCES = ("rpc", "health", "metrics")
#: The names the implied listeners are known by (a configured one is named by its resources).
INTERNAL = "internal"
HUB = "hub"


@attrs.frozen
class ServedListener:
    """One listener a process opens.

    Attributes:
        name: ``internal``, ``hub``, or the configured listener's resources joined with ``+``.
        endpoint: the Twisted server endpoint description it listens on.
        resources: what it serves.
        key: the dotted config key that sets its address (for error messages).
    """

    name: str
    endpoint: str
    resources: tuple[str, ...]
    key: str

    def serves(self, resource: str) -> bool:
        """Whether this listener serves ``resource``."""
        return resource in self.resources

    @property
    def is_http(self) -> bool:
        """Whether this is an HTTP listener (everything but the replication hub)."""
        return "replication" not in self.resources


def _runs_hub(config: SynflowConfig) -> bool:
    from synflow import registry  # it reads the config this module's checks are part of
    from synflow.framework import Capability

    return (config.replication.transport is Transport.TCP
            and registry.worker_type_for(config).has(Capability.REPLICATION_HUB))


def effective_listeners(config: SynflowConfig) -> list[ServedListener]:
    """Every listener ``config``'s process opens: the configured ones first, then the implied ones."""
    served = [
        ServedListener("+".join(listener.resources), listener.endpoint, tuple(listener.resources),
                       f"listeners[{i}].endpoint")
        for i, listener in enumerate(config.listeners)
    ]
    configured = {resource for listener in config.listeners for resource in listener.resources}
    own = config.instance_map.get(config.instance_name)
    if own is not None and "rpc" not in configured:
        served.append(ServedListener(INTERNAL, own.server_endpoint(), INTERNAL_RESOURCES,
                                     f"instance_map.{config.instance_name}.port"))
    if _runs_hub(config) and "replication" not in configured:
        served.append(ServedListener(HUB, config.replication.hub.server_endpoint(), ("replication",),
                                     "replication.hub.port"))
    return served


def serving(config: SynflowConfig, resource: str) -> ServedListener | None:
    """The first listener of ``config``'s process serving ``resource`` (configured ones first), if any."""
    for listener in effective_listeners(config):
        if listener.serves(resource):
            return listener
    return None


def hub_endpoint(config: SynflowConfig) -> str:
    """The server endpoint description the master's replication hub listens on."""
    listener = serving(config, "replication")
    return listener.endpoint if listener is not None else config.replication.hub.server_endpoint()


def check_listeners(config: SynflowConfig, error: Callable[[str, str], Exception]) -> None:
    """The rules of ``listeners`` that span keys (each resource name is checked when parsed).

    Args:
        config: the structured config.
        error: makes the exception for a dotted key and a message.

    Raises:
        Exception: what ``error`` makes, for the first rule broken.
    """
    for i, listener in enumerate(config.listeners):
        key = f"listeners[{i}].resources"
        if not listener.resources:
            raise error(key, f"lists nothing to serve (choose from {', '.join(RESOURCES)})")
        if len(set(listener.resources)) != len(listener.resources):
            raise error(key, "names a resource twice")
        if "replication" in listener.resources:
            _check_replication(config, i, error)
        if "rpc" in listener.resources:
            _check_rpc(config, i, error)
    for resource in RESOURCES:
        if sum(1 for listener in config.listeners if resource in listener.resources) > 1:
            raise error("listeners", f"more than one listener serves {resource!r}")


def _check_replication(config: SynflowConfig, i: int, error: Callable[[str, str], Exception]) -> None:
    listener = config.listeners[i]
    if len(listener.resources) > 1:
        raise error(f"listeners[{i}].resources",
                    "'replication' is the hub's line protocol, not HTTP: it needs a listener of its own")
    if not _runs_hub(config):
        raise error(f"listeners[{i}].resources",
                    "only the master serves 'replication', and only with replication.transport: tcp")
    port = listener_port(listener.endpoint)
    if port != config.replication.hub.port:
        raise error(f"listeners[{i}].endpoint",
                    f"the 'replication' listener must listen on replication.hub.port "
                    f"({config.replication.hub.port}), where the workers connect, got {listener.endpoint!r}")


def _check_rpc(config: SynflowConfig, i: int, error: Callable[[str, str], Exception]) -> None:
    me = config.instance_name
    own = config.instance_map.get(me)
    if own is None:
        raise error(f"listeners[{i}].resources",
                    f"'rpc' is served where the other processes call it: add {me!r} to instance_map")
    port = listener_port(config.listeners[i].endpoint)
    if port != own.port:
        raise error(f"listeners[{i}].endpoint",
                    f"the 'rpc' listener must listen on instance_map.{me}.port ({own.port}), "
                    f"where the other processes call it, got {config.listeners[i].endpoint!r}")
