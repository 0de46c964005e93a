"""Configuration: YAML files merged into frozen attrs values, validated once.

A process is configured by a list of YAML files (``--config`` repeated):
typically ``workers/shared.yaml`` then ``workers/<instance>.yaml``. Later
files override earlier ones key by key (mappings merge recursively; any other
value replaces). The merged mapping is turned into :class:`SynflowConfig` by a
small structuring walker that checks every key against the attrs classes
below: unknown keys, wrong types, bad values and cross-field mistakes raise
:class:`~synflow.errors.ConfigError`, whose message names the file the value
came from, the dotted key path and what is wrong. Nothing else reads YAML.

docs/configuration.md documents every key; keep the two in step.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import enum
import importlib.util
import ipaddress
import os
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar, get_args, get_origin

import attrs
import unpaddedbase64
import yaml

from synflow.endpoints import endpoint_problem, tcp_address
from synflow.errors import ConfigError
from synflow.shared_secret import DEFAULT_SECRET_NAME, is_loopback, load_or_create_secret
from synflow.storage.engines import DatabaseConfig
from synflow.streams import StreamDef, Writers

T = TypeVar("T")


class Transport(enum.Enum):
    """How replication commands travel between processes."""

    TCP = "tcp"
    REDIS = "redis"


# -- sections ------------------------------------------------------------------------


@attrs.frozen
class HostPort:
    """A TCP address on another process (an ``instance_map`` entry or the hub)."""

    host: str = "127.0.0.1"
    port: int = 0

    def client_endpoint(self) -> str:
        """The Twisted client endpoint description for this address."""
        return f"tcp:host={self.host}:port={self.port}"

    def server_endpoint(self) -> str:
        """The Twisted server endpoint description that listens on this address."""
        return f"tcp:{self.port}:interface={self.host}"


@attrs.frozen
class TlsConfig:
    """TLS for a Redis connection: CA to verify the server, optional client cert."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None


@attrs.frozen
class RedisConfig:
    """A Redis server (replication transport or shared cache tier)."""

    host: str = "127.0.0.1"
    port: int = 6379
    path: str | None = None
    password: str | None = attrs.field(default=None, repr=False)
    password_file: str | None = None
    dbid: int = 0
    tls: TlsConfig | None = None
    channel_prefix: str | None = None
    connect_timeout_s: float = 10.0
    #: Publish each replication line as its own message (strict Synapse framing)
    #: instead of joining the lines of one reactor turn with ``\n``.
    one_line_per_message: bool = False


@attrs.frozen
class ReplicationConfig:
    """How processes replicate: the TCP hub (default) or Redis pub/sub."""

    transport: Transport = Transport.TCP
    hub: HostPort = HostPort("127.0.0.1", 9092)
    redis: RedisConfig = RedisConfig()
    secret: str | None = attrs.field(default=None, repr=False)
    secret_file: str | None = None
    #: The deployment's generated secret; None: ``<data_dir>/replication.secret``.
    secret_path: str | None = None
    #: No secret at all (Synapse's plain protocol); only on loopback addresses.
    allow_unauthenticated: bool = False
    ping_interval_s: float = 5.0
    ping_timeout_s: float = 15.0
    high_water: int = 10_000
    hard_limit: int = 20_000
    idle_announce_interval_s: float = 1.0
    wait_for_position_timeout_s: float = 5.0


@attrs.frozen
class DatabaseSection:
    """``database:`` -- its values are checked by the storage layer's validator
    (:meth:`~synflow.storage.engines.DatabaseConfig.from_dict`) when the config loads."""

    engine: Literal["sqlite", "postgres"] = "sqlite"
    path: str | None = None
    host: str | None = None
    port: int | None = None
    user: str | None = None
    password: str | None = attrs.field(default=None, repr=False)
    dbname: str | None = None
    cp_min: int | None = None
    cp_max: int | None = None
    connect_timeout_s: float | None = None
    #: SQLite only: ``full`` (default) or ``normal`` (see docs/reliability.md).
    synchronous: Literal["full", "normal"] = "full"
    repair_positions: bool = True


