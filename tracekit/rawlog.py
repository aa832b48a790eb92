"""The raw log: one run's recorded events, the boundary between capture and analysis.

A `RawLog` holds flat numpy tables with every time in seconds from engine start (the
recorder's start). Capture writes one; analysis reads one and never sees a live engine.

On disk it is one `.npz` per run (`save`/`load`), self-describing:

- ``schema`` = ``"tracekit.rawlog"``, ``schema_version`` = 1;
- one array per table column, named ``TABLE.COLUMN`` with the unit in the column name
  (``steps.t_start_s``, ``segments.label``, ...);
- ``labels`` (segment label vocabulary), ``cause_map`` (JSON), ``config`` (JSON),
  ``meta`` (JSON: clock source, tracekit version, warnings recorded at capture),
  ``request_ids`` (strings), ``counter_names``, ``wall_s``.

`load` also reads the *published* layout (the `.npz` files written by the method tracekit
industrialises; see docs/rawlog.md) unchanged. A log can never execute code: arrays are
read from their `.npy` headers with pickles refused (what ``allow_pickle=False`` does, but
checked before any data is read), and members the layout does not define are skipped
unread. What is rejected and what is only warned about: `tracekit.validate`.
"""

from __future__ import annotations

import json
import math
import os
import re
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from .errors import LogError, one_line
from .labels import DEFAULT_CAUSE_MAP

SCHEMA = "tracekit.rawlog"
SCHEMA_VERSION = 1

# Eviction modes.
MODE_SWAP = 0
MODE_RECOMPUTE = 1
MODE_UNKNOWN = -1
MODES = {"swap": MODE_SWAP, "recompute": MODE_RECOMPUTE, "unknown": MODE_UNKNOWN}

# `steps.graph_size`: -1 no decode rows in the step, 0 ran eager, n > 0 padded captured size.
GRAPH_NO_DECODE = -1
GRAPH_EAGER = 0


class _Table:
    """A table of equal-length 1-D numpy columns. Subclasses are dataclasses of columns."""

    DTYPES: dict[str, Any] = {}

    def __len__(self) -> int:
        first = fields(self)[0].name  # type: ignore[arg-type]
        return int(len(getattr(self, first)))

    @classmethod
    def empty(cls):
        return cls(**{k: np.zeros(0, dtype=d) for k, d in cls.DTYPES.items()})

    @classmethod
    def from_columns(cls, **cols):
        return cls(**{k: np.asarray(cols[k], dtype=d) for k, d in cls.DTYPES.items()})

    def take(self, idx):
        return type(self)(**{k: getattr(self, k)[idx] for k in self.DTYPES})

    def columns(self) -> dict[str, np.ndarray]:
        return {k: getattr(self, k) for k in self.DTYPES}


@dataclass(frozen=True)
class Steps(_Table):
    """One row per engine step. `t_start_s`/`t_end_s`: the step's boundaries, engine clock."""

    t_start_s: np.ndarray
    t_end_s: np.ndarray
    num_decode: np.ndarray  # decode rows in the step
    num_prefill_tokens: np.ndarray  # prompt tokens prefilled in the step
    graph_size: np.ndarray  # -1 no decode, 0 eager, n > 0 padded captured batch size
    num_preempted: np.ndarray  # requests evicted during the step
    num_swapped_in: np.ndarray  # requests readmitted during the step
    DTYPES = {
        "t_start_s": np.float64,
        "t_end_s": np.float64,
        "num_decode": np.int64,
        "num_prefill_tokens": np.int64,
        "graph_size": np.int64,
        "num_preempted": np.int64,
        "num_swapped_in": np.int64,
    }


@dataclass(frozen=True)
class Segments(_Table):
    """Labelled windows. `step` is -1 for a window outside any step (another thread)."""

    step: np.ndarray
    label: np.ndarray  # index into RawLog.labels
    t_start_s: np.ndarray
    t_end_s: np.ndarray
    thread: np.ndarray  # small integer per recording thread, 0 = the thread that started
    is_device: np.ndarray  # 1: device execution time (CUDA events), 0: host time
    DTYPES = {
        "step": np.int64,
        "label": np.int64,
        "t_start_s": np.float64,
        "t_end_s": np.float64,
        "thread": np.int64,
        "is_device": np.int8,
    }


