"""Worker types and streams are plugins: discovery, conflicts, failures, config sections and the listings."""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys

from twisted.trial.unittest import SynchronousTestCase

from synflow import registry
from synflow.config import load_config
from synflow.errors import ConfigError, PluginError
from synflow.framework import Capability, WorkerType
from synflow.streams import CACHES, EVENTS, FEDERATION
from synflow.tools import ctl
from tests.cluster import TWISTD
from tests.plugins import EXAMPLE, NOTES_PLUGIN, install_example, install_fake_distribution

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILTIN_APPS = {"master", "event_persister", "federation_sender", "cache_invalidator"}

SHARED = """
server_name: example.com
instance_map:
  master: {host: 127.0.0.1, port: 19093}
  notes1: {host: 127.0.0.1, port: 19094}
"""
NOTE_WRITER = "app: note_writer\ninstance_name: notes1\n"


class _Files(SynchronousTestCase):
    def write(self, name: str, text: str) -> str:
        d = getattr(self, "_dir", None) or os.path.abspath(self.mktemp())
        self._dir = d
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return path

    def load(self, own: str, shared: str = SHARED):
        return load_config([self.write("shared.yaml", shared), self.write("own.yaml", own)])


class BuiltinsTest(SynchronousTestCase):
    def test_builtins_are_entry_points(self):
        """The four built-in worker types and three streams are registered through setup.cfg's entry points."""
        parser = configparser.ConfigParser()
        parser.read(os.path.join(ROOT, "setup.cfg"))
        apps = dict(line.split(" = ") for line in parser.get("options.entry_points", "synflow.apps").strip().splitlines())
        streams = dict(line.split(" = ") for line in parser.get("options.entry_points", "synflow.streams").strip().splitlines())
        self.assertEqual(set(apps), BUILTIN_APPS)
        self.assertEqual(set(streams), {"events", "caches", "federation"})
        plugins = registry.discover()
        for name, value in apps.items():
            module, _, attr = value.partition(":")
            self.assertIs(plugins.apps[name], getattr(__import__(module, fromlist=[attr]), attr))
            self.assertTrue(plugins.origin[f"app:{name}"].startswith("synflow"))
        self.assertEqual(registry.streams(), {"events": EVENTS, "caches": CACHES, "federation": FEDERATION})

    def test_one_module_per_builtin_worker_type(self):
        """Each built-in worker type lives in its own module of synflow.worker_types."""
        modules = {registry.worker_type(name).__module__ for name in BUILTIN_APPS}
        self.assertEqual(modules, {f"synflow.worker_types.{name}" for name in BUILTIN_APPS})

    def test_master_roles_are_capabilities(self):
        """Migrations and the hub are capabilities the master declares, not a name the bootstrap checks."""
        self.assertEqual(registry.worker_type("master").capabilities,
                         frozenset({Capability.MIGRATIONS, Capability.REPLICATION_HUB}))
        for name in BUILTIN_APPS - {"master"}:
            self.assertEqual(registry.worker_type(name).capabilities, frozenset(), name)

    def test_no_code_names_an_app_outside_the_registry(self):
        """No module but the registry reads ``config.app``; APP_TYPES and the fixed STREAMS dict are gone."""
        found = []
        for directory, _, files in os.walk(os.path.join(ROOT, "synflow")):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(directory, name)
                with open(path, encoding="utf-8") as f:
                    for number, line in enumerate(f, 1):
                        if re.search(r"app ==|config\.app\b|\bAPP_TYPES\b|\bSTREAMS\b", line):
                            found.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}")
        self.assertEqual([f for f in found if not f.startswith("synflow/registry.py:")], [])


