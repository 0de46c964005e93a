#!/usr/bin/env python3
"""The main job: start a master with twistd, connect workers, replicate rows.

Starts ``twistd -n synflow`` as a real master process on a free loopback
port, connects two worker processes' worth of replication clients to its
hub, has one worker write a stream of RDATA rows, checks that the other
received every row exactly once and in order, and prints what happened.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from twisted.internet import reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.endpoints import TCP4ClientEndpoint

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from synflow.replication.client import ReplicationClientService
from synflow.replication.commands import RdataCommand
from synflow.testing import RecordingReceiver


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sleep(seconds: float) -> Deferred:
    d: Deferred = Deferred()
    reactor.callLater(seconds, d.callback, None)
    return d


@inlineCallbacks
def run(port: int, rows: int, result: dict):
    receivers = [RecordingReceiver(), RecordingReceiver()]
    clients = []
    for i, receiver in enumerate(receivers):
        svc = ReplicationClientService(
            TCP4ClientEndpoint(reactor, "127.0.0.1", port),
            server_name="localhost", instance_name=f"worker{i + 1}",
            handler=receiver, clock=reactor, rng=random.Random(i),
        )
        svc.startService()
        clients.append(svc)
    for _ in range(200):
        if all(c.connected and c.connection.core.handshake_complete for c in clients):
            break
        yield sleep(0.05)
    start = time.monotonic()
    for token in range(1, rows + 1):
        clients[0].send_command(RdataCommand("events", "worker1", token, [f"$ev{token}:localhost"]))
        if token % 1000 == 0:
            print(f"\r  sent {token}/{rows} rows", end="", flush=True)
            yield sleep(0)
    print()
    while len(receivers[1].received(RdataCommand)) < rows and time.monotonic() - start < 60:
        yield sleep(0.05)
    elapsed = time.monotonic() - start
    got = [c.token for c in receivers[1].received(RdataCommand)]
    result.update(sent=rows, received=len(got), in_order=got == list(range(1, rows + 1)), seconds=elapsed)
    for c in clients:
        yield c.stopService()
    reactor.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=20_000)
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="synflow-demo-")
    port = free_port()
    config = os.path.join(workdir, "master.yaml")
    with open(config, "w") as f:
        f.write(
            f"server_name: localhost\napp: master\ninstance_name: master\ndata_dir: {workdir}/var\n"
            f"audit: {{dir: {workdir}/var/audit}}\nreplication:\n  hub: {{host: 127.0.0.1, port: {port}}}\n"
        )
    log = os.path.join(workdir, "master.log")
    print(f"==> starting the master with twistd (hub on 127.0.0.1:{port}, log {log})")
    master = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "twistd"), "-n", "--pidfile", os.path.join(workdir, "master.pid"),
         "--logfile", log, "synflow", "--config", config]
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if master.poll() is not None:
                    print(open(log).read())
                    return 1
                time.sleep(0.1)
        print(f"==> two workers connect; worker1 writes {args.rows} RDATA rows through the hub")
        result: dict = {}
        reactor.callWhenRunning(run, port, args.rows, result)
        reactor.run()
    finally:
        master.terminate()
        master.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)
    ok = result.get("received") == args.rows and result.get("in_order")
    rate = result.get("received", 0) / max(result.get("seconds", 1e-9), 1e-9)
    print(f"==> worker2 received {result.get('received')}/{args.rows} rows, in order: {result.get('in_order')}, "
          f"{rate:,.0f} rows/s end to end")
    print("==> OK" if ok else "==> FAILED: rows were lost or reordered")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
