"""The audit log's part files: appends that leave no torn line, rotation, and retention.

One :class:`PartFiles` is one series of ``part-<pid>-<n>.jsonl`` files in one
directory (``writer_logs/<instance>`` or ``token_logs/<instance>``). A write
either lands whole or not at all: when it fails (a full disk, say) the file
is cut back to its length before the write, so no half line is left for a
reader to trip on, and the error is raised for the caller to account for.

Retention runs when a file is rotated and when the series is opened: the
oldest *rotated* files go (never the active one) while the series holds more
than ``retain_bytes``, or while they were last written more than
``retain_days`` ago. Files a previous run of the process wrote count too.

Internal to synflow: not part of the public API (``synflow.api``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from twisted.internet.interfaces import IReactorTime

logger = logging.getLogger(__name__)

SECONDS_PER_DAY = 86_400

#: The low-level write every append goes through (a seam where tests inject a full disk).
os_write = os.write


class PartFiles:
    """An append-only, size-rotated series of JSONL part files in one directory.

    Args:
        directory: where the part files live (created on the first write).
        max_bytes: rotate once the active file has passed this size.
        clock: for the age of files (``retain_days``).
        retain_bytes: keep at most about this many bytes of rotated files (None: no limit).
        retain_days: delete rotated files last written longer ago than this (None: no limit).
    """

    def __init__(self, directory: str, max_bytes: int, clock: IReactorTime, *,
                 retain_bytes: int | None = None, retain_days: float | None = None) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.clock = clock
        self.retain_bytes = retain_bytes
        self.retain_days = retain_days
        self._fd: int | None = None
        self._path: str | None = None
        self._size = 0
        self._part = 0
        self.files_deleted = 0
        self.bytes_deleted = 0

    def write(self, lines: Sequence[str]) -> None:
        """Append ``lines`` (each one JSON document without its newline) as one write.

        Raises:
            OSError: the write failed; the file holds exactly what it held before.
        """
        if not lines:
            return
        data = ("\n".join(lines) + "\n").encode("utf-8")
        if self._fd is None or self._size >= self.max_bytes:
            self._rotate()
        assert self._fd is not None
        view = memoryview(data)
        try:
            while view:
                written = os_write(self._fd, view)
                view = view[written:]
        except OSError:
            self._cut_back()
            raise
        self._size += len(data)

    def _cut_back(self) -> None:
        """Drop a partly written record: truncating frees space, so it works on a full disk."""
        assert self._fd is not None
        try:
            os.ftruncate(self._fd, self._size)
        except OSError as e:  # pragma: no cover - the file system refused even that
            logger.warning("could not cut %s back to %d bytes after a failed write: %s", self._path, self._size, e)
            self.close()

    def _rotate(self) -> None:
        self.close()
        os.makedirs(self.directory, exist_ok=True)
        while True:
            self._part += 1
            path = os.path.join(self.directory, f"part-{os.getpid()}-{self._part:05d}.jsonl")
            if not os.path.exists(path):
                break
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._path = path
        self._size = 0
        self.apply_retention()

    def apply_retention(self) -> None:
        """Delete the oldest rotated files beyond ``retain_bytes`` / ``retain_days``."""
        if self.retain_bytes is None and self.retain_days is None:
            return
        try:
            names = [n for n in os.listdir(self.directory) if n.startswith("part-") and n.endswith(".jsonl")]
        except OSError:
            return
        rotated = []
        for name in names:
            path = os.path.join(self.directory, name)
            if path == self._path:
                continue
            try:
                st = os.stat(path)
            except OSError:
                continue
            rotated.append((st.st_mtime, path, st.st_size))
        rotated.sort()  # oldest first
        total = sum(size for _, _, size in rotated)
        cutoff = (self.clock.seconds() - self.retain_days * SECONDS_PER_DAY
                  if self.retain_days is not None else None)
        for mtime, path, size in rotated:
            too_big = self.retain_bytes is not None and total > self.retain_bytes
            too_old = cutoff is not None and mtime < cutoff
            if not (too_big or too_old):
                break
            try:
                os.unlink(path)
            except OSError as e:
                logger.warning("audit retention could not delete %s: %s", path, e)
                continue
            total -= size
            self.files_deleted += 1
            self.bytes_deleted += size
            logger.info("audit retention deleted %s (%d bytes, %s)", path, size, "size" if too_big else "age")

    def close(self) -> None:
        """Close the active file (the next write opens a new one)."""
        if self._fd is not None:
            try:
                os.close(self._fd)
            finally:
                self._fd = None