@dataclass(frozen=True)
class GcPauses(_Table):
    """Garbage-collector pauses from `gc.callbacks`, with their generation."""

    t_start_s: np.ndarray
    t_end_s: np.ndarray
    generation: np.ndarray
    DTYPES = {"t_start_s": np.float64, "t_end_s": np.float64, "generation": np.int64}


@dataclass(frozen=True)
class Emissions(_Table):
    """Token emissions at the engine boundary: one row per (request, step) that emitted."""

    request: np.ndarray  # index into RawLog.requests
    t_s: np.ndarray
    step: np.ndarray
    num_tokens: np.ndarray  # > 1 when a step emits several tokens of one request (spec decoding)
    # the step whose device work this emission reads: `step` in a synchronous engine, the
    # previous step under async scheduling (results of step N are read while N+1 runs)
    device_step: np.ndarray = None  # type: ignore[assignment]  # default: `step`
    DTYPES = {
        "request": np.int64,
        "t_s": np.float64,
        "step": np.int64,
        "num_tokens": np.int64,
        "device_step": np.int64,
    }

    def __post_init__(self) -> None:
        if self.device_step is None:
            object.__setattr__(self, "device_step", np.asarray(self.step).copy())


@dataclass(frozen=True)
class Evictions(_Table):
    """Explicit evictions. `t_readmit_s` is NaN for a request never readmitted."""

    request: np.ndarray
    t_evict_s: np.ndarray
    t_readmit_s: np.ndarray
    mode: np.ndarray  # MODE_SWAP, MODE_RECOMPUTE, MODE_UNKNOWN
    DTYPES = {
        "request": np.int64,
        "t_evict_s": np.float64,
        "t_readmit_s": np.float64,
        "mode": np.int64,
    }


@dataclass(frozen=True)
class Requests(_Table):
    """One row per request. NaN arrival or first token: not recorded."""

    arrival_s: np.ndarray
    prompt_tokens: np.ndarray  # -1: unknown
    max_new_tokens: np.ndarray  # -1: unknown
    first_token_s: np.ndarray
    DTYPES = {
        "arrival_s": np.float64,
        "prompt_tokens": np.int64,
        "max_new_tokens": np.int64,
        "first_token_s": np.float64,
    }


@dataclass(frozen=True)
class Counters(_Table):
    """Sampled engine counters (batch size, free KV blocks, ...)."""

    name: np.ndarray  # index into RawLog.counter_names
    t_s: np.ndarray
    value: np.ndarray
    DTYPES = {"name": np.int64, "t_s": np.float64, "value": np.float64}


TABLES: dict[str, type[_Table]] = {
    "steps": Steps,
    "segments": Segments,
    "gc_pauses": GcPauses,
    "emissions": Emissions,
    "evictions": Evictions,
    "requests": Requests,
    "counters": Counters,
}


@dataclass(frozen=True)
class RawLog:
    """One run. Times are seconds from engine start; see the module docstring."""

    steps: Steps
    segments: Segments
    gc_pauses: GcPauses
    emissions: Emissions
    evictions: Evictions
    requests: Requests
    counters: Counters = field(default_factory=Counters.empty)
    labels: tuple[str, ...] = ()
    request_ids: tuple[str, ...] = ()
    counter_names: tuple[str, ...] = ()
    cause_map: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_CAUSE_MAP))
    config: Mapping[str, Any] = field(default_factory=dict)
    wall_s: float = float("nan")
    meta: Mapping[str, Any] = field(default_factory=dict)
    extras: Mapping[str, np.ndarray] = field(default_factory=dict)
    path: str = "<memory>"
    warnings: tuple[str, ...] = ()

    # -- convenience -------------------------------------------------------------------
    @property
    def rung(self) -> str | None:
        r = self.config.get("rung")
        return None if r is None else str(r)

    @property
    def seed(self) -> Any:
        return self.config.get("seed")

    @property
    def source(self) -> str:
        return str(self.meta.get("source", "tracekit"))

    def with_path(self, path: str) -> RawLog:
        return replace(self, path=path)

    # -- io ----------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> str:
        """Write the v1 `.npz` atomically (a temporary file renamed into place)."""
        path = os.fspath(path)
        arrays: dict[str, np.ndarray] = {
            "schema": np.array(SCHEMA),
            "schema_version": np.array(SCHEMA_VERSION, dtype=np.int64),
            "labels": np.array(self.labels, dtype=str).reshape(-1),
            "request_ids": np.array(self.request_ids, dtype=str).reshape(-1),
            "counter_names": np.array(self.counter_names, dtype=str).reshape(-1),
            "cause_map": np.array(json.dumps(dict(self.cause_map), sort_keys=True)),
            "config": np.array(json.dumps(_jsonable(self.config), sort_keys=True)),
            "meta": np.array(json.dumps(_jsonable(self.meta), sort_keys=True)),
            "wall_s": np.array(float(self.wall_s)),
        }
        for tname in TABLES:
            for cname, col in getattr(self, tname).columns().items():
                arrays[f"{tname}.{cname}"] = col
        for k, v in self.extras.items():
            arrays[f"extra.{k}"] = np.asarray(v)
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as fh:
            np.savez(fh, **arrays)  # type: ignore[arg-type]  # stub: kwargs could be allow_pickle
        os.replace(tmp, path)
        return path


