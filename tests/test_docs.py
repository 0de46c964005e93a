"""The operator-facing docs agree with the code: every config key and default, and the README's commands."""

from __future__ import annotations

import enum
import os
import re
import typing
from typing import Any

import attrs
import yaml
from twisted.trial.unittest import SynchronousTestCase

from synflow.config import NOT_KEYS, SynflowConfig
from synflow.storage.engines import DatabaseConfig

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
CONFIGURATION_MD = os.path.join(ROOT, "docs", "configuration.md")
README = os.path.join(ROOT, "README.md")

#: A key with no default (it must be set).
REQUIRED = object()
#: A documented default that is a description, not a value (e.g. ``<data_dir>/audit``).
DESCRIPTIVE = object()


def _attrs_class(tp: Any) -> type | None:
    """The attrs class in ``tp`` itself, ``X | None`` or ``list[X]``, if any."""
    if attrs.has(tp):
        return typing.cast(type, tp)
    for arg in typing.get_args(tp):
        if attrs.has(arg):
            return typing.cast(type, arg)
    return None


def code_keys(cls: type = SynflowConfig, prefix: str = "") -> list[str]:
    """Every dotted key path the config accepts: each leaf, and each optional section."""
    keys = []
    hints = typing.get_type_hints(cls)
    for field in attrs.fields(cls):
        if field.name in NOT_KEYS:
            continue
        path = prefix + field.name
        tp = hints[field.name]
        inner = _attrs_class(tp)
        if inner is None:
            keys.append(path)
            continue
        if typing.get_origin(tp) is dict:
            keys.append(path)
            path += ".<name>"  # a map of sections, e.g. instance_map.<name>.port
        elif field.default is None:
            keys.append(path)  # an optional section: "none" means something
        keys.extend(code_keys(inner, path + "."))
    return keys


def code_default(path: str) -> Any:
    """The default of a dotted key path, as the code has it (REQUIRED if there is none).

    ``database`` keys left to the storage layer (None in the config section)
    take :class:`DatabaseConfig`'s defaults, which is what a process uses.
    """
    cls: type | None = SynflowConfig
    instance: Any = None
    value: Any = None
    for part in path.split("."):
        assert cls is not None, path
        if part == "<name>":
            continue  # an entry of a map (e.g. instance_map): its section class's defaults
        field = attrs.fields_dict(cls)[part]
        if instance is not None:
            value = getattr(instance, part)
        elif field.default is attrs.NOTHING:
            value = REQUIRED
        elif isinstance(field.default, attrs.Factory):  # type: ignore[arg-type]
            value = field.default.factory()
        else:
            value = field.default
        cls = _attrs_class(typing.get_type_hints(cls)[part])
        instance = value if cls is not None and attrs.has(type(value)) else None
    if path.startswith("database.") and value is None and hasattr(DatabaseConfig(), path.split(".", 1)[1]):
        value = getattr(DatabaseConfig(), path.split(".", 1)[1])
    if isinstance(value, enum.Enum):
        value = value.value
    return value


def parse_default(text: str) -> Any:
    """One documented default: ``required``, ``none``, a boolean, a number, or a backticked YAML value."""
    text = text.strip()
    if text == "required":
        return REQUIRED
    if text == "none" or text.startswith("none ("):
        return None
    if text in ("true", "false"):
        return text == "true"
    if re.fullmatch(r"-?\d+(\.\d+)?", text):
        return float(text)
    match = re.fullmatch(r"`([^`<]+)`", text)
    if match:
        return yaml.safe_load(match.group(1))
    return DESCRIPTIVE


def documented_rows(text: str) -> dict[str, Any]:
    """Every key of the reference tables, expanded to full dotted paths, with its documented default.

    A key cell may list several keys: ``a.b.c`` / ``.d`` means ``a.b.c`` and
    ``a.b.d``; its default cell then lists one default per key (``x / y``)
    or one for all.
    """
    rows: dict[str, Any] = {}
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        keys: list[str] = []
        for token in re.findall(r"`([^`]+)`", cells[0]):
            if token.startswith("."):
                keys.append(keys[-1].rpartition(".")[0] + token)
            else:
                keys.append(token)
        parts = [p.strip() for p in cells[2].split(" / ")]
        if len(parts) == len(keys):
            defaults = [parse_default(p) for p in parts]
        elif len(parts) == 1:
            defaults = [parse_default(parts[0])] * len(keys)
        else:
            defaults = [DESCRIPTIVE] * len(keys)
        for key, default in zip(keys, defaults, strict=True):
            rows[key] = default
    return rows


class ConfigurationDocTest(SynchronousTestCase):
    def setUp(self) -> None:
        with open(CONFIGURATION_MD, encoding="utf-8") as f:
            self.rows = documented_rows(f.read())

    def test_every_key_documented(self) -> None:
        """Every dotted key path the config accepts has its own row in docs/configuration.md, and every row is a real key."""
        keys = code_keys()
        self.assertGreater(len(keys), 80)
        self.assertEqual([k for k in keys if k not in self.rows], [])
        self.assertEqual([k for k in self.rows if k not in keys], [])

    def test_documented_defaults_match_the_code(self) -> None:
        """Each default given as a value in docs/configuration.md is the code's default for that key."""
        wrong = []
        compared = 0
        for key, documented in self.rows.items():
            if documented is DESCRIPTIVE:
                continue
            actual = code_default(key)
            compared += 1
            if documented is REQUIRED or actual is REQUIRED:
                ok = documented is actual
            elif isinstance(documented, float) and isinstance(actual, int | float) and not isinstance(actual, bool):
                ok = documented == actual
            else:
                ok = documented == actual and type(documented) is type(actual)
            if not ok:
                wrong.append(f"{key}: documented {documented!r}, code {actual!r}")
        self.assertEqual(wrong, [])
        self.assertGreater(compared, 70)

    def test_parser_catches_an_undocumented_key(self) -> None:
        """A key documented only under another section (``x.port`` beside ``y.port``) does not count as documented."""
        rows = documented_rows("| `replication.hub.host` / `.port` | string / int | `127.0.0.1` / `9092` | |\n")
        self.assertEqual(rows, {"replication.hub.host": "127.0.0.1", "replication.hub.port": 9092})
        self.assertNotIn("replication.redis.port", rows)


class ReadmeTest(SynchronousTestCase):
    def test_first_code_block_is_the_two_setup_commands(self) -> None:
        """The README's first fenced code block is exactly ``scripts/demo`` then ``scripts/test``."""
        with open(README, encoding="utf-8") as f:
            text = f.read()
        match = re.search(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)
        assert match is not None, "README has no fenced code block"
        self.assertEqual(match.group(1).splitlines(), ["scripts/demo", "scripts/test"])
        for command in ("demo", "test"):
            self.assertTrue(os.access(os.path.join(ROOT, "scripts", command), os.X_OK), command)