@attrs.frozen
class BackoffSection:
    initial_s: float = 10.0
    multiplier: float = 2.0
    max_s: float = 86400.0
    jitter: float = 0.2


@attrs.frozen
class FederationConfig:
    """``federation:`` -- outbound sending and inbound acceptance."""

    destinations: dict[str, str] = attrs.Factory(dict)
    backoff: BackoffSection = BackoffSection()
    catch_up_after_s: float = 3600.0
    wakeup_interval_s: float = 60.0
    request_timeout_s: float = 30.0
    allowed_origins: list[str] | None = None
    verify_tls: bool = True
    max_body_bytes: int = 2 * 1024 * 1024
    #: Catch-up sends every unacknowledged event up to this many per destination; past it, the latest per room.
    catch_up_max_events: int = 10_000
    #: Pinned remote keys: server name -> {key ID: unpadded base64 ed25519 public key}.
    trusted_keys: dict[str, dict[str, str]] = attrs.Factory(dict)
    #: CIDR ranges outbound federation never connects to (None: the default list);
    #: destinations listed in ``destinations`` are exempt.
    ip_range_blacklist: list[str] | None = None


@attrs.frozen
class CacheConfig:
    """``caches:`` -- per-process LRU sizes and the shared Redis tier."""

    default_size: int = 10_000
    sizes: dict[str, int] = attrs.Factory(dict)
    tier: RedisConfig | None = None
    tier_ttl_s: float = 3600.0
    cache_invalidator_instances: list[str] = attrs.Factory(list)


@attrs.frozen
class AuditConfig:
    """``audit:`` -- the stream audit log (input of the Spark validator)."""

    enabled: bool = True
    #: None: ``<data_dir>/audit``.
    dir: str | None = None
    max_bytes: int = 64 * 1024 * 1024
    #: Per log of a process: delete the oldest rotated files beyond this many bytes (None: keep all).
    retain_bytes: int | None = 4 * 1024 * 1024 * 1024
    #: Delete rotated files older than this many days (None: keep all).
    retain_days: float | None = None


@attrs.frozen
class LimitsConfig:
    """``limits:`` -- bounds on what clients may send."""

    max_request_bytes: int = 1024 * 1024
    max_event_bytes: int = 64 * 1024
    max_json_depth: int = 64
    #: Sends (and other writes) per second per user; None switches the limit off.
    rate_limit_per_s: float | None = 100.0
    rate_limit_burst: int = 500
    #: Syncs per second per access token (user and device); None switches the limit off.
    sync_rate_limit_per_s: float | None = 50.0
    sync_rate_limit_burst: int = 200
    sync_max_timeout_ms: int = 60_000
    sync_default_limit: int = 100
    sync_max_limit: int = 1000
    #: How long a send of a room being handed over to another persister waits before 503 + Retry-After.
    reshard_max_wait_s: float = 10.0


@attrs.frozen
class LoggingConfig:
    """``logging:`` -- the process log's format, rotation and levels."""

    format: Literal["text", "json"] = "text"
    #: Rotate the log file past this size ...
    max_bytes: int = 10 * 1024 * 1024
    #: ... keeping this many rotated files (the oldest is deleted).
    backups: int = 5
    #: Level per logger name (a stdlib logger or a Twisted log namespace), e.g. ``synflow.federation: DEBUG``.
    levels: dict[str, str] = attrs.Factory(dict)


#: Every resource a listener may name (what each serves: synflow/listeners.py).
RESOURCES = ("client", "federation", "metrics", "health", "replication", "rpc")
#: The resources that are internal channels (need the secret off loopback).
INTERNAL_CHANNELS: frozenset[str] = frozenset({"replication", "rpc"})
#: The largest ``federation.catch_up_max_events`` accepted.
MAX_CATCH_UP_MAX_EVENTS = 1_000_000
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@attrs.frozen
class Listener:
    """One configured listener of this process: an endpoint and exactly what it serves."""

    endpoint: str
    resources: list[Literal["client", "federation", "metrics", "health", "replication", "rpc"]]


