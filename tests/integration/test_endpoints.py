"""Listeners on any Twisted server endpoint: a real process serves its client API on a unix socket and /metrics on tcp6 ::1."""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import tempfile
import urllib.request

from twisted.trial.unittest import SynchronousTestCase

from synflow.tools import ctl
from tests.cluster import free_port
from tests.test_ctl import small_deployment


def _free_port6() -> int:
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        return int(s.getsockname()[1])


class EndpointListenerTest(SynchronousTestCase):
    def test_unix_and_tcp6_listeners(self):
        """A unix-socket client listener answers the client API and a tcp6 metrics listener serves /metrics, both from twistd."""
        directory = small_deployment(self, {"master": free_port(), "p1": free_port(), "p2": free_port()})
        sockdir = tempfile.mkdtemp(prefix="sf-")
        self.addCleanup(shutil.rmtree, sockdir, True)
        sock_path = os.path.join(sockdir, "client.sock")
        port6 = _free_port6()
        with open(os.path.join(directory, "master.yaml"), "a") as f:
            f.write(f"listeners:\n  - {{endpoint: 'unix:{sock_path}', resources: [client]}}\n"
                    f"  - {{endpoint: 'tcp6:{port6}:interface=\\:\\:1', resources: [metrics]}}\n")
        master = next(p for p in ctl.discover(directory, []) if p.name == "master")
        self.assertEqual(master.metrics_url, f"http://[::1]:{port6}/metrics")
        out = io.StringIO()
        self.addCleanup(ctl.stop, [master], io.StringIO())
        self.assertEqual(ctl.start([master], out), 0, out.getvalue())

        with urllib.request.urlopen(master.metrics_url, timeout=10) as response:
            self.assertEqual(response.status, 200)
            self.assertIn(b"synflow_", response.read())

        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(sock_path)
            s.sendall(b"GET /_synflow/client/v1/sync HTTP/1.0\r\nHost: localhost\r\n\r\n")
            raw = b""
            while chunk := s.recv(65536):
                raw += chunk
        head, _, body = raw.partition(b"\r\n\r\n")
        self.assertTrue(head.startswith(b"HTTP/1.0 401") or head.startswith(b"HTTP/1.1 401"), head)
        self.assertEqual(json.loads(body)["errcode"], "M_MISSING_TOKEN")
