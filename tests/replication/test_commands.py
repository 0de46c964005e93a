"""The replication codec: round trips, golden lines, and refusing bad input."""

from __future__ import annotations

import copy
import os
import pickle
import re
import string

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from synflow.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from synflow.replication.commands import (
    COMMANDS,
    MAX_LINE_LENGTH,
    AuthCommand,
    ClearUserSyncCommand,
    ErrorCommand,
    FederationAckCommand,
    NameCommand,
    PingCommand,
    PositionCommand,
    RdataCommand,
    RemoteServerUpCommand,
    ReplicateCommand,
    ServerCommand,
    Side,
    SyncState,
    UserSyncCommand,
    encode_line,
    encode_line_bytes,
    may_send,
    parse_line,
    rdata_builder,
)
from synflow.replication.core import ConnectionOptions
from synflow.testing import RecordingReceiver, attach, make_protocol

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "data", "commands.golden")

# -- strategies -------------------------------------------------------------------

_text = st.text(
    alphabet=st.characters(blacklist_characters="\n", blacklist_categories=("Cs",)), max_size=40
)
_word = st.text(
    alphabet=st.characters(blacklist_characters="\n ", blacklist_categories=("Cs",)),
    min_size=1,
    max_size=30,
)
_ints = st.integers(min_value=-(2**63), max_value=2**63 - 1)
_json_scalar = st.none() | st.booleans() | _ints | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20)
_json = st.recursive(
    _json_scalar,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
_rows = st.lists(_json, max_size=6)

#: A strategy per command type.
_by_type: dict[type, st.SearchStrategy] = {
    AuthCommand: st.builds(AuthCommand, _text),
    ServerCommand: st.builds(ServerCommand, _text),
    NameCommand: st.builds(NameCommand, _text),
    PingCommand: st.builds(PingCommand, _text),
    ErrorCommand: st.builds(ErrorCommand, _text),
    ClearUserSyncCommand: st.builds(ClearUserSyncCommand, _text),
    RemoteServerUpCommand: st.builds(RemoteServerUpCommand, _text),
    ReplicateCommand: st.just(ReplicateCommand()),
    PositionCommand: st.builds(PositionCommand, _word, _word, _ints, _ints),
    RdataCommand: st.builds(RdataCommand, _word, _word, st.none() | _ints, _rows),
    UserSyncCommand: st.builds(
        UserSyncCommand,
        _word,
        _word,
        st.none() | _word.filter(lambda d: d != "None"),
        st.sampled_from(SyncState),
        _ints,
    ),
    FederationAckCommand: st.builds(FederationAckCommand, _word, _ints),
}

commands = st.one_of(*_by_type.values())

#: The server name both ends of the chunking tests agree on.
SERVER_NAME = "example.com"

#: Commands a server may send to a client (SERVER naming the expected server).
from_server = st.one_of(
    st.just(ServerCommand(SERVER_NAME)),
    *(_by_type[t] for t in (PingCommand, ErrorCommand, RemoteServerUpCommand, ReplicateCommand,
                            PositionCommand, RdataCommand)),
)

#: Commands a client may send to a server: every command but SERVER.
from_client = st.one_of(*(s for t, s in _by_type.items() if t is not ServerCommand))


class RoundTripTest(SynchronousTestCase):
    @given(commands)
    def test_round_trip(self, cmd):
        """Every command parses back to itself from its encoded line."""
        line = encode_line(cmd)
        self.assertNotIn("\n", line)
        self.assertEqual(parse_line(line), cmd)
        self.assertEqual(parse_line(line.encode("utf-8")), cmd)

    @given(st.lists(from_server, min_size=1, max_size=8), st.integers(min_value=1, max_value=7))
    def test_whole_or_byte_at_a_time_client_side(self, cmds, chunk):
        """A client receiving server commands whole, in chunks or byte by byte delivers exactly those commands."""
        self._check_chunkings(Side.CLIENT, cmds, cmds, chunk)

    @given(st.lists(from_client, min_size=1, max_size=8), st.integers(min_value=1, max_value=7))
    def test_whole_or_byte_at_a_time_server_side(self, cmds, chunk):
        """A server receiving client commands whole, in chunks or byte by byte delivers exactly those commands."""
        # A hub without a secret accepts AUTH and does not deliver it.
        expected = [c for c in cmds if not isinstance(c, AuthCommand)]
        self._check_chunkings(Side.SERVER, cmds, expected, chunk)

    def _check_chunkings(self, side: Side, cmds: list, expected: list, chunk: int) -> None:
        data = b"".join(encode_line(c).encode("utf-8") + b"\n" for c in cmds)
        for step in (len(data), chunk, 1):
            receiver = RecordingReceiver()
            proto = make_protocol(side, receiver, Clock(), server_name=SERVER_NAME,
                                  options=ConnectionOptions(ping_timeout_s=None))
            transport = attach(proto)
            for i in range(0, len(data), step):
                proto.dataReceived(data[i : i + step])
            self.assertEqual(receiver.received(), expected, f"fed {step} bytes at a time")
            self.assertFalse(transport.disconnecting, f"fed {step} bytes at a time")

    @given(commands)
    def test_parsed_commands_are_valid_and_keep_their_line(self, cmd):
        """A parsed command passes every field validator, and re-encodes to the exact bytes received."""
        data = encode_line(cmd).encode("utf-8")
        parsed = parse_line(data)
        attrs.validate(parsed)
        self.assertEqual(encode_line_bytes(parsed), data)
        self.assertEqual(encode_line_bytes(attrs.evolve(parsed)), data)

    def test_relayed_line_is_the_line_received(self):
        """A relay forwards a stream row's bytes as received, without re-encoding them."""
        data = b'RDATA events w1 7 ["$e:hs", "!r:hs",  "m.room.message", null, "@u:hs", null]'
        cmd = parse_line(data)
        self.assertEqual(encode_line_bytes(cmd), data)
        # a fresh command with the same fields encodes canonically, and remembers it
        fresh = RdataCommand("events", "w1", 7, list(cmd.row))
        self.assertEqual(fresh, cmd)
        canonical = b'RDATA events w1 7 ["$e:hs","!r:hs","m.room.message",null,"@u:hs",null]'
        self.assertEqual(encode_line_bytes(fresh), canonical)
        self.assertIs(encode_line_bytes(fresh), encode_line_bytes(fresh))

    def test_integer_fields_fast_and_slow_paths_agree(self):
        for text, value in (("0", 0), ("007", 7), ("123456789012345678", 123456789012345678),
                            ("9223372036854775807", 2**63 - 1), ("-5", -5)):
            self.assertEqual(parse_line(f"POSITION s w {text} 1").prev_token, value)
        for bad in ("9223372036854775808", "\u0661", "\u00b2", "1_000", "+1", " 1", ""):
            with self.assertRaises(RemoteProtocolError, msg=bad):
                parse_line(f"POSITION s w {bad.encode().decode('unicode_escape')} 1")

    def test_docstring_samples(self):
        """The sample line in every command's docstring parses and re-encodes exactly."""
        for name, cls in COMMANDS.items():
            match = re.search(r"Example: ``(.+?)``", cls.__doc__ or "")
            self.assertIsNotNone(match, f"{name} has no docstring example")
            sample = match.group(1)
            cmd = parse_line(sample)
            self.assertIsInstance(cmd, cls)
            self.assertEqual(encode_line(cmd).rstrip(" "), sample)


class FastConstructionTest(SynchronousTestCase):
    """Commands parsed or built on the fast paths (fields stored through their slots) are ordinary values."""

    @given(commands)
    def test_fast_path_values_equal_validated_ones_and_stay_frozen(self, cmd):
        """A parsed command equals the one its validating constructor builds from the same fields, and stays frozen."""
        parsed = parse_line(encode_line_bytes(cmd))
        rebuilt = attrs.evolve(parsed)  # through __init__ and every validator
        attrs.validate(parsed)
        attrs.validate(cmd)
        self.assertEqual(parsed, rebuilt)
        self.assertEqual(parsed, cmd)
        self.assertIs(type(parsed), type(cmd))
        for field in attrs.fields(type(parsed)):
            with self.assertRaises(attrs.exceptions.FrozenInstanceError):
                setattr(parsed, field.name, getattr(parsed, field.name))
            with self.assertRaises(attrs.exceptions.FrozenInstanceError):
                setattr(cmd, field.name, getattr(cmd, field.name))
            with self.assertRaises(attrs.exceptions.FrozenInstanceError):
                delattr(parsed, field.name)

    def test_text_commands_build_as_their_validators_allow(self):
        """A text command's own ``__init__`` stores any text without a newline and refuses what its validator refuses."""
        text_commands = [cls for cls in COMMANDS.values()
                         if len(attrs.fields(cls)) == 1 and attrs.fields(cls)[0].validator is not None
                         and cls is not ReplicateCommand]
        self.assertEqual(len(text_commands), 7)
        for cls in text_commands:
            field = attrs.fields(cls)[0].name
            for text in ("", "a b  c", "é\t\x00"):
                cmd = cls(text)
                self.assertEqual(getattr(cmd, field), text)
                self.assertEqual(cls(**{field: text}), cmd)
                attrs.validate(cmd)
                with self.assertRaises(attrs.exceptions.FrozenInstanceError):
                    setattr(cmd, field, "other")
            for bad, why in ((1, "must be a str"), (b"x", "must be a str"), (None, "must be a str"),
                             ("a\nb", "may not contain a newline")):
                with self.assertRaises(LocalProtocolError, msg=repr((cls, bad))) as cm:
                    cls(bad)
                self.assertIn(f"{cls.__name__}.{field} {why}", str(cm.exception))

            class Text(str):
                pass

            self.assertEqual(getattr(cls(Text("a b")), field), "a b")  # a str subclass, as the validator allows

            class Sub(cls):  # type: ignore[valid-type,misc]  # a plain subclass goes through the validator
                __slots__ = ()

            self.assertEqual(getattr(Sub("x"), field), "x")
            with self.assertRaises(LocalProtocolError):
                Sub("a\nb")

    def test_fast_constructors_refuse_what_validators_refuse(self):
        """The inlined checks of RDATA and POSITION refuse exactly what their field validators refuse."""
        for args in (("", "w1", 1), ("s s", "w1", 1), ("s", "w\n1", 1), ("s", "w1", 2**63), ("s", "w1", True),
                     (b"s", "w1", 1), ("s", "w1", 1.0)):
            with self.assertRaises(LocalProtocolError, msg=repr(args)):
                PositionCommand(*args, 1)  # type: ignore[arg-type]
            with self.assertRaises(LocalProtocolError, msg=repr(args)):
                RdataCommand(*args, [])  # type: ignore[arg-type]
        with self.assertRaises(LocalProtocolError):
            RdataCommand("s", "w1", None, ("not", "a", "list"))  # type: ignore[arg-type]

    @given(st.text(alphabet=string.ascii_letters + "_", min_size=1, max_size=8),
           st.text(alphabet=string.ascii_letters + "_1", min_size=1, max_size=8),
           st.none() | st.integers(-(2**63), 2**63 - 1),
           st.lists(st.none() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=8), max_size=4))
    def test_rdata_builder_builds_what_the_constructor_builds(self, stream, instance, token, row):
        """``rdata_builder(stream, instance)(token, row)`` is ``RdataCommand(stream, instance, token, row)``, wire and all."""
        built = rdata_builder(stream, instance)(token, row)
        expected = RdataCommand(stream, instance, token, row)
        self.assertIs(type(built), RdataCommand)
        self.assertEqual(built, expected)
        self.assertIsNone(built.wire)
        self.assertEqual(encode_line_bytes(built), encode_line_bytes(expected))
        with self.assertRaises(attrs.exceptions.FrozenInstanceError):
            built.token = 1  # type: ignore[misc]

    def test_rdata_builder_refuses_what_the_constructor_refuses(self):
        """A bad word is refused when the builder is made; a bad token or row on each build, as the constructor does."""
        for stream, instance in (("", "w1"), ("s s", "w1"), ("s", "w\n1"), (b"s", "w1"), ("s", "")):
            with self.assertRaises(LocalProtocolError, msg=repr((stream, instance))):
                rdata_builder(stream, instance)  # type: ignore[arg-type]
        build = rdata_builder("s", "w1")
        for token, row in ((2**63, []), (-(2**63) - 1, []), (True, []), (1.0, []), ("1", []), (1, ("a",)),
                           (None, "[]"), (1, None)):
            with self.assertRaises(LocalProtocolError, msg=repr((token, row))):
                build(token, row)  # type: ignore[arg-type]

    @given(commands)
    def test_copies_and_pickles_are_equal_values(self, cmd):
        """Commands built without running ``__init__`` still copy and pickle as the values they are."""
        for value in (cmd, parse_line(encode_line_bytes(cmd)), parse_line(encode_line_bytes(cmd), decode_rows=False)):
            for copied in (copy.copy(value), copy.deepcopy(value), pickle.loads(pickle.dumps(value))):
                self.assertIs(type(copied), type(cmd))
                self.assertEqual(copied, cmd)
                self.assertEqual(encode_line_bytes(copied), encode_line_bytes(cmd))

    def test_layout_check_refuses_a_frozen_class_with_slots_of_its_own(self):
        """The import-time check that lets a value change class fails for a class that adds a slot."""
        from synflow.slotted import check_layout

        class Fields:
            __slots__ = ("a", "__weakref__")

        @attrs.frozen
        class Same(Fields):
            a: int

        @attrs.frozen
        class More(Fields):
            a: int
            b: int

        check_layout(Same, Fields)
        with self.assertRaises(TypeError):
            check_layout(More, Fields)
        with self.assertRaises(TypeError):
            check_layout(Same, object)

    def test_subclasses_get_their_own_class(self):
        """A subclass of RDATA or POSITION is built as itself, through the validators."""

        class Row(RdataCommand):
            pass

        class Position(PositionCommand):
            pass

        row = Row("events", "w1", 3, ["x"])
        position = Position("events", "w1", 1, 2)
        self.assertIs(type(row), Row)
        self.assertIs(type(position), Position)
        self.assertEqual((row.stream_name, row.instance_name, row.token, row.row, row.wire),
                         ("events", "w1", 3, ["x"], None))
        self.assertEqual((position.prev_token, position.new_token, position.wire), (1, 2, None))
        self.assertIs(type(copy.copy(row)), Row)
        self.assertIs(type(copy.copy(position)), Position)
        with self.assertRaises(LocalProtocolError):
            Row("events", "w 1", 3, ["x"])


