"""Builds the service tree of one process from its validated config."""

from __future__ import annotations

import logging
import sys
from typing import Any

from twisted.application.service import MultiService

from synflow.app.apps import SynflowProcess
from synflow.config import SynflowConfig


class _StderrHandler(logging.Handler):
    """Writes stdlib log records to the *current* ``sys.stderr``.

    Under twistd, stderr is redirected into the process log once logging
    starts (after ``makeService``), so the stream is looked up per record.
    """

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = self.format(record)
        except Exception:  # pragma: no cover
            msg = record.getMessage()
        sys.stderr.write(msg + "\n")


def setup_logging(config: SynflowConfig) -> None:
    """Route synflow's stdlib logging into the process log at the configured level."""
    root = logging.getLogger()
    if not any(isinstance(h, _StderrHandler) for h in root.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
        root.addHandler(handler)
    root.setLevel(config.log_level.upper())


def build_service(config: SynflowConfig, reactor: Any, *, exit_on_failure: bool = True) -> MultiService:
    """The process's root service for its ``app``."""
    return SynflowProcess(config, reactor, exit_on_failure=exit_on_failure)