@attrs.frozen
class SynflowConfig:
    """Everything one process needs, merged from its config files."""

    server_name: str
    app: str
    instance_name: str
    data_dir: str = "var"
    #: This server's ed25519 signing key file (None: ``<data_dir>/signing.key``).
    signing_key_path: str | None = None
    database: DatabaseSection = DatabaseSection()
    replication: ReplicationConfig = ReplicationConfig()
    instance_map: dict[str, HostPort] = attrs.Factory(dict)
    stream_writers: dict[str, list[str]] = attrs.Factory(dict)
    federation_sender_instances: list[str] = attrs.Factory(list)
    federation: FederationConfig = FederationConfig()
    caches: CacheConfig = CacheConfig()
    audit: AuditConfig = AuditConfig()
    limits: LimitsConfig = LimitsConfig()
    listeners: list[Listener] = attrs.Factory(list)
    log_file: str | None = None
    log_level: str = "INFO"
    logging: LoggingConfig = LoggingConfig()
    pid_file: str | None = None
    #: The files this config came from, in order (not a YAML key).
    files: tuple[str, ...] = ()
    #: The file each dotted key path came from (not a YAML key).
    origins: Mapping[str, str] = attrs.field(factory=dict, repr=False, eq=False)
    #: Worker types' own sections, by top-level key (validated by their attrs classes; not a key itself).
    sections: Mapping[str, Any] = attrs.field(factory=dict, eq=False)

    # -- derived -------------------------------------------------------------------

    def writers_of(self, stream: StreamDef) -> list[str]:
        """The ordered writers of a ``Writers.CONFIGURED`` stream: ``stream_writers.<name>``, else its defaults.

        A sharded stream's rows shard over this list.
        """
        return list(self.stream_writers.get(stream.name, stream.default_writers))

    def section(self, cls: type[T]) -> T:
        """The worker-type section of type ``cls`` (its defaults when the files have none)."""
        for value in self.sections.values():
            if isinstance(value, cls):
                return value
        raise LookupError(f"no config section of type {cls.__name__}")

    def replication_secret(self) -> str | None:
        """The shared secret of the internal channels (the hub's AUTH, RPC's bearer token).

        ``replication.secret``, else ``replication.secret_file``, else -- unless
        ``replication.allow_unauthenticated`` -- the file at
        :attr:`replication_secret_path`, created with a random secret if it is
        missing (see :mod:`synflow.shared_secret`).

        Raises:
            ConfigError: the secret file cannot be created or read, or is not private.
        """
        r = self.replication
        if r.secret is not None or r.secret_file is not None:
            return _secret(r.secret, r.secret_file)
        if r.allow_unauthenticated:
            return None
        try:
            return load_or_create_secret(self.replication_secret_path)
        except ConfigError as e:
            raise ConfigError(e.reason, path=self.origin("replication.secret_path"), key=e.key) from None

    @property
    def replication_secret_path(self) -> str:
        """The generated secret's file: ``replication.secret_path``, else ``<data_dir>/replication.secret``."""
        return self.replication.secret_path or os.path.join(self.data_dir, DEFAULT_SECRET_NAME)

    def listener(self, kind: str) -> Listener | None:
        """This process's configured listener serving ``kind``, if any.

        The internal listener and the hub are implied, not configured:
        :func:`synflow.listeners.serving` covers them too.
        """
        for listener in self.listeners:
            if kind in listener.resources:
                return listener
        return None

    # Everything a process writes defaults to a place under data_dir; a key
    # set explicitly wins.

    @property
    def database_path(self) -> str:
        """The SQLite file: ``database.path``, else ``<data_dir>/synflow.db``."""
        return self.database.path or os.path.join(self.data_dir, "synflow.db")

    def database_config(self) -> DatabaseConfig:
        """The storage layer's config from the ``database:`` section (the SQLite file resolved).

        Raises:
            ConfigError: a value the storage layer refuses, naming ``database.<key>``.
        """
        section = {k: v for k, v in attrs.asdict(self.database).items()
                   if v is not None and k != "repair_positions"}
        if section.get("engine", "sqlite") == "sqlite":
            section["path"] = self.database_path
        return DatabaseConfig.from_dict(section)

    @property
    def signing_key_file(self) -> str:
        """The signing key file: ``signing_key_path``, else ``<data_dir>/signing.key``."""
        return self.signing_key_path or os.path.join(self.data_dir, "signing.key")

    @property
    def audit_dir(self) -> str:
        """The audit log root: ``audit.dir``, else ``<data_dir>/audit``."""
        return self.audit.dir or os.path.join(self.data_dir, "audit")

    @property
    def log_path(self) -> str:
        """The twistd log file: ``log_file``, else ``<data_dir>/log/<instance>.log``."""
        return self.log_file or os.path.join(self.data_dir, "log", f"{self.instance_name}.log")

    @property
    def pid_path(self) -> str:
        """The twistd pidfile: ``pid_file``, else ``<data_dir>/run/<instance>.pid``."""
        return self.pid_file or os.path.join(self.data_dir, "run", f"{self.instance_name}.pid")

    def origin(self, key: str) -> str | None:
        """The file the dotted ``key`` (or its nearest enclosing key) came from."""
        return _origin(self.origins, key)


