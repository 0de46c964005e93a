"""The replication command codec: one frozen value class per command.

This module is pure: it turns one line of text into a command value and back,
and knows which side of a connection may send each command. It never touches
a socket, and it is shared by every transport (the TCP hub and Redis).

Wire format (the same text Synapse's replication protocol uses, byte for
byte): UTF-8, one command per line, ``\\n``-terminated on a stream transport.
The word before the first space is the command name; the rest of the line is
its argument string, which each class parses itself. A command is encoded as
``NAME + " " + args``, so a command without arguments goes out with a single
trailing space (``"REPLICATE "``); the parser accepts it with or without.
Rows are compact JSON arrays (``,`` and ``:`` separators, non-ASCII escaped),
and ``NaN``/``Infinity`` are refused in both directions.

Two functions form the public contract other code and outside checks rely on:

* :func:`parse_line` -- ``str | bytes`` to a command, raising
  :class:`~synflow.errors.RemoteProtocolError` (a ``ProtocolError``) and
  nothing else on any malformed input;
* :func:`encode_line` -- a command to its full line, without the newline,
  raising :class:`~synflow.errors.LocalProtocolError` if it cannot be sent.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import enum
import json
import json.scanner
import math
import operator
import re
import uuid
from collections.abc import Callable
from typing import Any, ClassVar, Final, Protocol, TypeAlias

import attrs

try:  # the fast JSON paths below; without them, the standard library's alone
    import orjson as _orjson
except ImportError:  # pragma: no cover - a dependency; absent only where it does not build
    _orjson = None  # type: ignore[assignment]
try:
    import msgspec.json as _msgspec_json
except ImportError:  # pragma: no cover
    _msgspec_json = None  # type: ignore[assignment]

from synflow.errors import LocalProtocolError, RemoteProtocolError
from synflow.json_encoding import c_chunk_encoder, reject_constant
from synflow.limits import MAX_LINE_LENGTH
from synflow.slotted import check_layout

#: The literal RDATA token of every row of a multi-row batch but the last.
BATCH_TOKEN: Final = "batch"

_INT_RE = re.compile(r"-?[0-9]{1,19}\Z")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class Side(enum.Flag):
    """Which end of a point-to-point connection a command comes from."""

    SERVER = enum.auto()
    CLIENT = enum.auto()
    BOTH = SERVER | CLIENT

    @property
    def word(self) -> str:
        """``"server"`` or ``"client"``, for messages."""
        return {Side.SERVER: "server", Side.CLIENT: "client"}.get(self, "peer")

    @property
    def peer(self) -> Side:
        """The opposite side; on a bus (BOTH) every peer may send anything."""
        if self is Side.BOTH:
            return Side.BOTH
        return Side.CLIENT if self is Side.SERVER else Side.SERVER


class Command(Protocol):
    """What every command class provides."""

    NAME: ClassVar[str]
    SENDERS: ClassVar[Side]

    @classmethod
    def from_args(cls, args: str) -> Command: ...

    def to_args(self) -> str: ...


# -- field helpers ----------------------------------------------------------


def _reject_newline(value: str, what: str) -> None:
    if "\n" in value:
        raise LocalProtocolError(f"{what} may not contain a newline: {value!r}")


def _check_word(instance: object, attribute: attrs.Attribute, value: str) -> None:
    """attrs validator: a non-empty field with no space or newline."""
    if not isinstance(value, str) or not value or " " in value or "\n" in value:
        raise LocalProtocolError(
            f"{type(instance).__name__}.{attribute.name} must be a non-empty string "
            f"without spaces or newlines, got {value!r}"
        )


def _check_text(instance: object, attribute: attrs.Attribute, value: str) -> None:
    """attrs validator: any string without a newline (may be empty, may hold spaces)."""
    if type(value) is str and "\n" not in value:
        return  # the common case, before any message is formatted
    if not isinstance(value, str):
        raise LocalProtocolError(f"{type(instance).__name__}.{attribute.name} must be a str")
    _reject_newline(value, f"{type(instance).__name__}.{attribute.name}")


def _check_int(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if type(value) is not int or not _INT64_MIN <= value <= _INT64_MAX:
        raise LocalProtocolError(
            f"{type(instance).__name__}.{attribute.name} must be a 64-bit integer, got {value!r}"
        )


def _parse_int(text: str, what: str) -> int:
    if 0 < len(text) < 19 and text.isdigit() and text.isascii():
        return int(text)  # the common case: a small non-negative token, always in range
    if not _INT_RE.match(text):
        raise RemoteProtocolError(f"{what} is not an integer: {text!r}")
    value = int(text)
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise RemoteProtocolError(f"{what} is out of range: {text!r}")
    return value


def _parse_word(text: str, what: str) -> str:
    if not text:
        raise RemoteProtocolError(f"{what} is empty")
    return text


def _split(args: str, count: int, command: str, fmt: str) -> list[str]:
    parts = args.split(" ", count - 1)
    if len(parts) != count:
        raise RemoteProtocolError(
            f"{command} needs {count} arguments ({fmt}), got {len(parts)}: {args!r}"
        )
    return parts


_new = object.__new__
_set = object.__setattr__


def _slot_setters(cls: type, *names: str) -> tuple[Any, ...]:
    """The ``__set__`` of each named slot of a frozen, slotted attrs class.

    They store a field past the class's frozen ``__setattr__``, as
    ``object.__setattr__(obj, name, value)`` does -- which looks the name up
    on the type and then calls this same descriptor, at about twice the cost.
    Text commands parsed from a line store their field through these, and
    RDATA and POSITION the values they cache (the decoded row, the encoded
    line); the class stays frozen to everyone else. RDATA and POSITION are
    built faster still, through their writable bases (:class:`_RdataFields`).
    """
    return tuple(cls.__dict__[name].__set__ for name in names)


def _store_and_validate(cmd: Any, **fields: Any) -> None:
    """Store ``fields`` and run the class's validators (the slow path of a fast ``__init__``)."""
    for name, value in fields.items():
        _set(cmd, name, value)
    attrs.validate(cmd)


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text[:32]!r} overflows to Infinity")
    return value


