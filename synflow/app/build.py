"""Builds the service tree of one process from its validated config.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import logging
from typing import Any

from synflow.app.apps import SynflowProcess
from synflow.config import SynflowConfig
from synflow.logbridge import TwistedBridge


def setup_logging(config: SynflowConfig) -> None:
    """Route synflow's stdlib logging into the process log at the configured level."""
    root = logging.getLogger()
    if not any(isinstance(h, TwistedBridge) for h in root.handlers):
        handler = TwistedBridge()
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
    root.setLevel(config.log_level.upper())
    # The log lines carry no caller, thread or process fields: skip collecting
    # them for every record (the logging HOWTO's "Optimization" settings).
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False


def build_service(config: SynflowConfig, reactor: Any, *, exit_on_failure: bool = True) -> SynflowProcess:
    """The process's root service for its ``app``."""
    return SynflowProcess(config, reactor, exit_on_failure=exit_on_failure)
