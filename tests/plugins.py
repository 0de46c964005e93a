"""Throwaway plugin distributions for tests: a module and its ``.dist-info`` in a temporary directory on ``sys.path``.

:func:`install_fake_distribution` writes what an installed distribution
looks like to :mod:`importlib.metadata` (``METADATA`` and
``entry_points.txt``) beside the plugin's own modules, puts the directory
first on ``sys.path`` and rereads the registry; the test's cleanup removes
it all and rereads the registry again.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import textwrap
from collections.abc import Mapping
from typing import Any

from synflow import registry

#: A minimal plugin: a ``notes`` stream and the ``note_writer`` worker type that writes it.
NOTES_PLUGIN = '''
import attrs
from synflow import api


@attrs.frozen
class NoteRow:
    room_id: str
    text: str

    def to_wire(self) -> list[str]:
        return [self.room_id, self.text]

    @classmethod
    def from_wire(cls, row: list[object]) -> "NoteRow":
        return cls(*api.strings(row, 2))


NOTES = api.Stream(
    name="notes", row_type=NoteRow, table="notes", id_column="stream_id",
    instance_column="instance_name", select=("room_id", "text"), sequence="notes_stream_seq",
    writers=api.Writers.DECLARED,
)


@attrs.frozen
class NotesConfig:
    max_len: int = attrs.field(default=100, validator=api.positive)


class NoteWriter(api.WorkerType):
    name = "note_writer"
    summary = "writes notes"
    config = api.Section("notes", NotesConfig)
    writes = (NOTES,)
'''


def install_fake_distribution(testcase: Any, dist: str, modules: Mapping[str, str],
                              apps: Mapping[str, str] | None = None,
                              streams: Mapping[str, str] | None = None, *,
                              source_dir: str | None = None) -> str:
    """Make ``dist`` look installed, with its ``modules`` (name -> source) and entry points; returns its directory.

    ``source_dir``, if given, is put on ``sys.path`` too (a package's checkout, imported in place).
    """
    root = os.path.abspath(testcase.mktemp())
    os.makedirs(root)
    for name, source in modules.items():
        with open(os.path.join(root, f"{name}.py"), "w", encoding="utf-8") as f:
            f.write(textwrap.dedent(source))
    info = os.path.join(root, f"{dist.replace('-', '_')}-1.0.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w", encoding="utf-8") as f:
        f.write(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = []
    for group, entries in (("synflow.apps", apps or {}), ("synflow.streams", streams or {})):
        if entries:
            lines.append(f"[{group}]")
            lines.extend(f"{name} = {value}" for name, value in entries.items())
            lines.append("")
    with open(os.path.join(info, "entry_points.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    sys.path.insert(0, root)
    if source_dir is not None:
        sys.path.insert(1, source_dir)
    importlib.invalidate_caches()

    def remove() -> None:
        sys.path.remove(root)
        if source_dir is not None:
            sys.path.remove(source_dir)
            for name in [m for m in sys.modules if m.split(".")[0] in _top_level_packages(source_dir)]:
                sys.modules.pop(name, None)
        for name in modules:
            sys.modules.pop(name, None)
        importlib.invalidate_caches()
        registry.discover(refresh=True)

    testcase.addCleanup(remove)
    return root


FRAMEWORK_DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "framework.md")
_FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.S | re.M)
_FILE_MARK = re.compile(r"^(?:#|--) file: (\S+)\n")


def tutorial_files(doc: str = FRAMEWORK_DOC) -> dict[str, str]:
    """The files docs/framework.md's tutorial builds: each code block starting ``# file: <path>`` (or ``-- file:``).

    Blocks naming one path are joined in order (a module written in steps).
    """
    with open(doc, encoding="utf-8") as f:
        text = f.read()
    files: dict[str, str] = {}
    for block in _FENCE.findall(text):
        mark = _FILE_MARK.match(block)
        if mark is not None:
            files[mark.group(1)] = files.get(mark.group(1), "") + ("\n\n" if mark.group(1) in files else "") + block
    return files


def write_tutorial_package(directory: str) -> dict[str, str]:
    """Write the tutorial's files under ``directory``; returns them."""
    files = tutorial_files()
    for path, content in files.items():
        full = os.path.join(directory, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w", encoding="utf-8") as f:
            f.write(content)
    return files


EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "receipts")


def _top_level_packages(directory: str) -> set[str]:
    return {name for name in os.listdir(directory) if os.path.isfile(os.path.join(directory, name, "__init__.py"))}


def install_example(testcase: Any, directory: str = EXAMPLE, *, on_path: bool = True) -> None:
    """Register an example package from its checkout: its pyproject's entry points, its code imported in place.

    ``on_path=False``: the caller has put ``directory`` on ``sys.path`` for good (its modules stay imported).
    """
    import tomllib

    with open(os.path.join(directory, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    points = project.get("entry-points", {})
    install_fake_distribution(testcase, project["name"], {}, apps=points.get("synflow.apps"),
                              streams=points.get("synflow.streams"), source_dir=directory if on_path else None)
    registry.discover(refresh=True)