def _secret(value: str | None, path: str | None) -> str | None:
    if value is not None:
        return value
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return f.read().strip()


# -- loading ------------------------------------------------------------------------------


def load_config(paths: Sequence[str], overrides: Mapping[str, Any] | None = None) -> SynflowConfig:
    """Load, merge and validate config files.

    Args:
        paths: YAML files, later ones overriding earlier ones.
        overrides: a final mapping merged on top (used by tests and tools).

    Raises:
        ConfigError: naming the file, the key and what is wrong.
    """
    if not paths:
        raise ConfigError("no config file given (use --config FILE, repeatable)")
    merged: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for path in paths:
        data = read_yaml(path)
        _merge(merged, data, origins, path, "")
    if overrides:
        _merge(merged, dict(overrides), origins, "<overrides>", "")
    sections = _structure_sections(merged, origins)
    config = structure(SynflowConfig, merged, origins, "")
    config = attrs.evolve(config, files=tuple(str(p) for p in paths), origins=dict(origins), sections=sections)
    validate(config, origins)
    return config


def core_keys() -> frozenset[str]:
    """synflow's own top-level keys (a worker type's section may not use one)."""
    return frozenset(f.name for f in attrs.fields(SynflowConfig) if f.name not in NOT_KEYS)


def _structure_sections(merged: dict[str, Any], origins: Mapping[str, str]) -> dict[str, Any]:
    """Take the worker types' sections out of ``merged`` and structure each with its attrs class.

    Every registered worker type's section is accepted in any process's files
    (a shared file may hold them); one that is absent gets its defaults.
    """
    from synflow import registry  # it reads the config types defined here

    try:
        known = registry.config_sections()
        app = merged.get("app")
        if isinstance(app, str) and ":" in app:
            cls = registry.load_dotted(app)
            if cls.config is not None and cls.config.key not in core_keys():
                known.setdefault(cls.config.key, cls.config.type)
    except ConfigError as e:
        raise config_error(origins, "app", str(e)) from None
    sections: dict[str, Any] = {}
    for key, cls in known.items():
        sections[key] = structure(cls, merged.pop(key, {}), origins, key)
    return sections


