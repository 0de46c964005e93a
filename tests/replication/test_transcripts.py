"""Replays every transcript in docs/protocol.md through the real adapter."""

from __future__ import annotations

import os
import re

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from synflow.replication.commands import Side, parse_line
from synflow.replication.core import ConnectionOptions
from synflow.testing import RecordingReceiver, attach, make_protocol, sent_lines

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "protocol.md")


def load_transcripts() -> list[tuple[str, list[str]]]:
    """(heading, lines) for each ```transcript block of the protocol doc."""
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    found = []
    heading = ""
    for block in re.finditer(r"^(### [^\n]*)$|^```transcript\n(.*?)^```", text, re.M | re.S):
        if block.group(1):
            heading = block.group(1)[4:]
        else:
            found.append((heading, block.group(2).splitlines()))
    return found


def replay(testcase: SynchronousTestCase, name: str, lines: list[str]) -> None:
    side = Side.SERVER
    start = 1000.0
    options: dict[str, object] = {}
    body = []
    for line in lines:
        if line.startswith("* replay "):
            side = Side.SERVER if line.split()[2] == "server" else Side.CLIENT
        elif line.startswith("* clock "):
            start = float(line.split()[2])
        elif line.startswith("* options "):
            for item in line.split()[2:]:
                key, _, value = item.partition("=")
                options[key] = int(value) if value.isdigit() else value
        else:
            body.append(line)
    clock = Clock()
    clock.advance(start)
    receiver = RecordingReceiver()
    proto = make_protocol(
        side, receiver, clock, server_name="example.com", instance_name="event_persister1",
        options=ConnectionOptions(**options)
    )
    transport = attach(proto)
    own, peer = (">", "<") if side is Side.SERVER else ("<", ">")
    output: list[str] = []
    fed = 0
    for step, line in enumerate(body):
        where = f"{name}, step {step + 1}: {line!r}"
        output += sent_lines(transport)
        if line.startswith(own + " "):
            expected = line[2:]
            testcase.assertTrue(output, f"{where}: expected this line, nothing was written")
            testcase.assertEqual(output.pop(0).rstrip(" "), expected.rstrip(" "), where)
        elif line.startswith(peer + " "):
            proto.dataReceived(line[2:].encode("utf-8") + b"\n")
            fed += 1
        elif line.startswith("* send "):
            proto.send_command(parse_line(line[len("* send "):]))
        elif line.startswith("* advance "):
            seconds = float(line.split()[2])
            for _ in range(int(seconds)):
                clock.advance(1)
            clock.advance(seconds - int(seconds))
        elif line == "* pause":
            proto.pauseProducing()
        elif line == "* resume":
            proto.resumeProducing()
        elif line == "* closed":
            output += sent_lines(transport)
            testcase.assertTrue(transport.disconnecting, f"{where}: connection still open")
        elif line.strip():
            testcase.fail(f"{where}: not a transcript line")
    output += sent_lines(transport)
    testcase.assertEqual(output, [], f"{name}: lines written but not in the transcript")


class TranscriptTest(SynchronousTestCase):
    def test_doc_has_transcripts(self):
        """The protocol doc holds a transcript for each exchange the spec promises."""
        headings = {h for h, _ in load_transcripts()}
        for expected in ("Handshake (server side)", "Handshake (client side)", "Wrong server",
                         "A batch of rows sharing one stream ID", "POSITION with a gap",
                         "Errors close the connection", "Keep-alive and ping timeout",
                         "Congestion: a slow reader is moved to catch-up", "Congestion: past the hard limit"):
            self.assertIn(expected, headings)

    def test_replay_every_transcript(self):
        """Every transcript in docs/protocol.md replays exactly through the real adapter."""
        transcripts = load_transcripts()
        self.assertGreaterEqual(len(transcripts), 10)
        for heading, lines in transcripts:
            replay(self, heading, lines)