class DiscoveryTest(_Files):
    def test_installed_plugin_is_found(self):
        """A distribution's synflow.apps and synflow.streams entry points are found, with the distribution named."""
        install_fake_distribution(self, "notes-plugin", {"notes_plugin": NOTES_PLUGIN},
                                  apps={"note_writer": "notes_plugin:NoteWriter"},
                                  streams={"notes": "notes_plugin:NOTES"})
        plugins = registry.discover(refresh=True)
        self.assertEqual(plugins.apps["note_writer"].name, "note_writer")
        self.assertEqual(plugins.streams["notes"].table, "notes")
        self.assertEqual(plugins.origin["app:note_writer"], "notes-plugin")
        self.assertEqual(set(plugins.apps), BUILTIN_APPS | {"note_writer"})
        listing = "\n".join(plugins.listing())
        self.assertIn("note_writer", listing)
        self.assertIn("notes-plugin", listing)

    def test_two_distributions_claiming_one_name(self):
        """Two distributions registering one worker-type name stop start-up naming both."""
        install_fake_distribution(self, "notes-a", {"notes_a": NOTES_PLUGIN}, apps={"note_writer": "notes_a:NoteWriter"})
        install_fake_distribution(self, "notes-b", {"notes_b": NOTES_PLUGIN}, apps={"note_writer": "notes_b:NoteWriter"})
        with self.assertRaises(PluginError) as cm:
            registry.discover(refresh=True)
        message = str(cm.exception)
        self.assertIn("worker type 'note_writer' is claimed by two distributions", message)
        self.assertIn("notes-a (notes_a:NoteWriter)", message)
        self.assertIn("notes-b (notes_b:NoteWriter)", message)
        self.assertNotIn("\n", message)

    def test_plugin_whose_import_fails(self):
        """A plugin that cannot be imported is one line naming the plugin, its distribution and the cause."""
        install_fake_distribution(self, "broken-plugin", {"broken_plugin": "import no_such_module_here\n"},
                                  apps={"broken": "broken_plugin:Broken"})
        with self.assertRaises(PluginError) as cm:
            registry.discover(refresh=True)
        message = str(cm.exception)
        self.assertIn("worker type 'broken' (broken-plugin, broken_plugin:Broken) failed to load", message)
        self.assertIn("ModuleNotFoundError: No module named 'no_such_module_here'", message)
        self.assertNotIn("\n", message)

    def test_entry_point_of_the_wrong_kind(self):
        """An entry point naming something that is not a WorkerType (or a Stream) is refused by name."""
        install_fake_distribution(self, "odd-plugin", {"odd_plugin": NOTES_PLUGIN},
                                  apps={"odd": "odd_plugin:NotesConfig"}, streams={"notes": "odd_plugin:NoteRow"})
        with self.assertRaises(PluginError) as cm:
            registry.discover(refresh=True)
        self.assertIn("is not a synflow.api.WorkerType subclass", str(cm.exception))

    def test_entry_point_name_must_match(self):
        """A worker type registered under another name than its own ``name`` is refused."""
        install_fake_distribution(self, "alias-plugin", {"alias_plugin": NOTES_PLUGIN},
                                  apps={"scribe": "alias_plugin:NoteWriter"})
        with self.assertRaises(PluginError) as cm:
            registry.discover(refresh=True)
        self.assertIn("the class is named 'note_writer', not 'scribe'", str(cm.exception))

    def test_plugin_stream_may_not_reshard(self):
        """A plugin stream that claims to reshard live is refused: only synflow's events stream does."""
        source = NOTES_PLUGIN + "\n\nimport attrs as _attrs\nLIVE = _attrs.evolve(NOTES, reshardable=True)\n"
        install_fake_distribution(self, "live-plugin", {"live_plugin": source}, streams={"notes": "live_plugin:LIVE"})
        with self.assertRaises(PluginError) as cm:
            registry.discover(refresh=True)
        self.assertIn("reshardable is reserved for synflow's events stream", str(cm.exception))

    def test_two_types_reserving_one_instance_name(self):
        """A plugin reserving the instance name another worker type reserves is refused, naming both."""
        source = NOTES_PLUGIN + '\n\nclass Boss(NoteWriter):\n    name = "boss"\n    reserved_instance_name = "master"\n'
        install_fake_distribution(self, "boss-plugin", {"boss_plugin": source}, apps={"boss": "boss_plugin:Boss"})
        with self.assertRaises(PluginError) as cm:
            registry.discover(refresh=True)
        self.assertIn("worker types 'boss' and 'master' both reserve the instance name 'master'", str(cm.exception))

    def test_section_may_not_take_a_core_key(self):
        """A plugin whose config section is one of synflow's own keys is refused."""
        source = NOTES_PLUGIN.replace('api.Section("notes"', 'api.Section("database"')
        install_fake_distribution(self, "greedy-plugin", {"greedy_plugin": source},
                                  apps={"note_writer": "greedy_plugin:NoteWriter"})
        with self.assertRaises(PluginError) as cm:
            registry.discover(refresh=True)
        self.assertIn("config section 'database' is one of synflow's own keys", str(cm.exception))


