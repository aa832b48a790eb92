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
industrialises; see docs/rawlog.md) unchanged. Every array is read with
``allow_pickle=False``: a log can never execute code.
"""

from __future__ import annotations

import json
import math
import os
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from .errors import LogError
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
    DTYPES = {"request": np.int64, "t_s": np.float64, "step": np.int64, "num_tokens": np.int64}


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
            np.savez(fh, **arrays)
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


def load(path: str | os.PathLike[str], *, validate: bool = True) -> RawLog:
    """Read a raw log (v1 or the published layout). Raises `LogError` naming file and field."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise LogError(path, "file", "does not exist")
    if os.path.isdir(path):
        raise LogError(
            path, "file", "is a directory (an interrupted run? `tracekit recover` merges it)"
        )
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
            if bad is not None:
                raise LogError(path, bad.removesuffix(".npy"), "corrupt member (CRC mismatch)")
        npz = np.load(path, allow_pickle=False)
    except LogError:
        raise
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise LogError(path, "file", f"not a readable .npz archive ({_short(e)})") from None
    with npz:
        arrays: dict[str, np.ndarray] = {}
        for key in npz.files:
            try:
                arrays[key] = npz[key]
            except ValueError as e:
                # object arrays (pickles) are refused: a log must never load code
                raise LogError(path, key, f"unreadable array ({_short(e)})") from None
            except Exception as e:  # zlib/zip/format errors inside one member
                raise LogError(path, key, f"corrupt array ({_short(e)})") from None
    if "schema" in arrays:
        log = _from_v1(path, arrays)
    elif "steps" in arrays or "segs" in arrays:
        log = _from_published(path, arrays)
    else:
        raise LogError(
            path, "schema", "no 'schema' array and not the published layout: not a tracekit log"
        )
    if validate:
        from .validate import validate_log

        log = validate_log(log)
    return log


def _short(e: BaseException) -> str:
    s = str(e).splitlines()[0] if str(e) else type(e).__name__
    return s[:160]


def _scalar_str(path: str, arrays: dict[str, np.ndarray], key: str) -> str:
    a = arrays.get(key)
    if a is None:
        raise LogError(path, key, "missing")
    if a.shape != () or a.dtype.kind not in "US":
        raise LogError(path, key, f"expected a string scalar, got {a.dtype} {a.shape}")
    return str(a[()])


def _json(path: str, arrays: dict[str, np.ndarray], key: str, default: Any = None) -> Any:
    if key not in arrays and default is not None:
        return default
    s = _scalar_str(path, arrays, key)
    try:
        return json.loads(s)
    except json.JSONDecodeError as e:
        raise LogError(path, key, f"not valid JSON ({e.msg} at char {e.pos})") from None


def _str_list(path: str, arrays: dict[str, np.ndarray], key: str) -> tuple[str, ...]:
    a = arrays.get(key)
    if a is None:
        return ()
    if a.ndim != 1 or (a.size and a.dtype.kind not in "US"):
        raise LogError(path, key, f"expected a 1-D array of strings, got {a.dtype} {a.shape}")
    return tuple(str(x) for x in a)


def _column(path: str, arrays: dict[str, np.ndarray], key: str, dtype: Any) -> np.ndarray:
    a = arrays.get(key)
    if a is None:
        raise LogError(path, key, "missing")
    if a.ndim != 1:
        raise LogError(path, key, f"expected a 1-D column, got shape {a.shape}")
    if a.dtype.kind not in "biuf":
        raise LogError(path, key, f"expected numbers, got dtype {a.dtype}")
    if np.dtype(dtype).kind in "iu" and a.dtype.kind == "f":
        if not np.all(np.isfinite(a)) or np.any(a != np.round(a)):
            raise LogError(path, key, "expected integers, got non-integral floats")
    return a.astype(dtype, copy=False)


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
        cols = {}
        for cname, dt in cls.DTYPES.items():
            key = f"{tname}.{cname}"
            if key not in arrays and tname == "counters":
                cols = None
                break
            cols[cname] = _column(path, arrays, key, dt)
        if cols is None:
            tables[tname] = cls.empty()
            continue
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
    return a.astype(np.float64, copy=False)


def _int_col(path: str, key: str, col: np.ndarray, name: str) -> np.ndarray:
    if not np.all(np.isfinite(col)) or np.any(col != np.round(col)):
        raise LogError(path, key, f"column {name}: expected integers")
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
    if len(np.unique(req_ids_num)) != len(req_ids_num):
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
