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
                              streams: Mapping[str, str] | None = None) -> str:
    """Make ``dist`` look installed, with its ``modules`` (name -> source) and entry points; returns its directory."""
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
    importlib.invalidate_caches()

    def remove() -> None:
        sys.path.remove(root)
        for name in modules:
            sys.modules.pop(name, None)
        importlib.invalidate_caches()
        registry.discover(refresh=True)

    testcase.addCleanup(remove)
    return root
