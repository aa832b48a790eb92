"""One flushed batch as a compact, self-describing, checked file: a part of a run's log.

The layout (docs/design.md, "The run's log on disk"), little-endian:

    magic      8 bytes   b"TKPART\\x00\\x01" (the last byte: the part format, 1)
    header_len u32       bytes of the header
    header_crc u32       zlib.crc32 of the header
    header     JSON      {"format": 1, "arrays": [...], "values": {...}}
    blobs                the arrays' bytes, one after another, in the header's order

Each entry of ``arrays`` names one column: ``key`` (the flushed array), ``column`` (its
column index in a table of `tracekit.log.flush.TABLES` or of a merged server run's
`tracekit.log.merged_tables.MERGED_TABLES`, or -1 for a plain array), ``rows``,
``dtype`` (the array's), ``stored`` (the dtype the bytes hold), ``delta`` (the bytes hold
differences between consecutive values, the first against 0, in wrapping int64
arithmetic), ``codec`` (``zlib`` or ``none``), ``raw_bytes`` (the bytes once decompressed),
``bytes`` (the blob's length) and ``crc32`` (of the blob). ``values`` holds the flush's
scalars and vocabularies as JSON (strings, integers, floats, lists of strings).

Why this encoding (measured on a simulated busy server, batch 256: `bench/busy_server.py`,
`bench/bench_long_run.py`): a flush's tables are int64 rows, 41 bytes per emitted token
as stored before; per column, differences of consecutive values fit in one or two bytes
(ticks of a step, handles of a batch that changes slowly), and zlib at level 1 takes the
rest: 0.36 bytes per token, compressed at ~1.5 GB/s and inflated at ~3.9 GB/s of the
int64 rows here. zstd (through pyarrow) stored 0.26 bytes per token at ~3.3 and ~4.7
GB/s: not worth a 50 MB import in the serving process, nor a codec outside the standard
library for a format meant to be read anywhere.

Reading never trusts a count the file claims beyond what its size allows: the header's
decompressed sizes must fit the rows it claims and, summed, the inflate limit of a file of
this size (`tracekit.log.archive.inflate_limit_bytes`); every blob's CRC is checked before
it is decoded, and inflating stops at the size claimed (a blob that holds more is
corrupt). A part that is truncated, torn or corrupt raises `LogError` naming the file and
the array.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from tracekit.errors import LogError
from tracekit.log.archive import InflateLimitError, inflate_limit_bytes, open_regular
from tracekit.log.flush import TABLES as FLUSH_TABLES
from tracekit.log.merged_tables import MERGED_TABLES

#: Every table a part may hold: a recorder's flush, and a merged server run's additions.
TABLES = {**FLUSH_TABLES, **MERGED_TABLES}

MAGIC = b"TKPART\x00\x01"
PART_FORMAT = 1
_PREFIX = struct.Struct("<8sII")  # magic, header length, header CRC
#: The longest header a part may have (its vocabularies of new request ids included).
MAX_HEADER_BYTES = 64 * 2**20
_ZLIB_LEVEL = 1
_NARROW = (np.int8, np.int16, np.int32)
_DTYPES = {"int64": np.int64, "float64": np.float64, "int32": np.int32, "int16": np.int16,
           "int8": np.int8}  # fmt: skip


def encode_part(arrays: Mapping[str, Any]) -> bytes:
    """The bytes of a part holding `arrays` (a flush: `tracekit.log.flush.FlushedRows`).

    Tables (int64 or float64, keys of `TABLES`) are stored column by column; other numeric
    arrays as one column; 0-d arrays and string arrays go to the header's ``values``."""
    entries: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    values: dict[str, Any] = {}
    for key, raw in arrays.items():
        a = np.asarray(raw)
        if a.dtype.kind in "US":
            values[key] = [str(x) for x in a.reshape(-1)] if a.ndim else str(a)
            continue
        if a.ndim == 0:
            values[key] = a.item()
            continue
        if a.dtype not in (np.int64, np.float64):
            raise TypeError(f"encode_part: {key!r} has dtype {a.dtype} (int64 or float64 only)")
        width = len(TABLES[key]) if key in TABLES else 1
        rows = a.reshape(-1, width)
        for j in range(width):
            col = rows[:, j] if width > 1 else rows.reshape(-1)
            entry, blob = _encode_column(col)
            entries.append({"key": key, "column": j if key in TABLES else -1, **entry})
            blobs.append(blob)
    header = json.dumps(
        {"format": PART_FORMAT, "arrays": entries, "values": values}, separators=(",", ":")
    ).encode()
    return b"".join((_PREFIX.pack(MAGIC, len(header), zlib.crc32(header)), header, *blobs))