def _row_default(value: Any) -> Any:
    """A row value JSON has no type for: an enum member as its value, a UUID as its text; else TypeError."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, uuid.UUID):
        return str(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


_json_encoder = json.JSONEncoder(allow_nan=False, separators=(",", ":"), default=_row_default)
_json_decoder = json.JSONDecoder(parse_constant=reject_constant, parse_float=_finite_float)

# The C scanner and encoder behind the two objects above, called directly:
# ``JSONDecoder.decode`` adds two whitespace regex matches per value and
# ``JSONEncoder.encode`` builds a fresh C encoder per call, which together
# cost more than the JSON work on a typical row. The results are identical:
# the scanner is the decoder's own (same hooks), and anything it does not
# settle in one clean pass (leading or trailing whitespace, an error) goes
# through ``decode`` for the exact outcome and message. Without the C
# accelerator (another interpreter) both fall back to the objects above.
_c_make_scanner: Any = getattr(json.scanner, "c_make_scanner", None)
_scan_json: Any = _c_make_scanner(_json_decoder) if _c_make_scanner else None
# No circular-reference markers: a cycle ends in RecursionError, refused below.
_encode_json_chunks: Any = c_chunk_encoder(allow_nan=False, default=_row_default)

# orjson encodes a row in about a sixth of the standard encoder's time, and
# msgspec decodes one in about half the scanner's. Both are used only where
# their result is exactly the standard library's: anything else goes through
# the paths above, which settle the outcome, the text and the message.
#
# orjson's text is json.dumps's (compact, non-ASCII escaped, NaN refused),
# byte for byte, when it is ASCII (orjson writes non-ASCII as itself), holds
# no ``e-`` and no ``0.0000`` (orjson writes the exponents -5 to -9 as
# ``0.0000…`` and ``e-6``, where json writes ``e-05`` and ``e-06``; the same
# letters in a string cost only the fast path), and every ``null`` in it is
# one of the row's own top-level ``None`` (orjson writes NaN and Infinity as
# ``null``; a nested ``None`` costs only the fast path). orjson raises
# TypeError where json would do something else: subclasses of the built-in
# types, dataclasses, dates, integers past 64 bits, lone surrogates, deep
# nesting. Enum members and UUIDs, which orjson writes as their value and
# text, are written so by json too (:func:`_row_default`).
_orjson_dumps: Any = _orjson.dumps if _orjson is not None else None
_ORJSON_OPTIONS: Final = (
    _orjson.OPT_PASSTHROUGH_SUBCLASS | _orjson.OPT_PASSTHROUGH_DATACLASS | _orjson.OPT_PASSTHROUGH_DATETIME
    if _orjson is not None else 0
)
# msgspec's decoder accepts exactly RFC 8259 JSON, as json does with the
# hooks above (no NaN, nothing overflowing to infinity, integers within the
# interpreter's digit limit), and gives the same values; anything it refuses
# (a lone surrogate escape, a number out of its range, deep nesting) goes to
# json for the outcome.
_fast_decode: Any = _msgspec_json.Decoder().decode if _msgspec_json is not None else None


def _row_json(row: Any) -> str:
    """A row's compact JSON text (ASCII), as the standard encoder writes it; through orjson where that is the same.

    Raises:
        TypeError, ValueError, RecursionError: as the standard encoder (the callers word them).
    """
    if type(row) is not list:  # a subclass: the standard encoder's own
        return _json_encoder.encode(row)
    dumps = _orjson_dumps
    if dumps is not None:
        try:
            data: bytes = dumps(row, None, _ORJSON_OPTIONS)
        except TypeError:  # orjson.JSONEncodeError: json decides
            pass
        else:
            if data.isascii():
                text = data.decode()  # the checks are on text: ``in`` on bytes first tries an integer
                if (("-" not in text or "e-" not in text) and "0.0000" not in text
                        and ("null" not in text or text.count("null") == row.count(None))):
                    return text
    if _encode_json_chunks is not None:
        return "".join(_encode_json_chunks(row, 0))
    return _json_encoder.encode(row)


def encode_json(value: Any) -> str:
    """Encode a row as compact JSON, refusing NaN and Infinity.

    Raises:
        LocalProtocolError: if the value is not JSON-serialisable.
    """
    try:
        return _row_json(value)
    except (TypeError, ValueError, RecursionError) as e:
        raise LocalProtocolError(f"row is not encodable as JSON: {e}") from None


def decode_json(text: str) -> Any:
    """Decode JSON text, refusing NaN/Infinity and anything after the value.

    Raises:
        RemoteProtocolError: on any malformed JSON.
    """
    if _fast_decode is not None:
        try:
            return _fast_decode(text)
        except (ValueError, RecursionError):  # msgspec.DecodeError is a ValueError
            pass  # settled by the standard decoder
    return _standard_decode(text)


def _standard_decode(text: str) -> Any:
    """:func:`decode_json` through the standard library alone: what settles anything msgspec refuses."""
    if _scan_json is not None:
        try:
            value, end = _scan_json(text, 0)
        except (StopIteration, ValueError, RecursionError):
            pass  # settled below, with the decoder's own message
        else:
            if end == len(text):
                return value
    try:
        return _json_decoder.decode(text)
    except (ValueError, RecursionError) as e:
        raise RemoteProtocolError(f"bad JSON: {e}") from None


def _decode_row(row_json: str) -> list[Any]:
    """An RDATA row from its JSON text: a JSON array, or RemoteProtocolError."""
    row: Any
    if _fast_decode is not None:  # decode_json, inlined: once per row read
        try:
            row = _fast_decode(row_json)
        except (ValueError, RecursionError):
            row = _standard_decode(row_json)
    else:
        row = _standard_decode(row_json)
    if type(row) is not list:
        raise RemoteProtocolError(f"RDATA row must be a JSON array, got {row_json[:80]!r}")
    return row


# -- commands with a single free-text argument -------------------------------


def _init_text(cmd: Any, value: str) -> None:
    """The ``__init__`` of a command whose one field is free text: any ``str`` without a newline.

    The field is stored through its slot's own setter (see
    :func:`_slot_setters`) where attrs's frozen ``__init__`` would go through
    ``object.__setattr__`` and then call the validator; anything else (a
    value that is not such a text, a subclass) takes that same path, and the
    validator raises :class:`~synflow.errors.LocalProtocolError` naming the field.
    """
    store = _TEXT_FIELD_SETTER.get(type(cmd))
    if store is not None and type(value) is str and "\n" not in value:
        store(cmd, value)
    else:
        _store_and_validate(cmd, **{attrs.fields(type(cmd))[0].name: value})


@attrs.frozen(init=False)
class ServerCommand:
    """``SERVER <server_name>`` -- the server's identity, its first line.

    Example: ``SERVER example.com``
    """

    NAME: ClassVar[str] = "SERVER"
    SENDERS: ClassVar[Side] = Side.SERVER
    server_name: str = attrs.field(validator=_check_text)

    def __init__(self, server_name: str) -> None:
        _init_text(self, server_name)

    @classmethod
    def from_args(cls, args: str) -> ServerCommand:
        return cls(args)

    def to_args(self) -> str:
        return self.server_name


@attrs.frozen(init=False)
class NameCommand:
    """``NAME <instance_name>`` -- the client names itself for logs and metrics.

    Example: ``NAME event_persister1``
    """

    NAME: ClassVar[str] = "NAME"
    SENDERS: ClassVar[Side] = Side.CLIENT
    name: str = attrs.field(validator=_check_text)

    def __init__(self, name: str) -> None:
        _init_text(self, name)

    @classmethod
    def from_args(cls, args: str) -> NameCommand:
        return cls(args)

    def to_args(self) -> str:
        return self.name


@attrs.frozen(init=False)
class PingCommand:
    """``PING <data>`` -- keep-alive; the data is conventionally ms since the epoch.

    Example: ``PING 1490197665618``
    """

    NAME: ClassVar[str] = "PING"
    SENDERS: ClassVar[Side] = Side.BOTH
    data: str = attrs.field(validator=_check_text)

    def __init__(self, data: str) -> None:
        _init_text(self, data)

    @classmethod
    def from_args(cls, args: str) -> PingCommand:
        return cls(args)

    def to_args(self) -> str:
        return self.data


@attrs.frozen(init=False)
class ErrorCommand:
    """``ERROR <message>`` -- the sender hit an error and usually closes.

    Example: ``ERROR Wrong remote``
    """

    NAME: ClassVar[str] = "ERROR"
    SENDERS: ClassVar[Side] = Side.BOTH
    message: str = attrs.field(validator=_check_text)

    def __init__(self, message: str) -> None:
        _init_text(self, message)

    @classmethod
    def from_args(cls, args: str) -> ErrorCommand:
        return cls(args)

    def to_args(self) -> str:
        return self.message


@attrs.frozen(init=False)
class ClearUserSyncCommand:
    """``CLEAR_USER_SYNC <instance_id>`` -- forget every syncing user of that process.

    Example: ``CLEAR_USER_SYNC a1b2c``
    """

    NAME: ClassVar[str] = "CLEAR_USER_SYNC"
    SENDERS: ClassVar[Side] = Side.CLIENT
    instance_id: str = attrs.field(validator=_check_text)

    def __init__(self, instance_id: str) -> None:
        _init_text(self, instance_id)

    @classmethod
    def from_args(cls, args: str) -> ClearUserSyncCommand:
        return cls(args)

    def to_args(self) -> str:
        return self.instance_id


@attrs.frozen(init=False)
class RemoteServerUpCommand:
    """``REMOTE_SERVER_UP <server_name>`` -- a remote server seems reachable again.

    Example: ``REMOTE_SERVER_UP other.example.com``
    """

    NAME: ClassVar[str] = "REMOTE_SERVER_UP"
    SENDERS: ClassVar[Side] = Side.BOTH
    server_name: str = attrs.field(validator=_check_text)

    def __init__(self, server_name: str) -> None:
        _init_text(self, server_name)

    @classmethod
    def from_args(cls, args: str) -> RemoteServerUpCommand:
        return cls(args)

    def to_args(self) -> str:
        return self.server_name


@attrs.frozen(init=False)
class AuthCommand:
    """``AUTH <secret>`` -- the first line of a client when the hub requires a secret.

    Every deployment has a secret unless ``replication.allow_unauthenticated``
    is set (then plain TCP stays Synapse-compatible). The secret never appears
    in logs or reprs.

    Example: ``AUTH s3cret``
    """

    NAME: ClassVar[str] = "AUTH"
    SENDERS: ClassVar[Side] = Side.CLIENT
    secret: str = attrs.field(validator=_check_text, repr=False)

    def __init__(self, secret: str) -> None:
        _init_text(self, secret)

    @classmethod
    def from_args(cls, args: str) -> AuthCommand:
        return cls(args)

    def to_args(self) -> str:
        return self.secret


@attrs.frozen
class ReplicateCommand:
    """``REPLICATE`` -- ask every writer to announce its POSITION for each stream.

    Sent by a client after connecting; the TCP hub relays it so that every
    writer answers. It has no arguments and goes out as ``"REPLICATE "``.

    Example: ``REPLICATE``
    """

    NAME: ClassVar[str] = "REPLICATE"
    SENDERS: ClassVar[Side] = Side.BOTH

    @classmethod
    def from_args(cls, args: str) -> ReplicateCommand:
        if args.strip():
            raise RemoteProtocolError(f"REPLICATE takes no arguments, got {args!r}")
        return cls()

    def to_args(self) -> str:
        return ""


# -- stream commands -----------------------------------------------------------


class _PositionFields:
    """:class:`PositionCommand`'s slots, writable: a command is filled in as one of these and then
    becomes the frozen class (:mod:`synflow.slotted`)."""

    __slots__ = ("stream_name", "instance_name", "prev_token", "new_token", "wire", "__weakref__")
    stream_name: str
    instance_name: str
    prev_token: int
    new_token: int
    wire: bytes | None


@attrs.frozen(init=False)
class PositionCommand(_PositionFields):
    """``POSITION <stream> <instance> <prev_token> <new_token>``.

    The writer ``instance`` wrote nothing to ``stream`` in ``(prev, new]``. A
    reader whose position for that writer lies outside ``prev <= cur <= new``
    has missed rows and fetches them before advancing to ``new``.

    Example: ``POSITION events event_persister1 1200 1205``
    """

    NAME: ClassVar[str] = "POSITION"
    SENDERS: ClassVar[Side] = Side.BOTH
    stream_name: str = attrs.field(validator=_check_word)
    instance_name: str = attrs.field(validator=_check_word)
    prev_token: int = attrs.field(validator=_check_int)
    new_token: int = attrs.field(validator=_check_int)
    #: The encoded line, once known (parsed from or encoded to bytes); relays reuse it.
    wire: bytes | None = attrs.field(default=None, init=False, eq=False, repr=False)

    def __new__(cls, stream_name: str, instance_name: str, prev_token: int, new_token: int) -> PositionCommand:
        # The field validators, inlined: a writer sends one after every idle tick.
        if not (
            type(stream_name) is str and stream_name and " " not in stream_name and "\n" not in stream_name
            and type(instance_name) is str and instance_name and " " not in instance_name
            and "\n" not in instance_name
            and type(prev_token) is int and -0x8000000000000000 <= prev_token <= 0x7FFFFFFFFFFFFFFF
            and type(new_token) is int and -0x8000000000000000 <= new_token <= 0x7FFFFFFFFFFFFFFF
        ) or cls is not PositionCommand:
            return _validated(cls, stream_name=stream_name, instance_name=instance_name,  # raises, naming the field
                              prev_token=prev_token, new_token=new_token)
        return _position(stream_name, instance_name, prev_token, new_token, None)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.stream_name, self.instance_name, self.prev_token, self.new_token))

    @classmethod
    def from_args(cls, args: str) -> PositionCommand:
        return _parse_position(args, None)

    def to_args(self) -> str:
        return f"{self.stream_name} {self.instance_name} {self.prev_token} {self.new_token}"


def _parse_position(args: str, wire: bytes | None) -> PositionCommand:
    """POSITION's arguments."""
    parts = args.split(" ")
    if len(parts) == 4:
        return _position_from_fields(parts[0], parts[1], parts[2], parts[3], wire)
    # the message names the problem: a count, or an integer that swallowed a space
    stream, instance, prev, new = _split(args, 4, "POSITION", "<stream> <instance> <prev_token> <new_token>")
    return _position_from_fields(stream, instance, prev, new, wire)


