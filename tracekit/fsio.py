"""Writing files so that a reader sees the old file or the whole new one, never a torn one.

Every file tracekit writes whole (a log, a part, a report, a trace) goes through
`atomic_write` / `atomic_open`: the bytes go to a fresh temporary file in the target's own
folder, created exclusively (`tempfile.mkstemp`: ``O_CREAT | O_EXCL``, a random name), so a
symlink planted at a predictable temporary name is never followed; the file is flushed to
disk, then renamed over the target (`os.replace`, atomic on one filesystem). On any failure
(a full disk, an exception while writing) the temporary file is removed, so a failing writer
leaves no ``.tmp`` files behind and the target untouched.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import IO


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], *, fsync: bool = True) -> Iterator[IO[bytes]]:
    """``with atomic_open(path) as fh: fh.write(...)``: `path` appears whole at the end of
    the block, or (if the block raises) is left as it was."""
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


def atomic_write(path: str | os.PathLike[str], data: bytes, *, fsync: bool = True) -> None:
    """Write `data` to `path` atomically (see `atomic_open`)."""
    with atomic_open(path, fsync=fsync) as fh:
        fh.write(data)


__all__ = ["atomic_open", "atomic_write"]
