"""synflowctl: finding a deployment's processes, its config errors, status, stop order and restart."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from synflow.errors import ConfigError
from synflow.tools import ctl
from tests.cluster import free_port, poll_until
from tests.test_config import run_from_operator_directory

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
WORKERS = os.path.join(ROOT, "workers")
SYNFLOWCTL = os.path.join(ROOT, "scripts", "synflowctl")


def copy_workers(testcase: SynchronousTestCase) -> str:
    """A copy of workers/ without its production overlay."""
    target = os.path.abspath(testcase.mktemp())
    shutil.copytree(WORKERS, target, ignore=shutil.ignore_patterns("production.yaml"))
    return target


def write(directory: str, name: str, text: str) -> str:
    path = os.path.join(directory, name)
    with open(path, "w", encoding="utf-8") as f:
        f.write(textwrap.dedent(text))
    return path


def replace_in(path: str, old: str, new: str) -> None:
    """Rewrite the file at ``path`` with ``old`` replaced by ``new``."""
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(text.replace(old, new))


def small_deployment(testcase: SynchronousTestCase, ports: dict[str, int]) -> str:
    """A master and two persisters on the given internal ports, with data under the directory."""
    directory = os.path.abspath(testcase.mktemp())
    os.makedirs(directory)
    instance_map = "\n".join(f"  {name}: {{host: 127.0.0.1, port: {port}}}" for name, port in ports.items())
    write(directory, "shared.yaml", f"server_name: ctl.test\ndata_dir: {directory}/var\n"
                                    f"replication: {{hub: {{port: {free_port()}}}}}\n"
                                    f"instance_map:\n{instance_map}\nstream_writers: {{events: [p1, p2]}}\n")
    write(directory, "master.yaml", "app: master\ninstance_name: master\n")
    for name in ("p1", "p2"):
        write(directory, f"{name}.yaml", f"app: event_persister\ninstance_name: {name}\n"
                                         f"listeners: [{{endpoint: 'tcp:{free_port()}:interface=127.0.0.1', "
                                         "resources: [metrics]}]\n")
    return directory


class FakeHealth:
    """A /health endpoint on a thread, answering like a healthy synflow process."""

    def __init__(self, port: int, positions: dict[str, dict[str, int]]) -> None:
        body = json.dumps({"status": "ok", "problems": [], "positions": positions}).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200 if self.path == "/health" else 404)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class DiscoverTest(SynchronousTestCase):
    def discover_error(self, directory: str) -> ConfigError:
        """The config error discovering ``directory`` raises."""
        with self.assertRaises(ConfigError) as cm:
            ctl.discover(directory, [])
        return cm.exception

    def test_workers_master_first(self):
        """The default deployment has five processes, master first, each configured by shared.yaml then its own file."""
        procs = ctl.discover(WORKERS, [])
        self.assertEqual([p.name for p in procs],
                         ["master", "cache_invalidator1", "federation_sender1", "persister1", "persister2"])
        for proc in procs:
            self.assertEqual(proc.files, (os.path.join(WORKERS, "shared.yaml"), os.path.join(WORKERS, f"{proc.name}.yaml")))

    def test_config_appended_to_every_process(self):
        """Each --config file ends every process's list, so the production overlay switches all of them to PostgreSQL and Redis."""
        directory = copy_workers(self)
        overlay = os.path.join(WORKERS, "production.yaml")
        run_from_operator_directory(self)  # holds var/redis.password, which the overlay names
        procs = ctl.discover(directory, [overlay])
        self.assertEqual(len(procs), 5)
        for proc in procs:
            self.assertEqual(proc.files[-1], overlay)
            self.assertEqual(proc.config.files[-1], overlay)
            self.assertEqual(proc.config.database.engine, "postgres")
            self.assertEqual(proc.config.replication.transport.value, "redis")

    def test_broken_yaml_named(self):
        """A process file that is not valid YAML is a config error naming it, not a skipped process."""
        directory = copy_workers(self)
        path = write(directory, "persister2.yaml", "app: event_persister\ninstance_name: [persister2\n")
        error = self.discover_error(directory)
        self.assertEqual(error.path, path)
        self.assertIn("invalid YAML at line", str(error))

    def test_misspelt_app_key_named(self):
        """A misspelt ``app`` key is a config error naming the file and the key, with the likely spelling."""
        directory = copy_workers(self)
        for text in ("apps: event_persister\ninstance_name: persister2\n", "ap: event_persister\n"):
            path = write(directory, "persister2.yaml", text)
            error = self.discover_error(directory)
            self.assertEqual(error.path, path)
            self.assertEqual(error.key, text.split(":")[0])
            self.assertIn("did you mean 'app'?", str(error))

    def test_unknown_app_named(self):
        """An unknown app type is a config error naming the file and ``app``."""
        directory = copy_workers(self)
        path = write(directory, "persister2.yaml", "app: synchrotron\ninstance_name: persister2\n")
        error = self.discover_error(directory)
        self.assertEqual((error.path, error.key), (path, "app"))
        self.assertIn("unknown app 'synchrotron'", str(error))

    def test_process_file_without_app_named(self):
        """A process file with an instance_name but no app is refused, naming the file."""
        directory = copy_workers(self)
        path = write(directory, "persister2.yaml", "instance_name: persister2\n")
        error = self.discover_error(directory)
        self.assertEqual((error.path, error.key), (path, "app"))
        self.assertIn("is required", str(error))

    def test_overlay_in_directory_not_started(self):
        """A YAML file with neither app nor instance_name (an overlay) is not a process."""
        self.assertNotIn("production", [p.name for p in ctl.discover(WORKERS, [])])

    def test_port_shared_by_two_processes(self):
        """Two processes on one port is a config error naming the second one's file and key, and the first."""
        directory = copy_workers(self)
        path = os.path.join(directory, "persister2.yaml")
        replace_in(path, "tcp:9103", "tcp:9102")
        error = self.discover_error(directory)
        self.assertEqual((error.path, error.key), (path, "listeners[0].endpoint"))
        self.assertIn("port 9102 is already used by persister1", str(error))
        self.assertIn("persister1.yaml: listeners[0].endpoint", str(error))

    def test_instance_map_port_shared(self):
        """Two instance_map entries on one port are named in shared.yaml."""
        directory = copy_workers(self)
        shared = os.path.join(directory, "shared.yaml")
        replace_in(shared, "persister2: {host: 127.0.0.1, port: 9095}", "persister2: {host: 127.0.0.1, port: 9094}")
        error = self.discover_error(directory)
        self.assertEqual((error.path, error.key), (shared, "instance_map.persister2.port"))
        self.assertIn("already used by persister1", str(error))

    def test_metrics_listener_on_the_hub_port(self):
        """A worker's listener on the master's hub port is named in the worker's file."""
        directory = copy_workers(self)
        path = os.path.join(directory, "cache_invalidator1.yaml")
        replace_in(path, "tcp:9105", "tcp:9092")
        error = self.discover_error(directory)
        self.assertEqual((error.path, error.key), (path, "listeners[0].endpoint"))
        self.assertIn("master", str(error))
        self.assertIn("replication.hub.port", str(error))


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _reap(child: subprocess.Popen) -> None:
    """Kill a child process of the test and wait for it."""
    child.kill()
    child.wait(10)