def _position_from_fields(stream: str, instance: str, prev: str, new: str, wire: bytes | None) -> PositionCommand:
    """A POSITION from its four argument words; every field is checked here (no validators re-run)."""
    if (stream and instance and prev.isdigit() and new.isdigit() and len(prev) < 19 and len(new) < 19
            and prev.isascii() and new.isascii()):
        prev_token, new_token = int(prev), int(new)  # the common case: small tokens, in range
    else:
        prev_token = _parse_int(prev, "POSITION prev_token")
        new_token = _parse_int(new, "POSITION new_token")
        _parse_word(stream, "POSITION stream name")
        _parse_word(instance, "POSITION instance name")
    return _position(stream, instance, prev_token, new_token, wire)


def _position(stream: str, instance: str, prev_token: int, new_token: int, wire: bytes | None) -> PositionCommand:
    """A POSITION from fields already checked, filled in as its writable base (:mod:`synflow.slotted`)."""
    fields = _new(_PositionFields)
    fields.stream_name = stream
    fields.instance_name = instance
    fields.prev_token = prev_token
    fields.new_token = new_token
    fields.wire = wire
    fields.__class__ = PositionCommand
    return fields  # type: ignore[return-value]  # it is one now


def _validated(cls: type[Any], **fields: Any) -> Any:
    """A stream command of ``cls`` (or a subclass) stored through every field validator; its ``wire`` unset.

    Raises:
        LocalProtocolError: a field is invalid (the validator's message names it).
    """
    cmd = _new(cls)
    _store_and_validate(cmd, **fields)
    _set(cmd, "wire", None)
    return cmd