def read_yaml(path: str) -> dict[str, Any]:
    """One config file's top-level mapping.

    Raises:
        ConfigError: naming the file if it is missing, unreadable, not YAML
            or not a mapping.
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError("config file not found", path=path) from None
    except OSError as e:
        raise ConfigError(f"cannot read config file: {e.strerror}", path=path) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"invalid YAML{where}: {problem}", path=path) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"the top level must be a mapping, got {_typename(data)}", path=path)
    return data


def _merge(into: dict[str, Any], data: Mapping[str, Any], origins: dict[str, str], path: str, prefix: str) -> None:
    for key, value in data.items():
        if not isinstance(key, str):
            raise ConfigError(f"keys must be strings, got {key!r}", path=path, key=prefix.rstrip(".") or None)
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value, origins, path, dotted + ".")
        else:
            into[key] = _copy(value)
            _record_origins(value, origins, path, dotted)


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _record_origins(value: Any, origins: dict[str, str], path: str, dotted: str) -> None:
    origins[dotted] = path
    if isinstance(value, dict):
        for k, v in value.items():
            _record_origins(v, origins, path, f"{dotted}.{k}")


def _origin(origins: Mapping[str, str], key: str) -> str | None:
    while key:
        if key in origins:
            return origins[key]
        key = key[: key.rindex("[")] if key.endswith("]") else key.rpartition(".")[0]
    return None


def config_error(origins: Mapping[str, str], key: str, message: str) -> ConfigError:
    """A ConfigError for ``key``, naming the file the key came from."""
    return ConfigError(message, path=_origin(origins, key), key=key or None)


# -- structuring --------------------------------------------------------------------------

#: SynflowConfig attributes that are not YAML keys.
NOT_KEYS = frozenset({"files", "origins", "sections"})


def _typename(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def structure(cls: type[T], data: Any, origins: Mapping[str, str], key: str) -> T:
    """Turn a mapping into the attrs class ``cls``, checking every key.

    Raises:
        ConfigError: for an unknown key, a missing required key, a wrong type
            or a bad value, naming its file and dotted key path.
    """
    if not isinstance(data, dict):
        raise config_error(origins, key, f"must be a mapping, got {_typename(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in attrs.fields(cls) if f.name not in NOT_KEYS}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        sub = f"{key}.{unknown[0]}" if key else unknown[0]
        raise config_error(origins, sub, f"unknown key (known keys here: {', '.join(sorted(fields))})")
    kwargs: dict[str, Any] = {}
    for name, field in fields.items():
        sub = f"{key}.{name}" if key else name
        if name not in data:
            if field.default is attrs.NOTHING:
                raise config_error(origins, sub, "is required")
            continue
        kwargs[name] = _convert(hints[name], data[name], origins, sub)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise config_error(origins, key, str(e)) from None


def _convert(tp: Any, value: Any, origins: Mapping[str, str], key: str) -> Any:
    origin = get_origin(tp)
    args = get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:
            return _convert(non_none[0], value, origins, key)
        raise config_error(origins, key, "unsupported union type")  # pragma: no cover
    if origin is Literal:
        if value not in args:
            raise config_error(origins, key, f"must be one of {', '.join(map(str, args))}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise config_error(origins, key, f"must be a list, got {_typename(value)}")
        return [_convert(args[0], v, origins, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise config_error(origins, key, f"must be a mapping, got {_typename(value)}")
        return {
            _convert(args[0], k, origins, key): _convert(args[1], v, origins, f"{key}.{k}")
            for k, v in value.items()
        }
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            choices = ", ".join(str(m.value) for m in tp)
            raise config_error(origins, key, f"must be one of {choices}, got {value!r}") from None
    if attrs.has(tp):
        return structure(tp, value, origins, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise config_error(origins, key, f"must be true or false, got {_typename(value)} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise config_error(origins, key, f"must be an integer, got {_typename(value)} {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise config_error(origins, key, f"must be a number, got {_typename(value)} {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise config_error(origins, key, f"must be a string, got {_typename(value)} {value!r}")
        return value
    raise config_error(origins, key, f"unsupported type {tp!r}")  # pragma: no cover


# -- cross-field checks -----------------------------------------------------------------------


def validate(config: SynflowConfig, origins: Mapping[str, str]) -> None:
    """Checks that span several keys. Raises ConfigError naming the key."""
    if not config.server_name or " " in config.server_name:
        raise config_error(origins, "server_name", f"must be a non-empty name without spaces, got {config.server_name!r}")
    if not config.instance_name or any(c in config.instance_name for c in " \n/"):
        raise config_error(origins, "instance_name", f"must be a non-empty name without spaces or slashes, got {config.instance_name!r}")
    for name in config.instance_map:
        if not name or " " in name:
            raise config_error(origins, "instance_map", f"bad instance name {name!r}")
    from synflow import registry  # it reads the config types defined here

    configurable = sorted(n for n, s in registry.streams().items() if s.writers is Writers.CONFIGURED)
    for stream, writers in config.stream_writers.items():
        if stream not in configurable:
            raise config_error(origins, f"stream_writers.{stream}",
                               f"unknown stream; the streams with configurable writers are: {', '.join(configurable)}")
        if not writers:
            raise config_error(origins, f"stream_writers.{stream}", "needs at least one writer")
        if len(set(writers)) != len(writers):
            raise config_error(origins, f"stream_writers.{stream}", "lists a writer twice")
        for writer in writers:
            if writer not in config.instance_map:
                raise config_error(
                    origins, f"stream_writers.{stream}",
                    f"writer {writer!r} is missing from instance_map (every writer needs an internal listener address)",
                )
    for i, sender in enumerate(config.federation_sender_instances):
        if sender not in config.instance_map:
            raise config_error(origins, f"federation_sender_instances[{i}]", f"{sender!r} is missing from instance_map")
    for i, inv in enumerate(config.caches.cache_invalidator_instances):
        if inv not in config.instance_map:
            raise config_error(origins, f"caches.cache_invalidator_instances[{i}]", f"{inv!r} is missing from instance_map")
    registry.check_app(config, lambda key, message: config_error(origins, key, message))
    _check_ports(config, origins)
    _check_exposure(config, origins)
    _check_secret_file(origins, "replication.secret_file", config.replication.secret_file)
    _check_secret_file(origins, "replication.redis.password_file", config.replication.redis.password_file)
    if config.caches.tier is not None:
        _check_secret_file(origins, "caches.tier.password_file", config.caches.tier.password_file)
    if config.replication.ping_timeout_s <= config.replication.ping_interval_s:
        raise config_error(origins, "replication.ping_timeout_s", "must be longer than replication.ping_interval_s")
    if not 0 < config.replication.high_water <= config.replication.hard_limit:
        raise config_error(origins, "replication.high_water", "need 0 < high_water <= hard_limit")
    from synflow.listeners import check_listeners  # it reads the config types defined here

    check_listeners(config, lambda key, message: config_error(origins, key, message))
    if config.log_level.upper() not in LOG_LEVELS:
        raise config_error(origins, "log_level", f"must be DEBUG, INFO, WARNING or ERROR, got {config.log_level!r}")
    for name, level in config.logging.levels.items():
        if not isinstance(level, str) or level.upper() not in LOG_LEVELS:
            raise config_error(origins, f"logging.levels.{name}", f"must be DEBUG, INFO, WARNING or ERROR, got {level!r}")
    if config.logging.max_bytes < 1024:
        raise config_error(origins, "logging.max_bytes", f"must be at least 1024, got {config.logging.max_bytes!r}")
    if config.logging.backups < 1:
        raise config_error(origins, "logging.backups", f"must be at least 1, got {config.logging.backups!r}")
    for name, url in config.federation.destinations.items():
        if not url.startswith(("http://", "https://")):
            raise config_error(origins, f"federation.destinations.{name}", f"must be an http:// or https:// URL, got {url!r}")
    _check_federation(config.federation, origins)
    _check_audit_and_limits(config, origins)
    _check_database(config, origins)
    _check_drivers(config, origins)


def _check_database(config: SynflowConfig, origins: Mapping[str, str]) -> None:
    """The storage layer's own checks of ``database:`` (ranges, consistency), naming the file."""
    try:
        config.database_config()
    except ConfigError as e:
        raise config_error(origins, e.key or "database", e.reason) from None