class GoldenLinesTest(SynchronousTestCase):
    EXPECTED = [
        AuthCommand("s3cret"),
        ServerCommand("example.com"),
        NameCommand("event_persister1"),
        PingCommand("1490197665618"),
        ReplicateCommand(),
        PositionCommand("events", "event_persister1", 1200, 1205),
        RdataCommand(
            "events",
            "event_persister1",
            1206,
            ["$ev1:example.com", "!room:example.com", "m.room.message", None, "@alice:example.com", None],
        ),
        RdataCommand("caches", "master", None, ["get_user_by_id", ["@test:localhost"], 1490197670513]),
        RdataCommand("caches", "master", 54, ["get_user_by_id", ["@test4:localhost"], 1490197670513]),
        RdataCommand("caches", "master", 55, ["get_user_by_id", None, 1490197670514]),
        RdataCommand("events", "w1", 7, ["café 😀", {"k": "v w"}, 1.5, -3]),
        ErrorCommand("Wrong remote"),
        UserSyncCommand("a1b2c", "@alice:example.com", "DEV1", SyncState.START, 1490197670513),
        UserSyncCommand("a1b2c", "@bob:example.com", None, SyncState.END, 1490197670999),
        ClearUserSyncCommand("a1b2c"),
        FederationAckCommand("federation_sender1", 3071),
        RemoteServerUpCommand("other.example.com"),
    ]

    def _golden(self):
        with open(GOLDEN, encoding="utf-8") as f:
            return [line.rstrip("\n") for line in f if not line.startswith("#")]

    def test_golden_lines_encode_exactly(self):
        """Encoding each command gives exactly its pinned golden line."""
        golden = self._golden()
        self.assertEqual(len(golden), len(self.EXPECTED))
        for cmd, line in zip(self.EXPECTED, golden, strict=True):
            self.assertEqual(encode_line(cmd), line)

    def test_golden_lines_parse(self):
        """Each golden line parses to the command it pins."""
        for cmd, line in zip(self.EXPECTED, self._golden(), strict=True):
            self.assertEqual(parse_line(line), cmd)

    def test_every_command_has_a_golden_line(self):
        """The golden file covers every command in the registry."""
        names = {line.split(" ", 1)[0] for line in self._golden()}
        self.assertEqual(names, set(COMMANDS))


