"""The twistd entry point: command-line options and ``makeService``.

``twistd -n synflow --config workers/shared.yaml --config workers/master.yaml``
loads the config files (later ones override earlier ones), validates them,
and builds the process's service tree for its ``app``. A config error stops
start-up with one line naming the file, the key and the problem -- never a
traceback.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from twisted.application.service import IService
from twisted.python import usage

from synflow.errors import ConfigError, SynflowError


class Options(usage.Options):
    """Options of ``twistd synflow``."""

    synopsis = "--config FILE [--config FILE ...]"
    longdesc = (
        "Runs one synflow process. Its worker type (app:, one of those listed "
        "below or package.module:Class) and everything else come from the YAML "
        "config files; later files override earlier ones key by key. See "
        "docs/configuration.md for every key and docs/framework.md for plugins."
    )
    optFlags = [
        ["check-config", None, "Validate the config files, print a summary and exit."],
    ]

    def __init__(self) -> None:
        super().__init__()
        self["config"] = []

    def opt_config(self, path: str) -> None:
        """A YAML config file (repeatable; later files override earlier ones)."""
        self["config"].append(path)

    opt_c = opt_config

    def getUsage(self, width: int | None = None) -> str:
        """The usage text, then the worker types and streams installed (one per line)."""
        from synflow import registry

        try:
            listing = "\n".join(registry.discover().listing())
        except SynflowError as e:
            listing = f"(the installed plugins could not be listed: {e})"
        return f"{super().getUsage(width)}\n{listing}\n"

    def postOptions(self) -> None:
        if not self["config"]:
            raise usage.UsageError("at least one --config FILE is required")


def _after(result: Any, action: Callable[[], object]) -> Any:
    action()
    return result


def makeService(options: Options) -> IService:
    """Build the service tree of the configured process (twistd calls this)."""
    from twisted.internet import reactor

    from synflow.app.build import build_service, setup_logging
    from synflow.app.heap import freeze_startup_heap, watch_collections
    from synflow.app.logs import make_observer, with_log_observer
    from synflow.config import load_config

    try:
        config = load_config(options["config"])
        if options["check-config"]:
            from synflow import registry

            print(f"config OK: {registry.app_name(config)} {config.instance_name!r} of {config.server_name!r}")
            sys.exit(0)
        config.replication_secret()  # created now if missing: a bad secret file is a config error
        setup_logging(config)
        twistd = getattr(options, "parent", None) or {}
        observer = make_observer(config, twistd.get("logfile"), bool(twistd.get("nodaemon")))
        watch_collections()
        service = build_service(config, reactor)
        service.ready.addCallback(_after, freeze_startup_heap)  # the start-up heap: frozen once started
        return with_log_observer(service, observer)
    except ConfigError as e:
        # twistd would print a traceback; an operator needs one clear line.
        sys.stderr.write(f"synflow: configuration error: {e}\n")
        sys.exit(78)  # EX_CONFIG
    except SynflowError as e:
        sys.stderr.write(f"synflow: cannot start: {e}\n")
        sys.exit(1)
