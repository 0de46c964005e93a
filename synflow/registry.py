"""Finds worker types and streams: entry points, dotted paths, and the checks between them.

Worker types are registered in the entry point group ``synflow.apps`` and
streams in ``synflow.streams`` by any installed distribution (synflow's own
built-ins too, in ``setup.cfg``). A config's ``app:`` is either a registered
name or a dotted path ``package.module:Class`` to a :class:`WorkerType` that
is not installed. Problems -- two distributions claiming one name, a plugin
that fails to import, an entry point naming the wrong kind of object -- are
a :class:`~synflow.errors.PluginError` naming the plugin and the cause, and
stop start-up.

This is the only module that reads a config's ``app`` key: everything else
asks it for the :class:`WorkerType` and looks at what the type declares.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import configparser
import importlib
import importlib.metadata
import os
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from synflow.errors import PluginError
from synflow.framework import Capability, WorkerType
from synflow.streams import StreamDef, Writers

if TYPE_CHECKING:
    from synflow.config import SynflowConfig

__all__ = [
    "APPS_GROUP",
    "STREAMS_GROUP",
    "Plugins",
    "app_name",
    "discover",
    "load_dotted",
    "streams",
    "worker_type",
    "worker_type_for",
]

APPS_GROUP = "synflow.apps"
STREAMS_GROUP = "synflow.streams"
_OWN = "synflow"


@attrs.frozen
class _Found:
    name: str
    value: str
    distribution: str


@attrs.frozen
class Plugins:
    """Every worker type and stream found, with the distribution that registered each.

    Attributes:
        apps: worker types by name.
        streams: streams by name.
        origin: ``"app:<name>"`` / ``"stream:<name>"`` -> distribution name.
        reserved: each reserved instance name -> the worker type that reserves it.
    """

    apps: Mapping[str, type[WorkerType]]
    streams: Mapping[str, StreamDef]
    origin: Mapping[str, str]
    reserved: Mapping[str, str]

    def listing(self) -> list[str]:
        """Lines for ``--help`` and ``synflowctl plugins``: each worker type and stream, where it comes from."""
        from synflow.framework import writer_kind

        lines = ["worker types (app:):"]
        for name, cls in sorted(self.apps.items()):
            caps = f" [{', '.join(sorted(c.value for c in cls.capabilities))}]" if cls.capabilities else ""
            lines.append(f"  {name:<20} {cls.summary}{caps} ({self.origin[f'app:{name}']})")
        lines.append("streams:")
        for name, stream in sorted(self.streams.items()):
            lines.append(f"  {name:<20} written by {writer_kind(stream)} ({self.origin[f'stream:{name}']})")
        return lines


_cache: Plugins | None = None


def discover(*, refresh: bool = False) -> Plugins:
    """The worker types and streams of every installed distribution (cached; ``refresh`` rereads).

    Raises:
        PluginError: two distributions claim one name, or a plugin fails to load.
    """
    global _cache
    if _cache is None or refresh:
        _cache = _discover()
    return _cache


def _discover() -> Plugins:
    apps_found = _entry_points(APPS_GROUP)
    streams_found = _entry_points(STREAMS_GROUP)
    apps: dict[str, type[WorkerType]] = {}
    found_streams: dict[str, StreamDef] = {}
    origin: dict[str, str] = {}
    for found in _unique(apps_found, "worker type"):
        apps[found.name] = _load_app(found)
        origin[f"app:{found.name}"] = found.distribution
    for found in _unique(streams_found, "stream"):
        found_streams[found.name] = _load_stream(found)
        origin[f"stream:{found.name}"] = found.distribution
    plugins = Plugins(apps, found_streams, origin, _reserved(apps))
    _check_sections(plugins)
    return plugins


def _entry_points(group: str) -> list[_Found]:
    found = []
    own = False
    for ep in importlib.metadata.entry_points(group=group):
        dist = ep.dist.name if ep.dist is not None else "?"
        own = own or _normal(dist) == _OWN
        found.append(_Found(ep.name, ep.value, dist))
    if not own:
        # Running from a source checkout that is not installed (or installed
        # before these entry points existed): synflow's own come from setup.cfg.
        found.extend(_Found(name, value, f"{_OWN} (setup.cfg)") for name, value in _checkout_entry_points(group))
    return found


def _checkout_entry_points(group: str) -> list[tuple[str, str]]:
    setup_cfg = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "setup.cfg")
    parser = configparser.ConfigParser()
    if not parser.read(setup_cfg) or not parser.has_option("options.entry_points", group):
        return []
    result = []
    for line in parser.get("options.entry_points", group).splitlines():
        if "=" in line:
            name, value = line.split("=", 1)
            result.append((name.strip(), value.strip()))
    return result


def _normal(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _unique(found: Iterable[_Found], kind: str) -> list[_Found]:
    by_name: dict[str, _Found] = {}
    for f in found:
        seen = by_name.get(f.name)
        if seen is None:
            by_name[f.name] = f
        elif seen.value != f.value:
            raise PluginError(
                f"{kind} {f.name!r} is claimed by two distributions: {seen.distribution} ({seen.value}) "
                f"and {f.distribution} ({f.value}); uninstall one of them"
            )
    return list(by_name.values())


def _import(value: str, what: str) -> Any:
    module_name, _, attr = value.partition(":")
    if not module_name or not attr:
        raise PluginError(f"{what}: {value!r} is not a 'package.module:Name' path")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as e:
        raise PluginError(f"{what} failed to load: {type(e).__name__}: {e}") from None
    return obj


def _load_app(found: _Found) -> type[WorkerType]:
    what = f"worker type {found.name!r} ({found.distribution}, {found.value})"
    cls = _import(found.value, what)
    _check_app(cls, what)
    if cls.name != found.name:
        raise PluginError(f"{what}: the class is named {cls.name!r}, not {found.name!r}")
    return cls


def _check_app(cls: Any, what: str) -> None:
    if not (isinstance(cls, type) and issubclass(cls, WorkerType)):
        raise PluginError(f"{what}: {cls!r} is not a synflow.api.WorkerType subclass")
    if not isinstance(getattr(cls, "name", None), str) or not cls.name:
        raise PluginError(f"{what}: the class sets no 'name'")


def _load_stream(found: _Found) -> StreamDef:
    what = f"stream {found.name!r} ({found.distribution}, {found.value})"
    stream = _import(found.value, what)
    if not isinstance(stream, StreamDef):
        raise PluginError(f"{what}: {stream!r} is not a synflow.api.Stream")
    if stream.name != found.name:
        raise PluginError(f"{what}: the stream is named {stream.name!r}, not {found.name!r}")
    if stream.reshardable and stream.name != "events":
        raise PluginError(f"{what}: reshardable is reserved for synflow's events stream "
                          "(live resharding moves rooms between event persisters only)")
    return stream


def _check_sections(plugins: Plugins) -> None:
    claimed: dict[str, tuple[str, type]] = {}
    for name, cls in plugins.apps.items():
        _check_section(cls, f"worker type {name!r} ({plugins.origin[f'app:{name}']})", _core_keys(), claimed)


def _check_section(cls: type[WorkerType], what: str, core: frozenset[str],
                   claimed: dict[str, tuple[str, type]]) -> None:
    section = cls.config
    if section is None:
        return
    if section.key in core:
        raise PluginError(f"{what}: its config section {section.key!r} is one of synflow's own keys")
    if not attrs.has(section.type):
        raise PluginError(f"{what}: its config section type {section.type!r} is not an attrs class")
    other = claimed.get(section.key)
    if other is not None and other[1] is not section.type:
        raise PluginError(f"{what}: config section {section.key!r} is already claimed by {other[0]}")
    claimed[section.key] = (what, section.type)


def _reserved(apps: Mapping[str, type[WorkerType]]) -> dict[str, str]:
    """Each reserved instance name -> its worker type; two types reserving one name is a PluginError."""
    reserved: dict[str, str] = {}
    for name, cls in sorted(apps.items()):
        instance = cls.reserved_instance_name
        if instance is None:
            continue
        if instance in reserved:
            raise PluginError(f"worker types {reserved[instance]!r} and {name!r} both reserve the instance name {instance!r}")
        reserved[instance] = name
    return reserved


def load_dotted(path: str) -> type[WorkerType]:
    """The worker type at ``package.module:Class`` (an ``app:`` that is not a registered name).

    Raises:
        PluginError: it cannot be imported or is not a WorkerType.
    """
    what = f"worker type {path!r}"
    cls = _import(path, what)
    _check_app(cls, what)
    return cls


def worker_type(app: str) -> type[WorkerType]:
    """The worker type an ``app:`` value names: a registered name or a dotted path.

    Raises:
        PluginError: a dotted path that does not load.
        KeyError: an unregistered name (its message lists the registered ones).
    """
    if ":" in app:
        return load_dotted(app)
    apps = discover().apps
    if app not in apps:
        raise KeyError(f"unknown app {app!r}; available: {', '.join(sorted(apps))}")
    return apps[app]


def worker_type_for(config: SynflowConfig) -> type[WorkerType]:
    """The worker type of ``config``'s process."""
    return worker_type(config.app)