(_position_wire,) = _slot_setters(PositionCommand, "wire")


def _check_token(instance: object, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None:
        _check_int(instance, attribute, value)


def _check_row(instance: object, attribute: attrs.Attribute, value: Any) -> None:
    # A str is a row still undecoded (see RdataCommand.row): its JSON is checked when read.
    if not isinstance(value, list) and type(value) is not str:
        raise LocalProtocolError(f"RDATA row must be a list (a JSON array), got {value!r}")


class _RdataFields:
    """:class:`RdataCommand`'s slots, writable (as :class:`_PositionFields` for POSITION)."""

    __slots__ = ("stream_name", "instance_name", "token", "_row", "wire", "__weakref__")
    stream_name: str
    instance_name: str
    token: int | None
    _row: list[Any] | str
    wire: bytes | None


@attrs.frozen(init=False, eq=False, repr=False)
class RdataCommand(_RdataFields):
    """``RDATA <stream> <instance> <token|batch> <row_json>`` -- one stream row.

    Rows that share one stream ID go out as consecutive RDATA, all but the
    last with the token ``batch`` (``token is None`` here); a reader buffers
    them and advances only on the numeric token. The row is a JSON array
    whose shape the stream defines; it may contain spaces, never newlines.

    A command parsed with ``decode_rows=False`` (what a connection core
    does) keeps its row's JSON text and decodes it when :attr:`row` is first
    read, as strictly as :func:`parse_line` does, raising
    :class:`~synflow.errors.RemoteProtocolError` if it is not a JSON array.
    A relay that never reads the row forwards the received bytes untouched.

    Example: ``RDATA caches master 54 ["get_user_by_id",["@b:hs"],1700000000000]``
    """

    NAME: ClassVar[str] = "RDATA"
    SENDERS: ClassVar[Side] = Side.BOTH
    stream_name: str = attrs.field(validator=_check_word)
    instance_name: str = attrs.field(validator=_check_word)
    token: int | None = attrs.field(validator=_check_token)
    #: The row (a list), or its JSON text until :attr:`row` is first read.
    _row: list[Any] | str = attrs.field(validator=_check_row, alias="row")
    #: The encoded line, once known (parsed from or encoded to bytes); relays reuse it.
    wire: bytes | None = attrs.field(default=None, init=False)

    def __new__(cls, stream_name: str, instance_name: str, token: int | None, row: list[Any]) -> RdataCommand:
        # The field validators, inlined: rows are built once per row written.
        if not (
            type(stream_name) is str and stream_name and " " not in stream_name and "\n" not in stream_name
            and type(instance_name) is str and instance_name and " " not in instance_name
            and "\n" not in instance_name
            and (token is None or (type(token) is int and -0x8000000000000000 <= token <= 0x7FFFFFFFFFFFFFFF))
            and isinstance(row, list)
        ) or cls is not RdataCommand:
            cmd = _validated(cls, stream_name=stream_name, instance_name=instance_name, token=token,
                             _row=row if isinstance(row, list) else [])  # raises, naming the field
            if not isinstance(row, list):
                raise LocalProtocolError(f"RDATA row must be a list (a JSON array), got {row!r}")
            return cmd
        return _rdata(stream_name, instance_name, token, row, None)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.stream_name, self.instance_name, self.token, self.row))

    @property
    def row(self) -> list[Any]:
        """The row, decoded from the wire on first use.

        Raises:
            RemoteProtocolError: the row arrived undecoded and is not a JSON array.
        """
        row = self._row
        if type(row) is str:
            row = _decode_row(row)
            _rdata_row(self, row)
        return row  # type: ignore[return-value]

    @property
    def row_decoded(self) -> bool:
        """Whether the row's JSON has been decoded (always, unless parsed with ``decode_rows=False``)."""
        return type(self._row) is not str

    @classmethod
    def from_args(cls, args: str) -> RdataCommand:
        return _parse_rdata(args, True, None)

    def to_args(self) -> str:
        token = BATCH_TOKEN if self.token is None else str(self.token)
        return f"{self.stream_name} {self.instance_name} {token} {encode_json(self.row)}"

    def _compared(self) -> tuple[Any, ...]:
        try:
            row: Any = self.row
        except RemoteProtocolError:
            row = ("undecodable JSON", self._row)
        return (self.stream_name, self.instance_name, self.token, row)

    def __eq__(self, other: object) -> bool:
        if type(other) is not RdataCommand:
            return NotImplemented
        return self._compared() == other._compared()

    __hash__ = None  # type: ignore[assignment]  # rows are lists: not hashable

    def __repr__(self) -> str:
        try:
            row: Any = self.row
        except RemoteProtocolError:
            row = f"<undecodable JSON {self._row!r}>"
        return (f"RdataCommand(stream_name={self.stream_name!r}, instance_name={self.instance_name!r}, "
                f"token={self.token!r}, row={row!r})")


