"""contrib/grafana/synflow.json and synflowctl prometheus-config against a running default deployment."""

from __future__ import annotations

import io
import json
import os
import re
import urllib.request

import yaml
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from twisted.trial.unittest import SynchronousTestCase

from synflow.tools import ctl
from synflow.tools.deploy import DEFAULT_PORTS, free_port, make_deployment
from synflow.tools.prometheus import scrape_config

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DASHBOARD = os.path.join(ROOT, "contrib", "grafana", "synflow.json")

#: Suffixes PromQL adds to a metric family's name (counters, histograms).
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def queried_families(dashboard: dict) -> set[str]:
    """Every synflow metric family the dashboard's queries read."""
    names = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"\bsynflow_[a-z0-9_]+", target["expr"]):
                for suffix in _SUFFIXES:
                    if name.endswith(suffix):
                        name = name[: -len(suffix)]
                        break
                names.add(name)
    return names


def queried_labels(dashboard: dict) -> set[str]:
    """The labels the dashboard groups by."""
    labels = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for group in re.findall(r"by \(([^)]*)\)", target["expr"]):
                labels.update(label.strip() for label in group.split(","))
    return labels - {"le"}


class DashboardTest(SynchronousTestCase):
    def test_dashboard_queries_exported_metrics(self):
        """Every metric the Grafana dashboard queries is exported by the default deployment's processes, and the scrape config reaches them all."""
        with open(DASHBOARD, encoding="utf-8") as f:
            dashboard = json.load(f)
        families = queried_families(dashboard)
        self.assertGreaterEqual(len(families), 10)

        directory = os.path.abspath(self.mktemp())
        make_deployment(directory, "localhost", {p: free_port() for p in DEFAULT_PORTS})
        procs = ctl.discover(directory, [])
        self.assertEqual(len(procs), 5)
        out = io.StringIO()
        self.addCleanup(ctl.stop, procs, io.StringIO())
        self.assertEqual(ctl.start(procs, out), 0, out.getvalue())

        config = yaml.safe_load(scrape_config(procs))
        (job,) = config["scrape_configs"]
        self.assertEqual(job["job_name"], "synflow-localhost")
        self.assertTrue(job["honor_labels"])
        exported: set[str] = set()
        target_labels: set[str] = set()
        for static in job["static_configs"]:
            (target,) = static["targets"]
            target_labels.update(static["labels"])
            with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as response:
                text = response.read().decode()
            exported.update(family.name for family in text_string_to_metric_families(text))
        self.assertEqual({s["labels"]["process"] for s in job["static_configs"]}, {p.name for p in procs})
        self.assertEqual(families - exported, set(), "the dashboard queries metrics no process exports")

        # Each label the dashboard groups by is a label of a queried metric or one the scrape config adds.
        metric_labels = set(target_labels)
        for static in job["static_configs"]:
            with urllib.request.urlopen(f"http://{static['targets'][0]}/metrics", timeout=10) as response:
                for family in text_string_to_metric_families(response.read().decode()):
                    for sample in family.samples:
                        metric_labels.update(sample.labels)
        # Labelled metrics that have not been used yet export no sample: take their label names from their declarations.
        import synflow.app.apps  # noqa: F401  (registers every metric synflow declares)

        for collector in list(REGISTRY._collector_to_names):
            metric_labels.update(getattr(collector, "_labelnames", ()))
        self.assertEqual(queried_labels(dashboard) - metric_labels, set())
