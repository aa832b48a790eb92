"""The safe `.npz` reader: a raw log's arrays, read so that a file can never run code.

Each array is read from its `.npy` header by hand: an object dtype (a pickle) is refused
before a byte of it is read (what ``allow_pickle=False`` does, checked earlier), a header
that claims more data than its member holds is refused before anything is allocated, and
members the layout does not define are named and skipped, never decoded. Which members a
layout defines is the caller's business (`tracekit.log.rawlog`, `tracekit.log.published`).

Reading is bounded by what the file is. Only a regular file is opened (a FIFO, a device
such as /dev/zero or /dev/urandom, or a symlink to one would hang or never end), and the
sizes the archive declares are checked before anything is inflated: their sum may not
exceed `inflate_limit_bytes` (by default proportional to the file's size, with a floor
and an absolute cap; ``--max-inflate-mb`` or ``TRACEKIT_MAX_INFLATE_MB`` raises it).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import zipfile
from collections.abc import Callable, Collection
from typing import Any

import numpy as np

from tracekit.errors import LogError, UsageError

#: deflate expands at most ~1032:1; a member claiming more is lying about its size
_MAX_DEFLATE_RATIO = 1100

#: Members are read in pieces of this size (a piece is copied once into the array).
_CHUNK_BYTES = 1 << 20

#: The default inflate limit: what the members read may hold once inflated, in all.
#: A log written by tracekit is stored uncompressed (ratio 1); a compressed one of timing
#: data inflates a few times. 64x the file, at least 256 MiB, at most 8 GiB (but never
#: less than the file itself) leaves real logs far inside and refuses deflate bombs
#: and zero-filled columns that claim gigabytes from a few megabytes.
INFLATE_RATIO = 64
INFLATE_FLOOR_BYTES = 256 * 2**20
INFLATE_CAP_BYTES = 8 * 2**30
#: environment variable that raises (or lowers) the limit, in MB (10**6 bytes)
INFLATE_ENV = "TRACEKIT_MAX_INFLATE_MB"


def inflate_limit_bytes(file_size: int, max_inflate_mb: float | None = None) -> int:
    """The most bytes the read members of a `file_size`-byte archive may inflate to:
    `max_inflate_mb` when given, else $TRACEKIT_MAX_INFLATE_MB, else the default above."""
    what = "max_inflate_mb"
    if max_inflate_mb is None:
        env = os.environ.get(INFLATE_ENV, "").strip()
        if env:
            what = f"${INFLATE_ENV}"
            try:
                max_inflate_mb = float(env)
            except ValueError:
                raise UsageError(f"{what}={env!r}: expected a number of MB") from None
    if max_inflate_mb is not None:
        if not (math.isfinite(max_inflate_mb) and max_inflate_mb > 0):
            raise UsageError(f"{what}={max_inflate_mb!r}: expected a finite number of MB > 0")
        return int(max_inflate_mb * 1e6)
    by_size = min(max(INFLATE_RATIO * file_size, INFLATE_FLOOR_BYTES), INFLATE_CAP_BYTES)
    return max(file_size, by_size)


class InflateLimitError(LogError):
    """An archive whose arrays would inflate beyond the reading limit (`_check_inflate`)."""


def describe_non_regular(mode: int) -> str:
    """What a file that is not a regular one is, for an error message ("a FIFO ...")."""
    return (
        "a FIFO (named pipe)" if stat.S_ISFIFO(mode)
        else "a character device" if stat.S_ISCHR(mode)
        else "a block device" if stat.S_ISBLK(mode)
        else "a socket" if stat.S_ISSOCK(mode)
        else "a directory" if stat.S_ISDIR(mode)
        else "not a regular file"
    )  # fmt: skip


def open_regular(path: str):
    """`path` opened for reading in binary, if it is a regular file (following symlinks);
    a FIFO, a device or a socket is refused without reading a byte. The file is opened
    non-blocking (a FIFO's open would otherwise wait for a writer) and checked on the
    open descriptor, so that what is checked is what is read."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise LogError(path, "file", f"cannot be opened ({e.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise LogError(
            path,
            "file",
            f"is {describe_non_regular(mode)}, not a regular file: a raw log is read from a "
            ".npz file",
        )
    if hasattr(os, "set_blocking"):
        os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_npz(
    path: str,
    select: Callable[[Collection[str]], Collection[str]],
    *,
    max_inflate_mb: float | None = None,
) -> tuple[dict[str, np.ndarray], list[str]]:
    """The arrays of a raw log's archive, and the names of members it ignored.

    `select` gets the archive's array names (member names less ``.npy``) and returns the
    ones the log's layout defines; only those are read, anything else in the archive is
    named and skipped, never decoded. `max_inflate_mb`: see `inflate_limit_bytes`."""
    fh = open_regular(path)
    size = os.fstat(fh.fileno()).st_size
    try:
        zf = zipfile.ZipFile(fh)
    except Exception as e:  # BadZipFile, OSError, EOFError, ValueError, struct errors...
        fh.close()
        raise LogError(path, "file", f"not a readable .npz archive ({short(e)})") from None
    with fh, zf:
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
        _check_inflate(path, [members[k] for k in members if k in wanted], size, max_inflate_mb)
        arrays = {k: _read_member(path, zf, members[k], k, size) for k in members if k in wanted}
    return arrays, ignored


def _check_inflate(
    path: str, infos: list[zipfile.ZipInfo], size: int, max_inflate_mb: float | None
) -> None:
    """Refuse, before inflating anything, members whose declared sizes exceed the limit.
    (Each member's declared size is also what `_read_member` holds it to.)"""
    limit = inflate_limit_bytes(size, max_inflate_mb)
    total = sum(i.file_size for i in infos)
    if total > limit:
        biggest = max(infos, key=lambda i: i.file_size)
        raise InflateLimitError(
            path,
            "file",
            f"its arrays would inflate to {total / 1e6:.1f} MB from a {size / 1e6:.1f} MB file "
            f"(largest: {biggest.filename}, {biggest.file_size / 1e6:.1f} MB), over the "
            f"{limit / 1e6:.0f} MB limit; if the log is genuine, raise it "
            f"(--max-inflate-mb {math.ceil(total / 1e6)} or ${INFLATE_ENV})",
        )


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
            # read in chunks into the array's own buffer: memory is the array, once
            data = bytearray(nbytes)
            view = memoryview(data)
            got = 0
            while got < nbytes:
                n = fh.readinto(view[got : got + _CHUNK_BYTES])  # type: ignore[attr-defined]
                if not n:
                    break
                got += n
            if got != nbytes or fh.read(1):  # reading to the end checks the CRC
                raise LogError(path, key, "corrupt array (truncated member)")
        a = np.frombuffer(data, dtype=dtype, count=count)  # writable: it owns a bytearray
        return a.reshape(shape, order="F" if fortran else "C")
    except LogError:
        raise
    except Exception as e:  # zlib, CRC, header syntax, unsupported compression...
        raise LogError(path, key, f"corrupt array ({short(e)})") from None


def short(e: BaseException) -> str:
    s = str(e).splitlines()[0] if str(e) else type(e).__name__
    return s[:160]


# -- typed members: what a decoder of a layout asks of the arrays it read ----------------


def scalar_str(path: str, arrays: dict[str, np.ndarray], key: str) -> str:
    a = arrays.get(key)
    if a is None:
        raise LogError(path, key, "missing")
    if a.shape != () or a.dtype.kind != "U":
        raise LogError(path, key, f"expected a string scalar, got {a.dtype} {a.shape}")
    return str(a[()])


def json_member(path: str, arrays: dict[str, np.ndarray], key: str, default: Any = None) -> Any:
    if key not in arrays and default is not None:
        return default
    s = scalar_str(path, arrays, key)
    try:
        return clean_strings(json.loads(s))
    except json.JSONDecodeError as e:
        raise LogError(path, key, f"not valid JSON ({e.msg} at char {e.pos})") from None
    except (ValueError, RecursionError) as e:  # 5000-digit integers, 100,000 nested lists
        raise LogError(path, key, f"not usable JSON ({short(e)})") from None


_SURROGATE = re.compile("[\ud800-\udfff]")


def clean_strings(obj: Any) -> Any:
    """Strings from a log as valid Unicode: lone surrogates (which no terminal or file can
    encode) become U+FFFD. Everything else is kept as it is."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
            return obj
        except UnicodeEncodeError:
            return _SURROGATE.sub("\ufffd", obj)
    if isinstance(obj, dict):
        return {clean_strings(k): clean_strings(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clean_strings(v) for v in obj]
    return obj


def str_list(path: str, arrays: dict[str, np.ndarray], key: str) -> tuple[str, ...]:
    a = arrays.get(key)
    if a is None:
        return ()
    if a.ndim != 1 or (a.size and a.dtype.kind != "U"):
        raise LogError(path, key, f"expected a 1-D array of strings, got {a.dtype} {a.shape}")
    return tuple(clean_strings(str(x)) for x in a)


def column(path: str, arrays: dict[str, np.ndarray], key: str, dtype: Any) -> np.ndarray:
    a = arrays.get(key)
    if a is None:
        raise LogError(path, key, "missing")
    if a.ndim != 1:
        raise LogError(path, key, f"expected a 1-D column, got shape {a.shape}")
    if a.dtype.kind not in "biuf":
        raise LogError(path, key, f"expected numbers, got dtype {a.dtype}")
    if np.dtype(dtype).kind in "iu":
        check_ints(path, key, a, np.dtype(dtype))
    return a.astype(dtype, copy=False)


def check_ints(path: str, key: str, a: np.ndarray, dtype: np.dtype, name: str = "") -> None:
    """Refuse what would not survive the cast to `dtype` unchanged (NaN, 0.5, 1e19, 300 for
    an int8): numpy would wrap it silently or with a RuntimeWarning, never an error."""
    what = f"column {name}: " if name else ""
    if not a.size:
        return
    hi, lo = a.max(), a.min()  # each once: NaN propagates to both, an inf shows in one
    if a.dtype.kind == "f" and (
        not (np.isfinite(hi) and np.isfinite(lo)) or np.any(a != np.round(a))
    ):
        raise LogError(path, key, f"{what}expected integers, got non-integral floats")
    info = np.iinfo(dtype)
    if hi > info.max or lo < info.min:
        # float 2**63 compares equal to int64 max + 1: compare in float, with margin
        raise LogError(path, key, f"{what}value out of range for {dtype}")
    if a.dtype.kind == "f" and max(abs(float(hi)), abs(float(lo))) >= 2.0**63:
        raise LogError(path, key, f"{what}value out of range for {dtype}")