def _environ() -> dict[str, str]:
    return dict(os.environ, SYNFLOW_VENV=sys.prefix)


class ScriptTest(SynchronousTestCase):
    """scripts/synflowctl itself, run from another directory."""

    def setUp(self) -> None:
        if not os.path.exists(os.path.join(sys.prefix, ".synflow-install-stamp")):
            self.skipTest(f"the virtualenv {sys.prefix} was not made by scripts/_venv.sh (the script would reinstall into it)")

    def run_ctl(self, *args: str, cwd: str) -> subprocess.CompletedProcess:
        return subprocess.run([SYNFLOWCTL, *args], capture_output=True, text=True, cwd=cwd, env=_environ(), timeout=120)

    def test_config_error_is_one_line(self):
        """A config error prints one line naming the file and key, no traceback, and exits 78."""
        directory = copy_workers(self)
        write(directory, "persister2.yaml", "app: event_persister\ninstance_name: persister2\nlog_levl: DEBUG\n")
        result = self.run_ctl("status", os.path.basename(directory), cwd=os.path.dirname(directory))
        self.assertEqual(result.returncode, 78, result.stderr)
        self.assertEqual(result.stdout, "")
        lines = [line for line in result.stderr.splitlines() if not line.startswith("==> ")]
        self.assertEqual(len(lines), 1, result.stderr)
        self.assertTrue(lines[0].startswith("synflowctl: configuration error: "), lines[0])
        self.assertIn(f"{os.path.basename(directory)}/persister2.yaml: log_levl: unknown key", lines[0])
        self.assertNotIn("Traceback", result.stderr)

    def test_relative_paths_from_another_directory(self):
        """A relative DIR and --config given from another directory are found there."""
        directory = copy_workers(self)
        parent = os.path.dirname(directory)
        shutil.copy(os.path.join(WORKERS, "production.yaml"), os.path.join(parent, "overlay.yaml"))
        os.makedirs(os.path.join(parent, "var"), exist_ok=True)
        with open(os.path.join(parent, "var", "redis.password"), "w") as f:
            f.write("a-redis-password\n")
        result = self.run_ctl("status", os.path.basename(directory), "--config", "overlay.yaml", cwd=parent)
        self.assertEqual(result.returncode, 3, result.stdout + result.stderr)  # 3: not every process is healthy
        lines = result.stdout.splitlines()
        self.assertEqual(lines[0].split(), list(ctl.STATUS_HEADER))
        self.assertEqual(len(lines), 6)
        for line in lines[1:]:
            self.assertIn("stopped", line)