def _check_audit_and_limits(config: SynflowConfig, origins: Mapping[str, str]) -> None:
    """Range checks of ``audit:`` retention and the ``limits:`` rate limits."""
    positive: dict[str, float | None] = {
        "audit.max_bytes": config.audit.max_bytes,
        "audit.retain_bytes": config.audit.retain_bytes,
        "audit.retain_days": config.audit.retain_days,
        "limits.rate_limit_per_s": config.limits.rate_limit_per_s,
        "limits.sync_rate_limit_per_s": config.limits.sync_rate_limit_per_s,
        "limits.rate_limit_burst": config.limits.rate_limit_burst,
        "limits.sync_rate_limit_burst": config.limits.sync_rate_limit_burst,
    }
    for key, value in positive.items():
        if value is not None and not value > 0:
            raise config_error(origins, key, f"must be greater than 0 (or null to switch it off), got {value!r}")


#: The optional driver each backend needs, and the extra that installs it.
_DRIVERS = {"psycopg2": "postgres", "txredisapi": "redis"}


def _check_drivers(config: SynflowConfig, origins: Mapping[str, str]) -> None:
    """The PostgreSQL and Redis drivers are extras: name the missing one and how to install it."""
    needs: list[tuple[str, str]] = []
    if config.database.engine == "postgres":
        needs.append(("database.engine", "psycopg2"))
    if config.replication.transport is Transport.REDIS:
        needs.append(("replication.transport", "txredisapi"))
    if config.caches.tier is not None:
        needs.append(("caches.tier", "txredisapi"))
    for key, module in needs:
        if importlib.util.find_spec(module) is None:
            raise config_error(origins, key, f"needs the {module} package, which is not installed: "
                                             f"pip install 'synflow[{_DRIVERS[module]}]'")