def _parse_rdata(args: str, decode_rows: bool, wire: bytes | None) -> RdataCommand:
    """RDATA's arguments."""
    parts = args.split(" ", 3)
    if len(parts) != 4:
        raise RemoteProtocolError(
            f"RDATA needs 4 arguments (<stream> <instance> <token> <row_json>), got {len(parts)}: {args!r}"
        )
    return _rdata_from_fields(parts[0], parts[1], parts[2], parts[3], decode_rows, wire)


def _rdata_from_fields(stream: str, instance: str, token: str, row_json: str, decode_rows: bool,
                       wire: bytes | None) -> RdataCommand:
    """An RDATA from its four argument words; every field is checked here (no validators re-run)."""
    if not stream:
        raise RemoteProtocolError("RDATA stream name is empty")
    if not instance:
        raise RemoteProtocolError("RDATA instance name is empty")
    number: int | None
    if token.isdigit() and len(token) < 19 and token.isascii():
        number = int(token)  # the common case: a small non-negative token, always in range
    elif token == BATCH_TOKEN:
        number = None
    else:
        number = _parse_int(token, "RDATA token")
    # a relay sends the bytes received on unchanged (wire)
    return _rdata(stream, instance, number, _decode_row(row_json) if decode_rows else row_json, wire)


def _rdata(stream: str, instance: str, token: int | None, row: list[Any] | str, wire: bytes | None) -> RdataCommand:
    """An RDATA from fields already checked, filled in as its writable base (:mod:`synflow.slotted`)."""
    fields = _new(_RdataFields)
    fields.stream_name = stream
    fields.instance_name = instance
    fields.token = token
    fields._row = row
    fields.wire = wire
    fields.__class__ = RdataCommand
    return fields  # type: ignore[return-value]  # it is one now