class StatusStopRestartTest(SynchronousTestCase):
    """status, stop and restart against stand-in processes and /health endpoints."""

    def setUp(self) -> None:
        self.ports = {"master": free_port(), "p1": free_port(), "p2": free_port()}
        self.directory = small_deployment(self, self.ports)
        self.procs = ctl.discover(self.directory, [])
        self.sleepers: list[int] = []
        self.addCleanup(self.kill_sleepers)

    def kill_sleepers(self) -> None:
        for pid in self.sleepers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def serve_health(self, positions: dict[str, dict[str, int]]) -> None:
        for port in self.ports.values():
            self.addCleanup(FakeHealth(port, positions).close)

    def run_sleepers(self) -> dict[str, subprocess.Popen]:
        """One child process per process of the deployment, its pid in the pidfile, marked as synflowctl marks it."""
        children = {}
        for proc in self.procs:
            child = subprocess.Popen(["sleep", "120"], env=dict(os.environ, **{ctl.PIDFILE_ENV: proc.pid_file}))
            self.sleepers.append(child.pid)
            children[proc.name] = child
            os.makedirs(os.path.dirname(proc.pid_file), exist_ok=True)
            with open(proc.pid_file, "w") as f:
                f.write(f"{child.pid}\n")
            # Popen returns once exec has closed its error pipe, which can be before the kernel has set up the
            # new image's environment: until then /proc/<pid>/environ reads empty and the mark is not visible.
            poll_until(functools.partial(ctl.is_deployment_process, proc, child.pid), 10,
                       f"{proc.name}'s mark in its environment", interval=0.01)
            self.assertTrue(ctl.is_deployment_process(proc, child.pid), proc.name)
        return children

    def test_status_table(self):
        """The status table has its header, the full /metrics URL and every stream's positions for each process."""
        self.run_sleepers()
        self.serve_health({"events": {"p1": 12, "p2": 9}, "caches": {"master": 3, "p1": 1}, "empty": {}})
        out = io.StringIO()
        self.assertEqual(ctl.status(self.procs, out), 0)
        lines = out.getvalue().splitlines()
        self.assertEqual(lines[0].split(), ["instance", "app", "pid", "health", "metrics", "positions"])
        self.assertEqual(len(lines), 4)
        for proc, line in zip(self.procs, lines[1:], strict=True):
            pid = ctl.pid_of(proc)
            cells = line.split(None, 5)
            self.assertEqual(cells[:4], [proc.name, proc.config.app, str(pid), "healthy"])
            listener = proc.config.listener("metrics")
            port = ctl.listener_port(listener.endpoint) if listener else self.ports[proc.name]
            self.assertEqual(cells[4], f"http://127.0.0.1:{port}/metrics")
            self.assertEqual(cells[5], "caches: master=3 p1=1; events: p1=12 p2=9")

    def test_status_of_a_stopped_deployment(self):
        """With nothing running, every row says stopped and status exits 3."""
        out = io.StringIO()
        self.assertEqual(ctl.status(self.procs, out), 3)
        for line in out.getvalue().splitlines()[1:]:
            self.assertEqual(line.split()[2:4], ["-", "stopped"])

    def test_stop_in_reverse_order(self):
        """stop signals the processes in reverse start order, waits for each, and removes its pidfile."""
        children = self.run_sleepers()
        out = io.StringIO()
        self.assertEqual(ctl.stop(self.procs, out), 0)
        stopped = [line.split()[0] for line in out.getvalue().splitlines()]
        self.assertEqual(stopped, [p.name for p in reversed(self.procs)])
        self.assertEqual(stopped[-1], "master")
        for proc in self.procs:
            # stop waited until it had exited: it is gone or, if stop did not reap it (it is this test's
            # child, and a zombie counts as stopped), reaping it now finds it already dead.
            child = children[proc.name]
            self.assertTrue(not _exists(child.pid) or child.poll() is not None, proc.name)
            self.assertFalse(os.path.exists(proc.pid_file))

    def test_stop_does_not_wait_for_a_daemon_nobody_reaps(self):
        """A daemon that has exited but whose parent has not reaped it yet (a zombie) counts as stopped at once:
        stop reports it stopped and exits 0 instead of waiting out its timeout and killing it."""
        proc = self.procs[-1]
        os.makedirs(os.path.dirname(proc.pid_file), exist_ok=True)
        # The parent forks the "daemon" (marked as synflowctl marks it), writes its PID to the pidfile and then
        # sleeps without ever reaping it, as a container's init may.
        parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""\
            import os, signal, time
            pid = os.fork()
            if pid == 0:
                os.environ[{ctl.PIDFILE_ENV!r}] = {proc.pid_file!r}
                os.execvpe("sleep", ["sleep", "120"], os.environ)
            with open({proc.pid_file!r}, "w") as f:
                f.write(str(pid))
            time.sleep(120)
            """)])
        self.addCleanup(_reap, parent)
        poll_until(lambda: ctl.pid_of(proc) is not None, 10, "the stand-in daemon", interval=0.05)
        self.assertIsNotNone(ctl.pid_of(proc), "the stand-in daemon did not start")
        self.patch(ctl, "STOP_TIMEOUT_S", 5.0)
        out = io.StringIO()
        self.assertEqual(ctl.stop([proc], out), 0, out.getvalue())
        self.assertEqual(out.getvalue().split(), [proc.name, "stopped"])
        self.assertIsNone(ctl.pid_of(proc))

    def stranger(self, proc: ctl.Proc) -> subprocess.Popen:
        """An unrelated live process (a ``sleep``, unmarked) whose PID sits in ``proc``'s pidfile, as after PID reuse."""
        child = subprocess.Popen(["sleep", "120"])
        self.addCleanup(_reap, child)
        os.makedirs(os.path.dirname(proc.pid_file), exist_ok=True)
        with open(proc.pid_file, "w") as f:
            f.write(f"{child.pid}\n")
        return child

    def test_stop_leaves_an_unrelated_process_alone(self):
        """``synflowctl stop`` does not signal a live process that is not the deployment's: it reports the stale
        pidfile and removes it; status shows the instance stopped."""
        strangers = {proc.name: self.stranger(proc) for proc in self.procs}
        for proc in self.procs:
            self.assertIsNone(ctl.pid_of(proc))
            self.assertEqual(ctl.stale_pid(proc), strangers[proc.name].pid)
        result = subprocess.run([sys.executable, "-m", "synflow.tools.ctl", "stop", self.directory],
                                capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
        self.assertEqual(result.returncode, 0, result.stderr)
        for proc in self.procs:
            child = strangers[proc.name]
            self.assertIsNone(child.poll(), f"stop signalled the unrelated pid {child.pid}")
            self.assertIn(f"stale pidfile: pid {child.pid} is not this deployment's {proc.name} (not signalled)",
                          result.stdout)
            self.assertFalse(os.path.exists(proc.pid_file))
        out = io.StringIO()
        self.assertEqual(ctl.status(self.procs, out), 3)
        for line in out.getvalue().splitlines()[1:]:
            self.assertEqual(line.split()[2:4], ["-", "stopped"])

    def test_process_started_by_hand_is_recognised(self):
        """A process whose command line is ``twistd --pidfile <its pidfile> ... synflow`` counts as the deployment's,
        marked or not; the same command line with another pidfile does not."""
        proc = self.procs[0]
        script = "import time; time.sleep(120)"
        ours = subprocess.Popen([sys.executable, "-c", script, "--pidfile", proc.pid_file, "synflow"])
        other = subprocess.Popen([sys.executable, "-c", script, "--pidfile", proc.pid_file + ".other", "synflow"])
        for child in (ours, other):
            self.addCleanup(_reap, child)
        os.makedirs(os.path.dirname(proc.pid_file), exist_ok=True)
        with open(proc.pid_file, "w") as f:
            f.write(f"{ours.pid}\n")
        self.assertEqual(ctl.pid_of(proc), ours.pid)
        with open(proc.pid_file, "w") as f:
            f.write(f"{other.pid}\n")
        self.assertIsNone(ctl.pid_of(proc))
        self.assertEqual(ctl.stale_pid(proc), other.pid)

    def test_start_replaces_a_stale_pidfile(self):
        """start treats a pidfile naming an unrelated process as stale: it starts the instance, leaving that process be,
        and creates the deployment's secret (0600) first."""
        strangers = {proc.name: self.stranger(proc) for proc in self.procs}
        self.serve_health({"events": {"p1": 1, "p2": 1}})
        fake = self.fake_twistd()
        self.patch(ctl, "twistd", lambda: fake)
        out = io.StringIO()
        self.assertEqual(ctl.start(self.procs, out), 0, out.getvalue())
        for proc in self.procs:
            self.assertIsNone(strangers[proc.name].poll())
            self.assertIn(f"stale pidfile: pid {strangers[proc.name].pid}", out.getvalue())
            new = ctl.pid_of(proc)
            self.assertIsNotNone(new)
            self.sleepers.append(new)
            self.assertNotEqual(new, strangers[proc.name].pid)
        secret = self.procs[0].config.replication_secret_path
        self.assertEqual(stat.S_IMODE(os.stat(secret).st_mode), 0o600)

    def fake_twistd(self) -> str:
        """A stand-in for twistd: records its arguments, leaves a detached ``sleep`` behind in the pidfile, exits 0."""
        fake = os.path.abspath(self.mktemp()) + "-twistd"
        with open(fake, "w") as f:
            f.write(f"#!{sys.executable}\n" + textwrap.dedent("""\
                import subprocess, sys
                args = sys.argv[1:]
                pidfile, logfile = args[args.index("--pidfile") + 1], args[args.index("--logfile") + 1]
                child = subprocess.Popen(["sleep", "120"], start_new_session=True, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                with open(pidfile, "w") as f:
                    f.write(str(child.pid))
                with open(logfile, "a") as f:
                    f.write(" ".join(args) + "\\n")
            """))
        os.chmod(fake, 0o755)
        return fake

    def test_health_without_a_pidfile_is_not_a_start(self):
        """A /health that answers 200 while the started process never wrote its pidfile is reported, not "healthy"."""
        self.serve_health({"events": {"p1": 1, "p2": 1}})
        fake = os.path.abspath(self.mktemp()) + "-twistd"
        with open(fake, "w") as f:
            f.write(f"#!{sys.executable}\nimport sys\n")  # exits 0, forks nothing, writes no pidfile
        os.chmod(fake, 0o755)
        self.patch(ctl, "twistd", lambda: fake)
        out = io.StringIO()
        self.patch(sys, "stdout", out)
        self.assertNotEqual(ctl.main(["start", self.directory]), 0)
        self.assertIn(f"answering /health, but {self.procs[0].pid_file} names no live process", out.getvalue())
        self.assertNotIn("healthy (pid", out.getvalue())

    def test_restart(self):
        """restart stops every running process in reverse order, then starts each through twistd (master first) until healthy."""
        old = self.run_sleepers()
        self.serve_health({"events": {"p1": 1, "p2": 1}})
        fake = self.fake_twistd()
        self.patch(ctl, "twistd", lambda: fake)
        out = io.StringIO()
        self.patch(sys, "stdout", out)
        self.assertEqual(ctl.main(["restart", self.directory]), 0)
        lines = out.getvalue().splitlines()
        names = [p.name for p in self.procs]
        self.assertEqual([line.split()[0] for line in lines], list(reversed(names)) + names)
        self.assertTrue(all(line.endswith("stopped") for line in lines[:3]), lines)
        for proc in self.procs:
            self.assertFalse(_exists(old[proc.name].pid), proc.name)
            new = ctl.pid_of(proc)
            self.assertIsNotNone(new)
            self.sleepers.append(new)
            self.assertNotEqual(new, old[proc.name].pid)
            self.assertIn(f"healthy (pid {new})", out.getvalue())
            with open(proc.log_file) as f:
                argv = f.read().split()
            self.assertEqual(argv, ["--pidfile", proc.pid_file, "--logfile", proc.log_file, "synflow",
                                    "--config", proc.files[0], "--config", proc.files[1]])


class ReshardCommandTest(SynchronousTestCase):
    """synflowctl reshard/shards: argument and deployment errors are one clear line (the live paths run in
    tests/integration/test_reshard.py)."""

    def setUp(self) -> None:
        self.dir = small_deployment(self, {"master": free_port(), "p1": free_port(), "p2": free_port()})

    def run_main(self, *args: str) -> tuple[int, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = ctl.main(list(args))
            except SystemExit as e:
                code = int(e.code or 0)
        return code, out.getvalue() + err.getvalue()

    def test_reshard_needs_add_or_remove(self):
        """reshard with neither --add nor --remove (or both) is a usage error."""
        code, text = self.run_main("reshard", self.dir)
        self.assertEqual(code, 2)
        self.assertIn("reshard needs --add NAME or --remove NAME", text)
        code, text = self.run_main("reshard", self.dir, "--add", "p3", "--remove", "p2")
        self.assertEqual(code, 2)
        self.assertIn("not allowed with argument", text)

    def test_unknown_process_named(self):
        """--add of a process with no file in the directory names the file to add; nothing is started."""
        out = io.StringIO()
        self.assertEqual(ctl.reshard(ctl.discover(self.dir, []), "add", "p3", out), 1)
        self.assertEqual(out.getvalue().strip(),
                         "synflowctl: reshard failed: no process 'p3' in this deployment directory (add p3.yaml first)")

    def test_master_down(self):
        """With the master down, reshard --remove and shards say they cannot reach it, in one line."""
        procs = ctl.discover(self.dir, [])
        out = io.StringIO()
        self.assertEqual(ctl.reshard(procs, "remove", "p2", out), 1)
        self.assertRegex(out.getvalue().strip(), r"^synflowctl: reshard failed: cannot reach master at 127\.0\.0\.1:\d+")
        out = io.StringIO()
        self.assertEqual(ctl.shards(procs, out), 1)
        self.assertRegex(out.getvalue().strip(), r"^synflowctl: cannot reach master at 127\.0\.0\.1:\d+")