def _check_federation(federation: FederationConfig, origins: Mapping[str, str]) -> None:
    """Range checks of ``federation:`` (the backoff and the sender's timers)."""
    backoff = federation.backoff
    positive = {
        "federation.backoff.initial_s": backoff.initial_s,
        "federation.backoff.max_s": backoff.max_s,
        "federation.catch_up_after_s": federation.catch_up_after_s,
        "federation.wakeup_interval_s": federation.wakeup_interval_s,
        "federation.request_timeout_s": federation.request_timeout_s,
        "federation.max_body_bytes": federation.max_body_bytes,
    }
    for key, value in positive.items():
        if not value > 0:
            raise config_error(origins, key, f"must be greater than 0, got {value!r}")
    if backoff.max_s < backoff.initial_s:
        raise config_error(origins, "federation.backoff.max_s",
                           f"must be at least federation.backoff.initial_s ({backoff.initial_s!r}), got {backoff.max_s!r}")
    if not backoff.multiplier >= 1:
        raise config_error(origins, "federation.backoff.multiplier",
                           f"must be at least 1 (1 keeps the interval fixed), got {backoff.multiplier!r}")
    if not 0 <= backoff.jitter < 1:
        raise config_error(origins, "federation.backoff.jitter", f"must be in [0, 1), got {backoff.jitter!r}")
    if not 0 <= federation.catch_up_max_events <= MAX_CATCH_UP_MAX_EVENTS:
        raise config_error(origins, "federation.catch_up_max_events",
                           f"must be in [0, {MAX_CATCH_UP_MAX_EVENTS}], got {federation.catch_up_max_events!r}")
    _check_federation_trust(federation, origins)