class PluginConfigTest(_Files):
    def setUp(self) -> None:
        install_fake_distribution(self, "notes-plugin", {"notes_plugin": NOTES_PLUGIN},
                                  apps={"note_writer": "notes_plugin:NoteWriter"},
                                  streams={"notes": "notes_plugin:NOTES"})
        registry.discover(refresh=True)

    def test_section_is_structured_with_defaults(self):
        """A plugin's section is read into its attrs class; absent, it has its defaults."""
        config = self.load(NOTE_WRITER + "notes: {max_len: 7}\n")
        from notes_plugin import NotesConfig  # type: ignore[import-not-found]

        self.assertEqual(config.section(NotesConfig), NotesConfig(max_len=7))
        self.assertEqual(self.load(NOTE_WRITER).section(NotesConfig), NotesConfig(max_len=100))
        self.assertEqual(registry.app_name(config), "note_writer")

    def test_wrong_key_in_plugin_section(self):
        """A wrong key in a plugin's section is one line naming the file and the dotted key."""
        with self.assertRaises(ConfigError) as cm:
            self.load(NOTE_WRITER + "notes: {max_length: 7}\n")
        self.assertEqual(cm.exception.key, "notes.max_length")
        self.assertTrue(str(cm.exception).startswith(os.path.join(self._dir, "own.yaml")), str(cm.exception))
        self.assertIn("unknown key (known keys here: max_len)", str(cm.exception))

    def test_bad_value_in_plugin_section(self):
        """A plugin's validators run: a bad value names the section and the problem."""
        with self.assertRaises(ConfigError) as cm:
            self.load(NOTE_WRITER + "notes: {max_len: 0}\n")
        self.assertEqual(cm.exception.key, "notes")
        self.assertIn("max_len must be greater than 0, got 0", str(cm.exception))
        with self.assertRaises(ConfigError) as cm:
            self.load(NOTE_WRITER + "notes: {max_len: many}\n")
        self.assertEqual(cm.exception.key, "notes.max_len")

    def test_unknown_app_lists_plugins(self):
        """An unknown app lists every installed worker type, plugins included."""
        with self.assertRaises(ConfigError) as cm:
            self.load("app: indexer\ninstance_name: notes1\n")
        self.assertIn("available: cache_invalidator, event_persister, federation_sender, master, note_writer",
                      str(cm.exception))

    def test_reserved_instance_name(self):
        """Only the master may be called 'master', and the master must be."""
        with self.assertRaises(ConfigError) as cm:
            self.load("app: note_writer\ninstance_name: master\n")
        self.assertIn("'master' is reserved for the app: master process", str(cm.exception))

    def test_dotted_path_app(self):
        """``app: package.module:Class`` runs a worker type that is not registered; a bad path names it."""
        config = self.load("app: notes_plugin:NoteWriter\ninstance_name: notes1\n")
        self.assertEqual(registry.app_name(config), "note_writer")
        with self.assertRaises(ConfigError) as cm:
            self.load("app: notes_plugin:Nope\ninstance_name: notes1\n")
        self.assertEqual(cm.exception.key, "app")
        self.assertIn("worker type 'notes_plugin:Nope' failed to load: AttributeError", str(cm.exception))

    def test_stream_writers_of_plugin_streams(self):
        """stream_writers accepts the streams with configurable writers and lists them for anything else."""
        with self.assertRaises(ConfigError) as cm:
            self.load(NOTE_WRITER, SHARED + "stream_writers: {notes: [notes1]}\n")
        self.assertEqual(cm.exception.key, "stream_writers.notes")
        self.assertIn("the streams with configurable writers are: events", str(cm.exception))