def _encode_column(col: np.ndarray) -> tuple[dict[str, Any], bytes]:
    stored = col
    delta = False
    if col.dtype == np.int64:
        if len(col):
            with np.errstate(over="ignore"):  # wrapping: cumsum undoes it exactly
                stored = np.diff(col, prepend=np.int64(0))
            delta = True
            lo, hi = int(stored.min()), int(stored.max())
            for dt in _NARROW:
                info = np.iinfo(dt)
                if info.min <= lo and hi <= info.max:
                    stored = stored.astype(dt)
                    break
    data = np.ascontiguousarray(stored).tobytes()
    blob = zlib.compress(data, _ZLIB_LEVEL) if data else b""
    codec_name = "zlib" if data else "none"
    if len(blob) >= len(data):  # incompressible (or empty): stored as is
        blob, codec_name = data, "none"
    return {
        "rows": len(col),
        "dtype": str(col.dtype),
        "stored": str(stored.dtype),
        "delta": delta,
        "codec": codec_name,
        "raw_bytes": len(data),
        "bytes": len(blob),
        "crc32": zlib.crc32(blob),
    }, blob


def read_part_file(path: str, *, max_inflate_mb: float | None = None) -> dict[str, np.ndarray]:
    """The arrays of the part at `path` (a regular file; a FIFO or device is refused),
    checked as `decode_part` does."""
    with open_regular(path) as fh:
        data = fh.read()
    return decode_part(data, path, max_inflate_mb=max_inflate_mb)


def is_part_bytes(head: bytes) -> bool:
    """Whether `head` (a file's first bytes) begins a part of this format."""
    return head[: len(MAGIC) - 1] == MAGIC[:-1]


def decode_part(
    data: bytes, where: str, *, max_inflate_mb: float | None = None
) -> dict[str, np.ndarray]:
    """The arrays a part's bytes hold, as the flush had them (tables flat int64/float64,
    scalars 0-d, vocabularies string arrays). Raises `LogError(where, field, problem)`."""
    header = _read_header(data, where)
    entries, values = header["arrays"], header["values"]
    limit = inflate_limit_bytes(len(data), max_inflate_mb)
    body_at = _PREFIX.size + _header_len(data)
    spans = _check_entries(entries, len(data) - body_at, limit, where)
    columns: dict[str, dict[int, np.ndarray]] = {}
    for e, (start, end) in zip(entries, spans, strict=True):
        blob = data[body_at + start : body_at + end]
        field = _field(e)
        if zlib.crc32(blob) != e["crc32"]:
            raise LogError(where, field, "corrupt (its CRC does not match)")
        cols = columns.setdefault(e["key"], {})
        if e["column"] in cols:
            raise LogError(where, field, "stored twice")
        cols[e["column"]] = _decode_column(e, blob, where)
    out: dict[str, np.ndarray] = {}
    for key, cols in columns.items():
        if key in TABLES:
            width = len(TABLES[key])
            if sorted(cols) != list(range(width)):
                raise LogError(where, key, f"has columns {sorted(cols)}, expected 0..{width - 1}")
            n = {len(c) for c in cols.values()}
            if len(n) != 1:
                raise LogError(where, key, f"columns of different lengths {sorted(n)}")
            out[key] = np.stack([cols[j] for j in range(width)], axis=1).reshape(-1)
        else:
            if list(cols) != [-1]:  # a table a later format defines: its rows would be lost
                raise LogError(
                    where, key, "a table this tracekit does not know (a newer tracekit wrote "
                    "this part: upgrade to read it)"
                )  # fmt: skip
            out[key] = cols[-1].copy()  # writable, like every other array read
    for key, v in values.items():
        if key in out:
            raise LogError(where, key, "stored twice")
        out[key] = _value_array(key, v, where)
    return out


def _header_len(data: bytes) -> int:
    return _PREFIX.unpack_from(data)[1]


def _read_header(data: bytes, where: str) -> dict[str, Any]:
    if len(data) < _PREFIX.size:
        raise LogError(where, "file", f"truncated: {len(data)} bytes, not a whole part header")
    magic, n, crc = _PREFIX.unpack_from(data)
    if magic[:-1] != MAGIC[:-1]:
        raise LogError(where, "file", "not a tracekit part (bad magic bytes)")
    if magic[-1] != PART_FORMAT:
        raise LogError(
            where, "format", f"part format {magic[-1]}; this tracekit reads {PART_FORMAT} (upgrade)"
        )
    if n > MAX_HEADER_BYTES or _PREFIX.size + n > len(data):
        raise LogError(
            where, "header", f"truncated or torn: claims {n} bytes, file has {len(data)}"
        )
    raw = data[_PREFIX.size : _PREFIX.size + n]
    if zlib.crc32(raw) != crc:
        raise LogError(where, "header", "corrupt (its CRC does not match)")
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise LogError(where, "header", f"unreadable JSON ({e})") from None
    if not (
        isinstance(header, dict)
        and isinstance(header.get("arrays"), list)
        and isinstance(header.get("values"), dict)
    ):
        raise LogError(where, "header", "not a part header (arrays and values)")
    return header


