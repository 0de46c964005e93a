"""Compact JSON encoders built once, for the paths that encode on every event, row or request, and the strict
decoding helpers the request and replication parsers share.

``json.dumps(value, separators=(",", ":"))`` builds a ``JSONEncoder`` and,
inside it, a fresh C encoder on every call, which costs about as much as
encoding a small object. The functions here build both once; the text is
the same as ``json.dumps`` gives with the same settings (a reference cycle
ends in ``RecursionError`` rather than the ``ValueError`` of its cycle
check: values encoded here come from parsed JSON or are built by synflow).

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import json
import json.encoder
import json.scanner
from collections.abc import Callable
from typing import Any

__all__: list[str] = []

_c_make_encoder: Any = getattr(json.encoder, "c_make_encoder", None)


def c_chunk_encoder(*, ensure_ascii: bool = True, allow_nan: bool = True,
                    default: Callable[[Any], Any] | None = None) -> Any:
    """The C encoder (``encoder(value, 0)`` returns the text's chunks), or None without the accelerator.

    ``default`` is called for a value JSON cannot hold, as ``json.dumps``'s
    own (the base encoder's raises ``TypeError``).
    """
    if _c_make_encoder is None:
        return None
    base = json.JSONEncoder(separators=(",", ":"), ensure_ascii=ensure_ascii, allow_nan=allow_nan)
    strings = json.encoder.encode_basestring_ascii if ensure_ascii else json.encoder.encode_basestring
    return _c_make_encoder(None, default or base.default, strings, None, ":", ",", False, False, allow_nan)


def compact_encoder(*, ensure_ascii: bool = True, allow_nan: bool = True) -> Callable[[Any], str]:
    """``json.dumps(value, separators=(",", ":"), ensure_ascii=..., allow_nan=...)``, built once.

    The returned function raises ``ValueError`` (NaN or Infinity when not
    allowed) and ``TypeError`` (a value JSON cannot hold) as ``json.dumps``.
    """
    chunks = c_chunk_encoder(ensure_ascii=ensure_ascii, allow_nan=allow_nan)
    if chunks is None:
        return json.JSONEncoder(separators=(",", ":"), ensure_ascii=ensure_ascii, allow_nan=allow_nan).encode

    def encode(value: Any) -> str:
        return "".join(chunks(value, 0))

    return encode


#: ``json.dumps(value, separators=(",", ":"))``.
compact_json: Callable[[Any], str] = compact_encoder()
#: ``compact_json(text)`` for a ``str`` (the text as a quoted JSON string, ASCII only), through the
#: encoder's own string quoting alone: for JSON assembled from pieces (sync responses).
json_string: Callable[[str], str] = json.encoder.encode_basestring_ascii
#: The same with non-ASCII characters as themselves (``ensure_ascii=False``).
compact_json_unicode: Callable[[Any], str] = compact_encoder(ensure_ascii=False)


_decoder = json.JSONDecoder()
_c_make_scanner: Any = getattr(json.scanner, "c_make_scanner", None)
_scan: Any = _c_make_scanner(_decoder) if _c_make_scanner is not None else None


def loads(data: str | bytes) -> Any:
    """``json.loads(data)`` for UTF-8 bytes or text: the same value, or the same ``ValueError``.

    ``json.loads`` runs its decoder's two whitespace matches around the C
    scanner and, for bytes, detects the encoding first; a value with no
    whitespace around it (what a server answers) goes to the scanner alone.
    Anything else -- whitespace, another encoding, an error, a ``bytearray``
    -- goes through ``json.loads`` for the exact outcome and message.
    """
    if _scan is not None and (type(data) is bytes or type(data) is str):
        try:
            text = data.decode("utf-8") if type(data) is bytes else data
            value, end = _scan(text, 0)
        except (StopIteration, ValueError, RecursionError):
            pass  # settled below (UnicodeDecodeError is a ValueError)
        else:
            if end == len(text):
                return value
    return json.loads(data)


def reject_constant(name: str) -> Any:
    """``parse_constant`` for strict JSON: ``NaN``, ``Infinity`` and ``-Infinity`` are not JSON (a ``ValueError``)."""
    raise ValueError(f"{name} is not valid JSON")


def nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` nests arrays and objects more than ``limit`` deep (a scalar is no level; iteratively)."""
    if not isinstance(value, (dict, list)):
        return False
    if limit < 1:
        return True
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node  # only arrays and objects are stacked
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False