class ListingTest(SynchronousTestCase):
    def test_twistd_help_lists_worker_types_and_streams(self):
        """``twistd synflow --help`` lists every worker type with its summary and every stream."""
        result = subprocess.run([TWISTD, "synflow", "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT)
        self.assertEqual(result.returncode, 0, result.stderr)
        for name in (*BUILTIN_APPS, "events", "caches", "federation"):
            self.assertRegex(result.stdout, rf"(?m)^  {name}\s")
        self.assertIn("[migrations, replication_hub]", result.stdout)

    def test_synflowctl_plugins(self):
        """``synflowctl plugins`` prints the same listing."""
        result = subprocess.run([sys.executable, "-m", "synflow.tools.ctl", "plugins"], capture_output=True,
                                text=True, timeout=60, cwd=ROOT)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(result.stdout.splitlines(), registry.discover().listing())

    def test_start_up_stops_on_a_broken_plugin(self):
        """twistd with a plugin whose import fails exits 78 with one line naming the plugin and the cause."""
        root = install_fake_distribution(self, "broken-plugin", {"broken_plugin": "raise RuntimeError('boom')\n"},
                                         apps={"broken": "broken_plugin:Broken"})
        config = os.path.join(root, "own.yaml")
        with open(config, "w", encoding="utf-8") as f:
            f.write("server_name: example.com\napp: master\ninstance_name: master\n")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, ROOT]))
        result = subprocess.run([TWISTD, "-n", "synflow", "--config", config], capture_output=True, text=True,
                                timeout=60, cwd=root, env=env)
        self.assertEqual(result.returncode, 78, result.stdout + result.stderr)
        lines = result.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, result.stderr)
        self.assertIn("worker type 'broken' (broken-plugin, broken_plugin:Broken) failed to load: RuntimeError: boom",
                      lines[0])

    def test_ctl_sorts_migrating_process_first(self):
        """synflowctl starts the process whose type applies migrations first."""
        procs = ctl.discover(os.path.join(ROOT, "workers"), [])
        self.assertTrue(registry.worker_type_for(procs[0].config).has(Capability.MIGRATIONS))
        self.assertTrue(issubclass(registry.worker_type_for(procs[1].config), WorkerType))


class OverlayDeploymentTest(SynchronousTestCase):
    def test_example_overlay_adds_its_processes(self):
        """``--config examples/receipts/workers/`` adds the example's three processes to the default five, every one
        reading the overlay's shared.yaml (its writers and addresses)."""
        install_example(self)
        overlay = os.path.join(EXAMPLE, "workers")
        procs = ctl.discover(os.path.join(ROOT, "workers"), [overlay])
        self.assertEqual(sorted(p.name for p in procs),
                         ["cache_invalidator1", "federation_sender1", "master", "persister1", "persister2",
                          "receipts1", "receipts2", "room_stats1"])
        self.assertEqual(procs[0].name, "master")
        for proc in procs:
            self.assertEqual(proc.files[-1], os.path.join(overlay, "shared.yaml"))
            self.assertEqual(proc.config.stream_writers["receipts"], ["receipts1", "receipts2"])
        apps = {p.name: registry.app_name(p.config) for p in procs}
        self.assertEqual((apps["receipts1"], apps["room_stats1"]), ("receipt_writer", "room_stats"))

    def test_two_process_files_with_one_instance_name(self):
        """An overlay process file reusing an instance name of the deployment is refused, naming the file."""
        install_example(self)
        overlay = os.path.abspath(self.mktemp())
        shutil.copytree(os.path.join(EXAMPLE, "workers"), overlay)
        shutil.copy(os.path.join(ROOT, "workers", "persister1.yaml"), os.path.join(overlay, "again.yaml"))
        with self.assertRaises(ConfigError) as cm:
            ctl.discover(os.path.join(ROOT, "workers"), [overlay])
        self.assertIn("instance_name 'persister1' is used by two process files", str(cm.exception))


class SurfaceTest(SynchronousTestCase):
    def test_every_other_module_says_it_is_internal(self):
        """Every synflow module but the public ones (synflow.api, its definitions, the test kit) says it is internal."""
        import ast

        public = {"synflow/__init__.py", "synflow/api.py", "synflow/framework.py", "synflow/testing/__init__.py",
                  "synflow/testing/conformance.py"}
        unmarked = []
        for directory, _, files in os.walk(os.path.join(ROOT, "synflow")):
            for name in files:
                path = os.path.relpath(os.path.join(directory, name), ROOT)
                if not name.endswith(".py") or path in public or name.startswith("_") and name != "__init__.py":
                    continue
                with open(os.path.join(ROOT, path), encoding="utf-8") as f:
                    doc = ast.get_docstring(ast.parse(f.read())) or ""
                if "Internal to synflow" not in doc:
                    unmarked.append(path)
        self.assertEqual(unmarked, [])

    def test_api_exports_what_it_declares(self):
        """synflow.api's ``__all__`` names exist, and the tutorial's reference documents each of them."""
        from synflow import api

        with open(os.path.join(ROOT, "docs", "framework.md"), encoding="utf-8") as f:
            doc = f.read()
        for name in api.__all__:
            self.assertTrue(hasattr(api, name), name)
            self.assertIn(f"**`{name}", doc, f"docs/framework.md does not document api.{name}")