# The row decoded on first read and the line encoded on first send are stored past the frozen class.
_rdata_row, _rdata_wire = _slot_setters(RdataCommand, "_row", "wire")


def rdata_builder(stream_name: str, instance_name: str) -> Callable[[int | None, list[Any]], RdataCommand]:
    """``build(token, row)``: ``RdataCommand(stream_name, instance_name, token, row)``, the two words checked once.

    A writer announcing a transaction builds one RDATA per row, all of one
    stream and one writer: the builder checks those two words here, and on
    each call only what varies (the token, and that the row is a list), as
    the constructor does, raising the constructor's own error otherwise.

    Raises:
        LocalProtocolError: ``stream_name`` or ``instance_name`` is not a
            non-empty word (here), or a token or row is invalid (in ``build``).
    """
    RdataCommand(stream_name, instance_name, None, [])  # raises, naming the field

    def build(token: int | None, row: list[Any]) -> RdataCommand:
        if type(row) is list and (token is None or (type(token) is int and _INT64_MIN <= token <= _INT64_MAX)):
            return _rdata(stream_name, instance_name, token, row, None)
        return RdataCommand(stream_name, instance_name, token, row)  # raises, naming the field

    return build

check_layout(PositionCommand, _PositionFields)
check_layout(RdataCommand, _RdataFields)


class SyncState(enum.Enum):
    """Whether a user started or stopped syncing (USER_SYNC)."""

    START = "start"
    END = "end"


def _check_device(instance: object, attribute: attrs.Attribute, value: str | None) -> None:
    if value is None:
        return
    _check_word(instance, attribute, value)
    if value == "None":
        raise LocalProtocolError('USER_SYNC device_id may not be the literal "None" (it means no device)')


@attrs.frozen
class UserSyncCommand:
    """``USER_SYNC <instance_id> <user_id> <device_id|None> <start|end> <last_sync_ms>``.

    A user started or stopped syncing on the sending process.

    Example: ``USER_SYNC a1b2c @alice:example.com DEV1 start 1490197670513``
    """

    NAME: ClassVar[str] = "USER_SYNC"
    SENDERS: ClassVar[Side] = Side.CLIENT
    instance_id: str = attrs.field(validator=_check_word)
    user_id: str = attrs.field(validator=_check_word)
    device_id: str | None = attrs.field(validator=_check_device)
    state: SyncState = attrs.field(validator=attrs.validators.instance_of(SyncState))
    last_sync_ms: int = attrs.field(validator=_check_int)

    @classmethod
    def from_args(cls, args: str) -> UserSyncCommand:
        instance_id, user_id, device_id, state, last_sync = _split(
            args, 5, "USER_SYNC", "<instance_id> <user_id> <device_id> <start|end> <last_sync_ms>"
        )
        try:
            sync_state = SyncState(state)
        except ValueError:
            raise RemoteProtocolError(
                f"USER_SYNC state must be 'start' or 'end', got {state!r}"
            ) from None
        return cls(
            _parse_word(instance_id, "USER_SYNC instance_id"),
            _parse_word(user_id, "USER_SYNC user_id"),
            None if device_id == "None" else _parse_word(device_id, "USER_SYNC device_id"),
            sync_state,
            _parse_int(last_sync, "USER_SYNC last_sync_ms"),
        )

    def to_args(self) -> str:
        device = "None" if self.device_id is None else self.device_id
        return (
            f"{self.instance_id} {self.user_id} {device} {self.state.value} {self.last_sync_ms}"
        )