class DirectionTest(SynchronousTestCase):
    def test_registry_directions(self):
        """SERVER is server-only, NAME and the presence/federation acks client-only, the rest both."""
        self.assertEqual(
            {n for n, c in COMMANDS.items() if not may_send(c, Side.CLIENT)}, {"SERVER"}
        )
        self.assertEqual(
            {n for n, c in COMMANDS.items() if not may_send(c, Side.SERVER)},
            {"AUTH", "NAME", "USER_SYNC", "CLEAR_USER_SYNC", "FEDERATION_ACK"},
        )


MALFORMED = [
    ("", "empty line"),
    (" PING 1", "starts with a space"),
    ("FOO bar", "unknown command"),
    ("ping 1", "unknown command"),
    ("REPLICATE now", "takes no arguments"),
    ("POSITION events w1 1", "needs 4 arguments"),
    ("POSITION events w1 one 2", "not an integer"),
    ("POSITION events w1 1 +2", "not an integer"),
    ("POSITION events w1 1 ٣", "not an integer"),
    ("POSITION events w1 1 2 3", "not an integer"),
    ("POSITION events  1 2", "instance name is empty"),
    ("POSITION events w1 1 99999999999999999999", "not an integer"),
    ("POSITION events w1 1 9223372036854775808", "out of range"),
    ("RDATA events w1 1", "needs 4 arguments"),
    ("RDATA events w1 x [1]", "not an integer"),
    ("RDATA events w1 1 [1,", "bad JSON"),
    ("RDATA events w1 1 [NaN]", "bad JSON"),
    ("RDATA events w1 1 [Infinity]", "bad JSON"),
    ("RDATA events w1 1 [-Infinity]", "bad JSON"),
    ("RDATA events w1 1 [1e400]", "Infinity"),
    ("RDATA events w1 1 {\"a\":1}", "JSON array"),
    ("RDATA events w1 1 [1] [2]", "bad JSON"),
    ("RDATA events w1 1 " + "[" * 16000, "bad JSON"),
    ("RDATA events w1 1 [" + "1" * 5000 + "]", "bad JSON"),
    ("USER_SYNC a @u:hs DEV sometimes 5", "'start' or 'end'"),
    ("USER_SYNC a @u:hs DEV start", "needs 5 arguments"),
    ("FEDERATION_ACK fs1", "needs 2 arguments"),
    ("FEDERATION_ACK fs1 1.5", "not an integer"),
    ("PING 1\n2", "embedded newline"),
]