def app_name(config: SynflowConfig) -> str:
    """The name of ``config``'s worker type (for logs, listings and labels)."""
    return worker_type_for(config).name


def streams() -> dict[str, StreamDef]:
    """Every registered stream, by name."""
    return dict(discover().streams)


def plugin_schemas(config: SynflowConfig) -> dict[str, str]:
    """Every plugin migration directory this process knows, by namespace (``stream:<name>``, ``app:<name>``)."""
    plugins = discover()
    schemas = {f"stream:{name}": s.schema for name, s in plugins.streams.items() if s.schema is not None}
    for cls in (*plugins.apps.values(), worker_type_for(config)):
        if cls.schema is not None:
            schemas[f"app:{cls.name}"] = cls.schema
    return schemas


def config_sections() -> dict[str, type]:
    """Every worker type's config section: top-level key -> attrs class."""
    return {cls.config.key: cls.config.type for cls in discover().apps.values() if cls.config is not None}


def sorted_for_start(configs: Iterable[tuple[str, SynflowConfig]]) -> list[tuple[str, SynflowConfig]]:
    """Processes in start order: those applying migrations first, then by name."""
    return sorted(configs, key=lambda nc: (not worker_type_for(nc[1]).has(Capability.MIGRATIONS), nc[0]))


def check_app(config: SynflowConfig, error: Callable[[str, str], Exception]) -> None:
    """The config checks that depend on the worker type (called by ``synflow.config.validate``).

    Raises:
        Exception: what ``error(dotted_key, problem)`` makes.
    """
    try:
        cls = worker_type(config.app)
    except KeyError as e:
        raise error("app", str(e.args[0])) from None
    except PluginError as e:
        raise error("app", str(e)) from None
    plugins = discover()
    if ":" in config.app:
        try:
            _check_section(cls, f"worker type {config.app!r}", _core_keys(),
                           {key: ("a registered worker type", t) for key, t in config_sections().items()})
        except PluginError as e:
            raise error("app", str(e)) from None
    if cls.reserved_instance_name is not None and config.instance_name != cls.reserved_instance_name:
        raise error("instance_name", f"a {cls.name} process's instance_name must be {cls.reserved_instance_name!r}")
    owner = plugins.reserved.get(config.instance_name)
    if owner is not None and owner != cls.name:
        raise error("instance_name", f"{config.instance_name!r} is reserved for the app: {owner} process")
    for stream in cls.writes:
        if stream.name not in plugins.streams:
            raise error("app", f"{cls.name} writes stream {stream.name!r}, which no installed plugin registers")
        if (stream.writers is Writers.CONFIGURED and not stream.reshardable
                and config.instance_name not in config.writers_of(stream)):
            raise error("instance_name", f"{cls.name} {config.instance_name!r} is not listed in stream_writers.{stream.name}")
    for name in cls.follows:
        if name not in plugins.streams:
            raise error("app", f"{cls.name} follows stream {name!r}, which no installed plugin registers")
    if cls.requires_instance_map and config.instance_name not in config.instance_map:
        raise error("instance_map", f"this process ({config.instance_name!r}) is missing from instance_map")
    cls.check_config(config, error)


def _core_keys() -> frozenset[str]:
    from synflow.config import core_keys

    return core_keys()