def _check_federation_trust(federation: FederationConfig, origins: Mapping[str, str]) -> None:
    """``federation.trusted_keys`` decode as ed25519 keys; ``ip_range_blacklist`` entries are CIDR ranges."""
    for server, keys in federation.trusted_keys.items():
        if not keys:
            raise config_error(origins, f"federation.trusted_keys.{server}", "lists no key")
        for kid, key in keys.items():
            where = f"federation.trusted_keys.{server}.{kid}"
            if not kid.startswith("ed25519:") or kid == "ed25519:":
                raise config_error(origins, where, "key IDs must be ed25519:<version>")
            try:
                raw = unpaddedbase64.decode_base64(key)
            except Exception:
                raw = b""
            if len(raw) != 32:
                raise config_error(origins, where, "must be a 32-byte ed25519 public key in unpadded base64")
    for i, entry in enumerate(federation.ip_range_blacklist or []):
        try:
            ipaddress.ip_network(entry, strict=False)
        except ValueError:
            raise config_error(origins, f"federation.ip_range_blacklist[{i}]",
                               f"{entry!r} is not an IP range (CIDR, e.g. 10.0.0.0/8)") from None


def _check_exposure(config: SynflowConfig, origins: Mapping[str, str]) -> None:
    """Without a secret, the internal channels may only be on loopback addresses."""
    r = config.replication
    if r.secret is not None and not r.secret.strip():
        raise config_error(origins, "replication.secret", "must not be empty")
    if not r.allow_unauthenticated or r.secret is not None or r.secret_file is not None:
        return
    exposed: list[tuple[str, str]] = []
    own = config.instance_map.get(config.instance_name)
    if own is not None:
        exposed.append((f"instance_map.{config.instance_name}.host", own.host))
    if r.transport is Transport.TCP:
        exposed.append(("replication.hub.host", r.hub.host))
    for i, listener in enumerate(config.listeners):
        if INTERNAL_CHANNELS & set(listener.resources):
            kind = listener.endpoint.split(":", 1)[0]
            address = tcp_address(listener.endpoint)
            if address is not None:
                exposed.append((f"listeners[{i}].endpoint", address[0]))
            elif kind != "unix":  # a unix socket is reached only through the file system
                exposed.append((f"listeners[{i}].endpoint", listener.endpoint))
    for key, host in exposed:
        if not is_loopback(host):
            raise config_error(
                origins, key,
                f"{host!r} is not a loopback address and replication.allow_unauthenticated leaves the internal "
                "channels without a secret; remove allow_unauthenticated (a secret is then created under "
                "data_dir) or set replication.secret_file",
            )


def _check_secret_file(origins: Mapping[str, str], key: str, path: str | None) -> None:
    if path is None:
        return
    try:
        with open(path, encoding="utf-8") as f:
            f.read()
    except OSError as e:
        raise config_error(origins, key, f"cannot read secret file {path!r}: {e.strerror}") from None


def listener_port(endpoint: str) -> int | None:
    """The TCP port a server endpoint description listens on (tcp, tcp6, ssl); None for unix, systemd, ..."""
    address = tcp_address(endpoint)
    return address[1] if address is not None else None


def _check_ports(config: SynflowConfig, origins: Mapping[str, str]) -> None:
    seen: dict[int, str] = {}

    def claim(port: int | None, key: str) -> None:
        if not port:
            return
        if port in seen:
            raise config_error(origins, key, f"port {port} is already used by {seen[port]}")
        seen[port] = key

    from synflow.listeners import effective_listeners  # it reads the config types defined here

    for i, listener in enumerate(config.listeners):
        problem = endpoint_problem(listener.endpoint)
        if problem is not None:
            raise config_error(origins, f"listeners[{i}].endpoint", problem)
    # The configured listeners, the internal listener and the hub.
    for served in effective_listeners(config):
        claim(listener_port(served.endpoint), served.key)