class MalformedTest(SynchronousTestCase):
    def test_malformed_lines(self):
        """Each malformed line raises a ProtocolError whose message names the problem."""
        for line, fragment in MALFORMED:
            with self.assertRaises(RemoteProtocolError, msg=line[:60]) as cm:
                parse_line(line)
            self.assertIn(fragment, str(cm.exception), line[:60])

    def test_bad_utf8(self):
        """Bytes that are not UTF-8 are refused with a ProtocolError."""
        for raw in (b"PING \xff", b"SERVER \xc3\x28", b"\xed\xa0\x80"):
            with self.assertRaises(RemoteProtocolError) as cm:
                parse_line(raw)
            self.assertIn("UTF-8", str(cm.exception))

    def test_over_long_line(self):
        """A line over 16 KiB is refused on parse and on encode; one at the limit passes."""
        at_limit = "PING " + "x" * (MAX_LINE_LENGTH - 5)
        self.assertEqual(parse_line(at_limit.encode()), PingCommand("x" * (MAX_LINE_LENGTH - 5)))
        self.assertEqual(encode_line(PingCommand("x" * (MAX_LINE_LENGTH - 5))), at_limit)
        with self.assertRaises(RemoteProtocolError):
            parse_line((at_limit + "x").encode())
        with self.assertRaises(RemoteProtocolError):
            parse_line(at_limit + "é")
        with self.assertRaises(LocalProtocolError):
            encode_line(PingCommand("x" * (MAX_LINE_LENGTH - 4)))

    def test_local_errors(self):
        """Commands that could not be sent are refused when built or encoded."""
        with self.assertRaises(LocalProtocolError):
            PingCommand("a\nb")
        with self.assertRaises(LocalProtocolError):
            PositionCommand("events", "w 1", 1, 2)
        with self.assertRaises(LocalProtocolError):
            PositionCommand("events", "w1", 1, 2**63)
        with self.assertRaises(LocalProtocolError):
            encode_line(RdataCommand("events", "w1", 1, [float("nan")]))
        with self.assertRaises(LocalProtocolError):
            UserSyncCommand("a", "@u:hs", "None", SyncState.START, 1)

    def test_unsendable_commands_refused_by_the_bytes_encoder(self):
        """encode_line_bytes refuses what cannot go on the wire, with the reason, for each command shape."""
        too_long = ["x" * (MAX_LINE_LENGTH // 2), "y" * (MAX_LINE_LENGTH // 2)]
        cases = [
            (PingCommand("\ud800"), "PING line is not encodable as UTF-8"),
            (ServerCommand("hs\udfff"), "SERVER line is not encodable as UTF-8"),
            (PingCommand("x" * MAX_LINE_LENGTH), "longer than the limit"),
            (PositionCommand("events\ud800", "w1", 1, 2), "POSITION line is not encodable as UTF-8"),
            (PositionCommand("events", "w" * MAX_LINE_LENGTH, 1, 2), "longer than the limit"),
            (RdataCommand("events", "w1\ud800", 1, [1]), "RDATA line is not encodable as UTF-8"),
            (RdataCommand("events", "w1", None, [float("inf")]), "not encodable as JSON"),
            (RdataCommand("events", "w1", 1, [object()]), "not encodable as JSON"),
            (RdataCommand("events", "w1", 1, too_long), "longer than the limit"),
        ]
        for cmd, fragment in cases:
            with self.assertRaises(LocalProtocolError, msg=repr(cmd)[:80]) as cm:
                encode_line_bytes(cmd)
            self.assertIn(fragment, str(cm.exception), repr(cmd)[:80])
            self.assertIsNone(getattr(cmd, "wire", None))  # nothing half-encoded is kept for a relay

    def test_rows_the_fast_scan_does_not_settle(self):
        """Rows with surrounding whitespace parse as the JSON decoder reads them; other values are refused."""
        self.assertEqual(parse_line('RDATA events w1 1  [1, "a"] ').row, [1, "a"])
        for row_json, fragment in (("null", "JSON array"), ("[1] x", "bad JSON"), ("", "bad JSON")):
            with self.assertRaises(RemoteProtocolError, msg=row_json) as cm:
                parse_line(f"RDATA events w1 1 {row_json}")
            self.assertIn(fragment, str(cm.exception), row_json)

    @settings(max_examples=2000)
    @given(st.binary(max_size=200))
    def test_random_bytes_raise_only_protocol_errors(self, data):
        """Arbitrary bytes either parse or raise ProtocolError, never anything else."""
        try:
            parse_line(data)
        except ProtocolError:
            pass

    @settings(max_examples=2000)
    @given(
        st.sampled_from(sorted(COMMANDS)),
        st.text(alphabet=string.printable + "é😀[]{}\",:", max_size=60),
    )
    def test_random_arguments_raise_only_protocol_errors(self, name, args):
        """Any argument text after a real command name parses or raises ProtocolError."""
        try:
            parse_line(f"{name} {args}")
        except ProtocolError:
            pass