_ENTRY_FIELDS = {
    "key": str, "column": int, "rows": int, "dtype": str, "stored": str, "delta": bool,
    "codec": str, "raw_bytes": int, "bytes": int, "crc32": int,
}  # fmt: skip


def _field(e: Mapping[str, Any]) -> str:
    key = e.get("key", "?")
    col = e.get("column", -1)
    if key in TABLES and isinstance(col, int) and 0 <= col < len(TABLES[key]):
        return f"{key}.{TABLES[key][col]}"
    return str(key)


def _check_entries(
    entries: list[Any], body_bytes: int, limit: int, where: str
) -> list[tuple[int, int]]:
    """Every entry well-formed, its sizes consistent; the blobs' spans in the body."""
    spans = []
    at = 0
    inflated = 0
    for e in entries:
        if not isinstance(e, dict):
            raise LogError(where, "header", "an array entry is not an object")
        for name, kind in _ENTRY_FIELDS.items():
            v = e.get(name)
            if type(v) is not kind:
                raise LogError(where, f"{_field(e)}: {name}", f"missing or not {kind.__name__}")
        field = _field(e)
        if e["dtype"] not in ("int64", "float64") or e["stored"] not in _DTYPES:
            raise LogError(where, field, f"dtype {e['dtype']} stored as {e['stored']}: unknown")
        if e["codec"] not in ("zlib", "none"):
            raise LogError(where, field, f"codec {e['codec']!r} unknown")
        if e["rows"] < 0 or e["bytes"] < 0 or e["column"] < -1:
            raise LogError(where, field, "negative size")
        if e["raw_bytes"] != e["rows"] * np.dtype(_DTYPES[e["stored"]]).itemsize:
            raise LogError(where, field, f"{e['raw_bytes']} bytes for {e['rows']} rows")
        if e["codec"] == "none" and e["bytes"] != e["raw_bytes"]:
            raise LogError(where, field, "stored uncompressed with a different size")
        inflated += e["raw_bytes"] + e["rows"] * 8
        if inflated > limit:
            raise InflateLimitError(
                where, field, f"would inflate beyond {limit} bytes (the reading limit for a "
                "file of this size; --max-inflate-mb raises it)"
            )  # fmt: skip
        spans.append((at, at + e["bytes"]))
        at += e["bytes"]
    if at > body_bytes:
        raise LogError(where, "file", f"truncated: its arrays need {at} bytes, {body_bytes} there")
    if at < body_bytes:
        raise LogError(where, "file", f"{body_bytes - at} bytes after the last array")
    return spans


def _decode_column(e: Mapping[str, Any], blob: bytes, where: str) -> np.ndarray:
    raw = blob
    if e["codec"] == "zlib":
        d = zlib.decompressobj()
        try:  # never more than the size claimed (already checked against the file's)
            raw = d.decompress(blob, e["raw_bytes"])
        except zlib.error as err:
            raise LogError(where, _field(e), f"corrupt compressed data ({err})") from None
        if len(raw) != e["raw_bytes"] or d.unconsumed_tail or not d.eof or d.unused_data:
            raise LogError(
                where, _field(e), f"inflates to other than the {e['raw_bytes']} bytes claimed"
            )
    col = np.frombuffer(raw, dtype=_DTYPES[e["stored"]])
    dtype = _DTYPES[e["dtype"]]
    if e["delta"]:
        if dtype is not np.int64:
            raise LogError(where, _field(e), "delta-coded but not int64")
        with np.errstate(over="ignore"):
            return np.cumsum(col, dtype=np.int64)
    return col if col.dtype == dtype else col.astype(dtype)


def _value_array(key: str, v: Any, where: str) -> np.ndarray:
    if isinstance(v, list):
        if not all(isinstance(x, str) for x in v):
            raise LogError(where, key, "a vocabulary with a non-string entry")
        return np.array(v, dtype=str)
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise LogError(where, key, f"a value of type {type(v).__name__}")
    if isinstance(v, int):
        if not -(2**63) <= v < 2**63:
            raise LogError(where, key, "an integer outside int64")
        return np.array(v, dtype=np.int64)
    return np.array(v)


def part_bytes_on_disk(path: str) -> int:
    """A part's size (for the index and progress)."""
    return os.stat(path).st_size


__all__ = [
    "MAGIC",
    "PART_FORMAT",
    "decode_part",
    "encode_part",
    "is_part_bytes",
    "part_bytes_on_disk",
    "read_part_file",
]
