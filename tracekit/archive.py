"""The safe `.npz` reader: a raw log's arrays, read so that a file can never run code.

Each array is read from its `.npy` header by hand: an object dtype (a pickle) is refused
before a byte of it is read (what ``allow_pickle=False`` does, checked earlier), a header
that claims more data than its member holds is refused before anything is allocated, and
members the layout does not define are named and skipped, never decoded. Which members a
layout defines is the caller's business (`tracekit.rawlog`, `tracekit.published`).
"""

from __future__ import annotations

import math
import os
import zipfile
from collections.abc import Callable, Collection

import numpy as np

from .errors import LogError

#: deflate expands at most ~1032:1; a member claiming more is lying about its size
_MAX_DEFLATE_RATIO = 1100


def read_npz(
    path: str, select: Callable[[Collection[str]], Collection[str]]
) -> tuple[dict[str, np.ndarray], list[str]]:
    """The arrays of a raw log's archive, and the names of members it ignored.

    `select` gets the archive's array names (member names less ``.npy``) and returns the
    ones the log's layout defines; only those are read, anything else in the archive is
    named and skipped, never decoded."""
    try:
        zf = zipfile.ZipFile(path)
    except Exception as e:  # BadZipFile, OSError, EOFError, ValueError, struct errors...
        raise LogError(path, "file", f"not a readable .npz archive ({short(e)})") from None
    with zf:
        try:
            infos = zf.infolist()
        except Exception as e:
            raise LogError(path, "file", f"not a readable .npz archive ({short(e)})") from None
        members: dict[str, zipfile.ZipInfo] = {}
        ignored: list[str] = []
        for info in infos:
            name = info.filename
            if not name.endswith(".npy"):
                ignored.append(name)
                continue
            key = name[: -len(".npy")]
            if key in members:
                raise LogError(path, key, "appears twice in the archive (which one is the log?)")
            members[key] = info
        wanted = set(select(members))
        ignored += [members[k].filename for k in members if k not in wanted]
        size = os.path.getsize(path)
        arrays = {k: _read_member(path, zf, members[k], k, size) for k in members if k in wanted}
    return arrays, ignored


def _read_member(path: str, zf: zipfile.ZipFile, info: zipfile.ZipInfo, key: str, size: int):
    fmt = np.lib.format
    if info.compress_size > size or (
        info.file_size > max(info.compress_size, 1) * _MAX_DEFLATE_RATIO
        or (info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size)
    ):
        raise LogError(path, key, "corrupt archive entry (its sizes do not fit the file)")
    try:
        with zf.open(info) as fh:
            version = fmt.read_magic(fh)
            if version == (1, 0):
                shape, fortran, dtype = fmt.read_array_header_1_0(fh)
            elif version == (2, 0):
                shape, fortran, dtype = fmt.read_array_header_2_0(fh)
            else:
                raise LogError(path, key, f"unsupported .npy format version {version}")
            if dtype.hasobject:
                # a pickle: never unpickled, whatever it holds (allow_pickle=False in spirit)
                raise LogError(
                    path, key, "holds Python objects (a pickle): refused, a log never loads code"
                )
            count = math.prod(shape)
            nbytes = count * dtype.itemsize
            if count < 0 or fh.tell() + nbytes != info.file_size:
                raise LogError(
                    path,
                    key,
                    f"header says {dtype} {shape} ({nbytes} bytes) but the member holds "
                    f"{info.file_size - fh.tell()} bytes of data",
                )
            data = fh.read(nbytes)
            if len(data) != nbytes or fh.read(1):  # reading to the end checks the CRC
                raise LogError(path, key, "corrupt array (truncated member)")
        a = np.frombuffer(data, dtype=dtype, count=count)
        return a.reshape(shape, order="F" if fortran else "C").copy()
    except LogError:
        raise
    except Exception as e:  # zlib, CRC, header syntax, unsupported compression...
        raise LogError(path, key, f"corrupt array ({short(e)})") from None


def short(e: BaseException) -> str:
    s = str(e).splitlines()[0] if str(e) else type(e).__name__
    return s[:160]