@attrs.frozen
class FederationAckCommand:
    """``FEDERATION_ACK <instance_name> <token>`` -- a federation sender has
    handled the ``federation`` stream up to ``token``.

    Example: ``FEDERATION_ACK federation_sender1 3071``
    """

    NAME: ClassVar[str] = "FEDERATION_ACK"
    SENDERS: ClassVar[Side] = Side.CLIENT
    instance_name: str = attrs.field(validator=_check_word)
    token: int = attrs.field(validator=_check_int)

    @classmethod
    def from_args(cls, args: str) -> FederationAckCommand:
        instance, token = _split(args, 2, "FEDERATION_ACK", "<instance_name> <token>")
        return cls(
            _parse_word(instance, "FEDERATION_ACK instance_name"),
            _parse_int(token, "FEDERATION_ACK token"),
        )

    def to_args(self) -> str:
        return f"{self.instance_name} {self.token}"


AnyCommand: TypeAlias = (
    AuthCommand
    | ServerCommand
    | NameCommand
    | PingCommand
    | ErrorCommand
    | ReplicateCommand
    | PositionCommand
    | RdataCommand
    | UserSyncCommand
    | ClearUserSyncCommand
    | FederationAckCommand
    | RemoteServerUpCommand
)

#: Every command class, by wire name. The one registry of commands.
COMMANDS: Final[dict[str, type[AnyCommand]]] = {
    cls.NAME: cls
    for cls in (
        AuthCommand,
        ServerCommand,
        NameCommand,
        PingCommand,
        ErrorCommand,
        ReplicateCommand,
        PositionCommand,
        RdataCommand,
        UserSyncCommand,
        ClearUserSyncCommand,
        FederationAckCommand,
        RemoteServerUpCommand,
    )
}


#: Commands that remember their encoded line (the stream commands every relay forwards).
_WIRE_CACHED: Final = frozenset({RdataCommand, PositionCommand})


def may_send(command: type[AnyCommand] | AnyCommand, side: Side) -> bool:
    """Whether ``side`` of a point-to-point connection may send this command."""
    return bool(command.SENDERS & side)


#: Commands whose only field is free text, by the field's name: every text
#: without a newline is valid, which :func:`parse_line` has checked already.
_TEXT_FIELD: Final[dict[type[AnyCommand], str]] = {
    cls: attrs.fields(cls)[0].name
    for cls in (AuthCommand, ServerCommand, NameCommand, PingCommand, ErrorCommand,
                ClearUserSyncCommand, RemoteServerUpCommand)
}
#: The slot setter of each of those fields (see :func:`_slot_setters`).
_TEXT_FIELD_SETTER: Final[dict[type[AnyCommand], Any]] = {
    cls: _slot_setters(cls, name)[0] for cls, name in _TEXT_FIELD.items()
}
#: By wire name: the class of each of those commands and its field's slot setter (what parsing needs).
_TEXT_PARSE: Final[dict[str, tuple[type[AnyCommand], Any]]] = {
    cls.NAME: (cls, store) for cls, store in _TEXT_FIELD_SETTER.items()
}
#: By class: the line's start (the name and a space) and a getter of the field (what encoding needs).
_TEXT_ENCODE: Final[dict[type[AnyCommand], tuple[str, Callable[[Any], str]]]] = {
    cls: (f"{cls.NAME} ", operator.attrgetter(name)) for cls, name in _TEXT_FIELD.items()
}


