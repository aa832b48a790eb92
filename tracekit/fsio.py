"""Writing files so that a reader sees the old file or the whole new one, never a torn one.

Every file tracekit writes whole (a log, a part, a report, a trace) goes through
`atomic_write` / `atomic_open`: the bytes go to a fresh temporary file in the target's own
folder, created exclusively (`tempfile.mkstemp`: ``O_CREAT | O_EXCL``, a random name), so a
symlink planted at a predictable temporary name is never followed; the file is flushed to
disk, renamed over the target (`os.replace`, atomic on one filesystem), and the rename is
flushed to disk with the folder. On any failure (a full disk, an exception while writing)
the temporary file is removed, so a failing writer leaves no ``.tmp`` files behind and the
target untouched.

What protects against what:

- a killed process (SIGKILL, a crash of the process): nothing. Bytes given to ``write()``
  are the kernel's, and stay in its page cache for every reader whatever happens to the
  writer; the rename makes a written file visible whole. A kill loses only what was not
  yet renamed into place: ``fsync`` adds nothing here.
- an OS crash or a power loss: ``fsync`` of the file before the rename (the file is whole
  under its name, or absent) and of the folder after it (the name itself is on disk).

`atomic_open(path, fsync=False)` renames without either fsync: a file that must be visible
soon (a part of a recording, which a kill must not lose) is renamed at once, and made
durable afterwards by a `Syncer` (each file, then its folder), off the writer's path. Until
then a power loss may leave it absent, empty or torn under its name; its reader must say
so (`tracekit.log.parts.merge_parts` ends a recovered run at such a part).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
from collections import deque
from collections.abc import Iterator
from typing import IO

logger = logging.getLogger("tracekit")


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], *, fsync: bool = True) -> Iterator[IO[bytes]]:
    """``with atomic_open(path) as fh: fh.write(...)``: `path` appears whole at the end of
    the block, or (if the block raises) is left as it was. `fsync`: the file is on disk
    before the rename, and the rename after it (see the module doc)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        fsync_folder(folder)


def atomic_write(path: str | os.PathLike[str], data: bytes, *, fsync: bool = True) -> None:
    """Write `data` to `path` atomically (see `atomic_open`)."""
    with atomic_open(path, fsync=fsync) as fh:
        fh.write(data)


def fsync_folder(folder: str) -> None:
    """Flush `folder`'s entries (the names created and renamed in it) to disk. Where a
    folder cannot be opened or synced (some platforms and filesystems), nothing happens."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # EINVAL: a filesystem that cannot sync a folder
            os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    """Flush the file at `path` to disk (a file removed meanwhile is skipped)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Syncer:
    """Makes files already renamed into place durable, on a thread of its own, in the
    order they were added: each file's fsync, then one fsync of each of their folders.

    Whoever writes the files never waits for a disk's flush (hundreds of ms under I/O
    load); `num_synced` says how many added files are on disk with their names. A failing
    fsync is logged once (a warning on the ``tracekit`` logger); the files stay as they
    are, visible, and durable whenever the OS writes them back."""

    def __init__(self, name: str = "tracekit-fsync") -> None:
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[str] = deque()
        self._closing = False
        self._warned = False
        self.num_synced = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, path: str) -> None:
        """Make `path` durable after the files added before it."""
        with self._cond:
            self._queue.append(path)
            self._cond.notify_all()

    def close(self) -> None:
        """Sync every file added, then end the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                batch = list(self._queue)
                self._queue.clear()
            for path in batch:
                try:
                    fsync_file(path)
                except OSError as e:  # the file stays visible; the OS writes it back later
                    if not self._warned:
                        logger.warning("tracekit: cannot fsync %s (%s)", path, e)
                    self._warned = True
            for folder in dict.fromkeys(os.path.dirname(os.path.abspath(p)) for p in batch):
                fsync_folder(folder)
            with self._cond:
                self.num_synced += len(batch)
                self._cond.notify_all()


__all__ = ["Syncer", "atomic_open", "atomic_write", "fsync_file", "fsync_folder"]