def _jsonable(obj: Any) -> Any:
    """JSON-safe copy of config/meta values (numpy scalars, tuples, non-finite floats)."""
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return _jsonable(obj.item())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)


# -- loading ---------------------------------------------------------------------------

PUBLISHED_ARRAYS = {
    "steps": 7,
    "segs": 4,
    "gcs": 3,
    "emissions": 3,
    "evictions": 3,
    "requests": 5,
}
PUBLISHED_SEG_LABELS = ("tok", "swap", "prefill", "decode")


V1_SCALARS = frozenset(
    {"schema", "schema_version", "labels", "request_ids", "counter_names", "cause_map",
     "config", "meta", "wall_s"}
)  # fmt: skip
V1_COLUMNS = frozenset(f"{t}.{c}" for t, cls in TABLES.items() for c in cls.DTYPES)
PUBLISHED_OTHERS = frozenset({"trace", "wall", "config"})
#: deflate expands at most ~1032:1; a member claiming more is lying about its size
_MAX_DEFLATE_RATIO = 1100


def load(path: str | os.PathLike[str], *, validate: bool = True) -> RawLog:
    """Read a raw log (v1 or the published layout). Raises `LogError` naming file and field."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise LogError(path, "file", "does not exist")
    if os.path.isdir(path):
        hint = f"`tracekit recover {path}` merges it into one .npz"
        if not os.path.exists(os.path.join(path, "meta.json")):
            hint = "expected a raw log .npz"
        raise LogError(path, "file", f"is a directory (an interrupted run's parts? {hint})")
    arrays, ignored = _read_npz(path)
    if "schema" in arrays:
        log = _from_v1(path, arrays)
    elif "steps" in arrays or "segs" in arrays:
        log = _from_published(path, arrays)
    else:
        raise LogError(
            path, "schema", "no 'schema' array and not the published layout: not a tracekit log"
        )
    if ignored:
        shown = ", ".join(repr(n) for n in ignored[:5]) + (", ..." if len(ignored) > 5 else "")
        log = replace(
            log,
            warnings=(*log.warnings, f"ignored {len(ignored)} unknown archive member(s): {shown}"),
        )
    if validate:
        from .validate import validate_log

        log = validate_log(log)
    return log


def _read_npz(path: str) -> tuple[dict[str, np.ndarray], list[str]]:
    """The arrays of a raw log's archive, and the names of members it ignored.

    Only the members the log's layout defines are read; anything else in the archive is
    named and skipped, never decoded. Each array is read from its `.npy` header by hand so
    that an object dtype (a pickle) is refused before a byte of it is read, and a header
    that claims more data than the member holds is refused before anything is allocated."""
    try:
        zf = zipfile.ZipFile(path)
    except Exception as e:  # BadZipFile, OSError, EOFError, ValueError, struct errors...
        raise LogError(path, "file", f"not a readable .npz archive ({_short(e)})") from None
    with zf:
        try:
            infos = zf.infolist()
        except Exception as e:
            raise LogError(path, "file", f"not a readable .npz archive ({_short(e)})") from None
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
        if "schema" in members:
            known = V1_SCALARS | V1_COLUMNS
            wanted = {k for k in members if k in known or k.startswith("extra.")}
        else:
            known = frozenset(PUBLISHED_ARRAYS) | PUBLISHED_OTHERS
            wanted = {k for k in members if k in known}
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
        raise LogError(path, key, f"corrupt array ({_short(e)})") from None


def _short(e: BaseException) -> str:
    s = str(e).splitlines()[0] if str(e) else type(e).__name__
    return s[:160]


def _scalar_str(path: str, arrays: dict[str, np.ndarray], key: str) -> str:
    a = arrays.get(key)
    if a is None:
        raise LogError(path, key, "missing")
    if a.shape != () or a.dtype.kind != "U":
        raise LogError(path, key, f"expected a string scalar, got {a.dtype} {a.shape}")
    return str(a[()])


def _json(path: str, arrays: dict[str, np.ndarray], key: str, default: Any = None) -> Any:
    if key not in arrays and default is not None:
        return default
    s = _scalar_str(path, arrays, key)
    try:
        return _clean_strings(json.loads(s))
    except json.JSONDecodeError as e:
        raise LogError(path, key, f"not valid JSON ({e.msg} at char {e.pos})") from None
    except (ValueError, RecursionError) as e:  # 5000-digit integers, 100,000 nested lists
        raise LogError(path, key, f"not usable JSON ({_short(e)})") from None


_SURROGATE = re.compile("[\ud800-\udfff]")


def _clean_strings(obj: Any) -> Any:
    """Strings from a log as valid Unicode: lone surrogates (which no terminal or file can
    encode) become U+FFFD. Everything else is kept as it is."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
            return obj
        except UnicodeEncodeError:
            return _SURROGATE.sub("\ufffd", obj)
    if isinstance(obj, dict):
        return {_clean_strings(k): _clean_strings(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean_strings(v) for v in obj]
    return obj


def _str_list(path: str, arrays: dict[str, np.ndarray], key: str) -> tuple[str, ...]:
    a = arrays.get(key)
    if a is None:
        return ()
    if a.ndim != 1 or (a.size and a.dtype.kind != "U"):
        raise LogError(path, key, f"expected a 1-D array of strings, got {a.dtype} {a.shape}")
    return tuple(_clean_strings(str(x)) for x in a)


def _column(path: str, arrays: dict[str, np.ndarray], key: str, dtype: Any) -> np.ndarray:
    a = arrays.get(key)
    if a is None:
        raise LogError(path, key, "missing")
    if a.ndim != 1:
        raise LogError(path, key, f"expected a 1-D column, got shape {a.shape}")
    if a.dtype.kind not in "biuf":
        raise LogError(path, key, f"expected numbers, got dtype {a.dtype}")
    if np.dtype(dtype).kind in "iu":
        _check_ints(path, key, a, np.dtype(dtype))
    return a.astype(dtype, copy=False)


def _check_ints(path: str, key: str, a: np.ndarray, dtype: np.dtype, name: str = "") -> None:
    """Refuse what would not survive the cast to `dtype` unchanged (NaN, 0.5, 1e19, 300 for
    an int8): numpy would wrap it silently or with a RuntimeWarning, never an error."""
    what = f"column {name}: " if name else ""
    if a.dtype.kind == "f" and (not np.all(np.isfinite(a)) or np.any(a != np.round(a))):
        raise LogError(path, key, f"{what}expected integers, got non-integral floats")
    info = np.iinfo(dtype)
    if a.size and (a.max() > info.max or a.min() < info.min):
        # float 2**63 compares equal to int64 max + 1: compare in float, with margin
        raise LogError(path, key, f"{what}value out of range for {dtype}")
    if a.dtype.kind == "f" and a.size and max(abs(float(a.max())), abs(float(a.min()))) >= 2.0**63:
        raise LogError(path, key, f"{what}value out of range for {dtype}")


#: Columns a v1 log may lack (each table's dataclass gives their default).
OPTIONAL_COLUMNS = frozenset({"emissions.device_step"})


def _from_v1(path: str, arrays: dict[str, np.ndarray]) -> RawLog:
    schema = _scalar_str(path, arrays, "schema")
    if schema != SCHEMA:
        raise LogError(path, "schema", f"is {schema!r}, expected {SCHEMA!r}")
    v = arrays.get("schema_version")
    if v is None or v.shape != () or v.dtype.kind not in "iu":
        raise LogError(path, "schema_version", "missing or not an integer scalar")
    if int(v) != SCHEMA_VERSION:
        raise LogError(
            path,
            "schema_version",
            f"is {int(v)}; this tracekit reads version {SCHEMA_VERSION} (upgrade tracekit)",
        )
    tables: dict[str, _Table] = {}
    for tname, cls in TABLES.items():
        keys = [f"{tname}.{c}" for c in cls.DTYPES]
        if tname == "counters" and not any(k in arrays for k in keys):
            tables[tname] = cls.empty()  # optional as a whole table
            continue
        cols = {
            c: _column(path, arrays, f"{tname}.{c}", dt)
            for c, dt in cls.DTYPES.items()
            if f"{tname}.{c}" not in OPTIONAL_COLUMNS or f"{tname}.{c}" in arrays
        }
        n = {len(c) for c in cols.values()}
        if len(n) > 1:
            lens = ", ".join(f"{k}={len(c)}" for k, c in cols.items())
            raise LogError(path, tname, f"columns differ in length ({lens})")
        tables[tname] = cls(**cols)
    wall = arrays.get("wall_s")
    if wall is None or wall.shape != () or wall.dtype.kind not in "iuf":
        raise LogError(path, "wall_s", "missing or not a number")
    cause_map = _json(path, arrays, "cause_map", default=dict(DEFAULT_CAUSE_MAP))
    config = _json(path, arrays, "config", default={})
    meta = _json(path, arrays, "meta", default={})
    for key, val in (("cause_map", cause_map), ("config", config), ("meta", meta)):
        if not isinstance(val, dict):
            raise LogError(path, key, f"expected a JSON object, got {type(val).__name__}")
    if not all(isinstance(k, str) and isinstance(x, str) for k, x in cause_map.items()):
        raise LogError(path, "cause_map", "expected an object of label -> cause strings")
    extras = {k[len("extra.") :]: a for k, a in arrays.items() if k.startswith("extra.")}
    warnings: list[str] = []
    if meta.get("interrupted") is True:
        warnings.append(
            "recovered from the parts of an interrupted recording: "
            "events after its last flush are lost"
        )
    noted = meta.get("warnings")  # what capture or recovery noted about this run
    if isinstance(noted, list):
        warnings += [one_line(str(w))[:300] for w in noted[:20]]
    return RawLog(
        **tables,  # type: ignore[arg-type]
        labels=_str_list(path, arrays, "labels"),
        request_ids=_str_list(path, arrays, "request_ids"),
        counter_names=_str_list(path, arrays, "counter_names"),
        cause_map=cause_map,
        config=config,
        wall_s=float(wall),
        meta=meta,
        extras=extras,
        path=path,
        warnings=tuple(warnings),
    )


def _published_array(path: str, arrays: dict[str, np.ndarray], key: str) -> np.ndarray:
    ncol = PUBLISHED_ARRAYS[key]
    a = arrays.get(key)
    if a is None:
        raise LogError(path, key, "missing (published layout needs steps, segs, gcs, ...)")
    if a.dtype.kind not in "biuf":
        raise LogError(path, key, f"expected numbers, got dtype {a.dtype}")
    if a.size == 0:
        return np.zeros((0, ncol), dtype=np.float64)
    if a.ndim != 2 or a.shape[1] != ncol:
        raise LogError(path, key, f"expected shape (n, {ncol}), got {a.shape}")
    # column-major: each column becomes a contiguous array (a row-major (n, 3) array's
    # columns are strided views, and every pass over emission times would read 3x the bytes)
    return np.asfortranarray(a, dtype=np.float64)


def _int_col(path: str, key: str, col: np.ndarray, name: str) -> np.ndarray:
    _check_ints(path, key, col, np.dtype(np.int64), name)
    return col.astype(np.int64)


def _from_published(path: str, arrays: dict[str, np.ndarray]) -> RawLog:
    st = _published_array(path, arrays, "steps")
    sg = _published_array(path, arrays, "segs")
    gc_ = _published_array(path, arrays, "gcs")
    em = _published_array(path, arrays, "emissions")
    ev = _published_array(path, arrays, "evictions")
    rq = _published_array(path, arrays, "requests")

    steps = Steps(
        t_start_s=st[:, 0],
        t_end_s=st[:, 1],
        num_decode=_int_col(path, "steps", st[:, 2], "n_decode"),
        num_prefill_tokens=_int_col(path, "steps", st[:, 3], "n_prefill_tok"),
        graph_size=_int_col(path, "steps", st[:, 4], "graph"),
        num_preempted=_int_col(path, "steps", st[:, 5], "preempted"),
        num_swapped_in=_int_col(path, "steps", st[:, 6], "swapped_in"),
    )
    codes = _int_col(path, "segs", sg[:, 1], "code")
    if codes.size and (codes.min() < 0 or codes.max() > 3):
        raise LogError(path, "segs", "column code: expected 0 tok, 1 swap, 2 prefill, 3 decode")
    segments = Segments(
        step=_int_col(path, "segs", sg[:, 0], "step"),
        label=codes,
        t_start_s=sg[:, 2],
        t_end_s=sg[:, 3],
        thread=np.zeros(len(sg), dtype=np.int64),
        is_device=np.zeros(len(sg), dtype=np.int8),
    )
    gcs = GcPauses(
        t_start_s=gc_[:, 0],
        t_end_s=gc_[:, 1],
        generation=_int_col(path, "gcs", gc_[:, 2], "generation"),
    )
    req_ids_num = _int_col(path, "requests", rq[:, 0], "request id")
    order = np.argsort(req_ids_num, kind="stable")
    if np.any(req_ids_num[order][1:] == req_ids_num[order][:-1]):  # sorted: neighbours
        raise LogError(path, "requests", "column request id: duplicate ids")

    def to_index(key: str, ids: np.ndarray) -> np.ndarray:
        ids = _int_col(path, key, ids, "request id")
        pos = np.searchsorted(req_ids_num[order], ids)
        pos = np.clip(pos, 0, max(len(order) - 1, 0))
        if len(order) == 0 and len(ids):
            raise LogError(path, key, "refers to requests but the requests array is empty")
        known = req_ids_num[order][pos] == ids if len(ids) else np.ones(0, bool)
        if not np.all(known):
            bad = ids[~known][:3].tolist()
            raise LogError(path, key, f"unknown request id(s) {bad} (not in requests)")
        return order[pos]

    emissions = Emissions(
        request=to_index("emissions", em[:, 0]),
        t_s=em[:, 1],
        step=_int_col(path, "emissions", em[:, 2], "step index"),
        num_tokens=np.ones(len(em), dtype=np.int64),
    )
    evictions = Evictions(
        request=to_index("evictions", ev[:, 0]),
        t_evict_s=ev[:, 1],
        t_readmit_s=ev[:, 2],
        mode=np.full(len(ev), MODE_SWAP, dtype=np.int64),
    )
    requests = Requests(
        arrival_s=rq[:, 1],
        prompt_tokens=_int_col(path, "requests", rq[:, 2], "prompt tokens"),
        max_new_tokens=_int_col(path, "requests", rq[:, 3], "max new tokens"),
        first_token_s=rq[:, 4],
    )
    wall = arrays.get("wall")
    if wall is None or wall.size != 1 or wall.dtype.kind not in "iuf":
        raise LogError(path, "wall", "missing or not a number")
    config: dict[str, Any] = {}
    if "config" in arrays:
        config = _json(path, arrays, "config")
        if not isinstance(config, dict):
            raise LogError(path, "config", "expected a JSON object")
    extras = {k: a for k, a in arrays.items() if k == "trace"}
    return RawLog(
        steps=steps,
        segments=segments,
        gc_pauses=gcs,
        emissions=emissions,
        evictions=evictions,
        requests=requests,
        labels=PUBLISHED_SEG_LABELS,
        request_ids=tuple(str(x) for x in req_ids_num.tolist()),
        cause_map=dict(DEFAULT_CAUSE_MAP),
        config=config,
        wall_s=float(wall.reshape(())),
        meta={"source": "published", "clock": "perf_counter seconds from engine start"},
        extras=extras,
        path=path,
    )