def parse_line(line: str | bytes, *, decode_rows: bool = True) -> AnyCommand:
    """Parse one line (without its newline) into a command.

    Args:
        line: the line, as text or as UTF-8 bytes.
        decode_rows: False leaves an RDATA row's JSON undecoded until its
            ``row`` is read (then checked as strictly, raising
            :class:`~synflow.errors.RemoteProtocolError`), so that a relay
            forwards rows it never reads without decoding them. Everything
            else on the line is checked either way.

    Returns:
        The command value.

    Raises:
        RemoteProtocolError: the line is empty, too long, contains a newline,
            is not UTF-8, names an unknown command, or has malformed arguments.
            Nothing else is raised.
    """
    raw: bytes | None = None
    if type(line) is bytes or isinstance(line, bytes | bytearray | memoryview):
        raw = line if type(line) is bytes else bytes(line)
        if len(raw) > MAX_LINE_LENGTH:
            raise RemoteProtocolError(
                f"line is {len(raw)} bytes, longer than the limit of {MAX_LINE_LENGTH}"
            )
        try:
            text = raw.decode()  # UTF-8, strict
        except UnicodeDecodeError as e:
            raise RemoteProtocolError(f"line is not valid UTF-8: {e.reason} at byte {e.start}") from None
    elif isinstance(line, str):
        text = line
        if len(text) > MAX_LINE_LENGTH // 4 and _utf8_len(text) > MAX_LINE_LENGTH:
            raise RemoteProtocolError(
                f"line is {_utf8_len(text)} bytes, longer than the limit of {MAX_LINE_LENGTH}"
            )
    else:
        raise RemoteProtocolError(f"a line must be str or bytes, got {type(line).__name__}")
    if "\n" in text:
        raise RemoteProtocolError("line contains an embedded newline")
    # One split serves RDATA and POSITION, the bulk of the traffic (each has
    # four arguments; RDATA's last, the row, may hold spaces).
    parts = text.split(" ", 4)
    name = parts[0]
    if len(parts) == 5:
        if name == "RDATA":
            return _rdata_from_fields(parts[1], parts[2], parts[3], parts[4], decode_rows, raw)
        if name == "POSITION" and " " not in parts[4]:
            return _position_from_fields(parts[1], parts[2], parts[3], parts[4], raw)
    args = text[len(name) + 1:]
    text_command = _TEXT_PARSE.get(name)
    if text_command is not None:
        cls, store = text_command
        cmd = _new(cls)
        store(cmd, args)  # any text without a newline: checked above
        return cmd
    if name == "RDATA":  # too few arguments: the message says so
        return _parse_rdata(args, decode_rows, raw)
    if name == "POSITION":
        return _parse_position(args, raw)
    if not name:
        raise RemoteProtocolError("empty line" if not text else "line starts with a space")
    other = COMMANDS.get(name)
    if other is None:
        raise RemoteProtocolError(f"unknown command {name[:64]!r}")
    try:
        cmd = other.from_args(args)
    except RemoteProtocolError:
        raise
    except LocalProtocolError as e:
        # A field validator refused a parsed value: from the peer, that is remote.
        raise RemoteProtocolError(str(e)) from None
    return cmd


def _utf8_len(text: str) -> int:
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        return len(text.encode("utf-8", "surrogatepass"))


def encode_line(cmd: AnyCommand) -> str:
    """Encode a command as its full line, without the trailing newline.

    Raises:
        LocalProtocolError: the line would contain a newline or exceed
            :data:`MAX_LINE_LENGTH` bytes; nothing may be sent.
    """
    line = f"{cmd.NAME} {cmd.to_args()}"
    if "\n" in line:
        raise LocalProtocolError(f"{cmd.NAME} line would contain a newline")
    if len(line) > MAX_LINE_LENGTH // 4 and _utf8_len(line) > MAX_LINE_LENGTH:
        raise LocalProtocolError(
            f"{cmd.NAME} line is {_utf8_len(line)} bytes, longer than the limit of "
            f"{MAX_LINE_LENGTH}; not sent"
        )
    return line


def encode_line_bytes(cmd: AnyCommand) -> bytes:
    """:func:`encode_line` as UTF-8 bytes, ready for a transport.

    Raises:
        LocalProtocolError: as :func:`encode_line`, or if the text cannot be
            encoded as UTF-8 (a lone surrogate in a free-text field).
    """
    kind = type(cmd)
    c: Any = cmd  # the branches below narrow by exact type, which mypy does not follow
    if kind is RdataCommand:
        data = c.wire
        if data is None:
            # Every field was checked when the command was built: neither word
            # holds a space or newline, nor does compact JSON hold a newline.
            row = c._row
            if type(row) is str:
                row = c.row  # decoded, and so checked, first
            token = c.token
            try:
                data = (f"RDATA {c.stream_name} {c.instance_name} {BATCH_TOKEN if token is None else token} "
                        f"{_row_json(row)}").encode()
            except UnicodeEncodeError as e:  # before ValueError, its base: a lone surrogate in a word
                raise LocalProtocolError(f"RDATA line is not encodable as UTF-8: {e.reason}") from None
            except (TypeError, ValueError, RecursionError) as e:
                raise LocalProtocolError(f"row is not encodable as JSON: {e}") from None
            if len(data) > MAX_LINE_LENGTH:
                raise LocalProtocolError(
                    f"RDATA line is {len(data)} bytes, longer than the limit of {MAX_LINE_LENGTH}; not sent"
                )
            _rdata_wire(c, data)  # sent to several connections: encoded once
        return data
    if kind is PositionCommand:
        data = c.wire
        if data is None:
            data = _utf8_line(f"POSITION {c.stream_name} {c.instance_name} {c.prev_token} {c.new_token}", "POSITION")
            if len(data) > MAX_LINE_LENGTH:
                encode_line(c)  # raises, with the size
            _position_wire(c, data)
        return data
    text_command = _TEXT_ENCODE.get(kind)
    if text_command is not None:
        # The field holds no newline (checked when the command was built).
        start, field = text_command
        data = _utf8_line(start + field(c), c.NAME)
        if len(data) > MAX_LINE_LENGTH:
            encode_line(c)  # raises, with the size
        return data
    return _utf8_line(encode_line(cmd), cmd.NAME)


def _utf8_line(line: str, name: str) -> bytes:
    try:
        return line.encode()
    except UnicodeEncodeError as e:
        raise LocalProtocolError(f"{name} line is not encodable as UTF-8: {e.reason}") from None
