"""``synflowctl prometheus-config``: a Prometheus scrape config for a deployment's processes.

One job per deployment (``synflow-<server_name>``), one target per process
at the address its metrics are served on (its ``metrics`` listener, else its
internal listener), labelled with ``process`` (the instance name), ``app``
and ``server_name``. ``honor_labels`` keeps synflow's own ``instance`` label
(the writer a replication metric is about) instead of Prometheus's target
address. ``contrib/grafana/synflow.json`` queries these labels.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import yaml

from synflow import registry

__all__ = ["scrape_config"]


def scrape_config(procs: Sequence[Any], interval_s: int = 15) -> str:
    """The ``scrape_configs`` YAML for ``procs`` (``synflow.tools.ctl.Proc``); processes without a metrics URL are left out."""
    jobs: dict[str, list[dict[str, Any]]] = {}
    for proc in procs:
        url = proc.metrics_url
        if url is None:
            continue
        parts = urlsplit(url)
        target = parts.netloc
        jobs.setdefault(proc.config.server_name, []).append({
            "targets": [target],
            "labels": {"process": proc.name, "app": registry.app_name(proc.config), "server_name": proc.config.server_name},
        })
    config = {"scrape_configs": [
        {"job_name": f"synflow-{server}", "honor_labels": True, "scrape_interval": f"{interval_s}s",
         "metrics_path": "/metrics", "static_configs": static}
        for server, static in jobs.items()
    ]}
    return yaml.safe_dump(config, sort_keys=False)
