"""A deterministic corpus of malformed raw logs, derived from one valid v1 log and one valid
published-layout log (used by tests/log/test_malformed_logs.py).

Each `Case` is a file to write and what tracekit must do with it:

- ``reject``: `tracekit.load` raises `LogError` (the CLI: exit 2, one line);
- ``ok``: it loads and analyses; `warns`, if set, is a substring of one of its warnings;
- ``any``: either, but nothing else (byte-level damage can land anywhere, harmless or not).

`needle`, if set, must appear in the error message (it names what is wrong).
"""

from __future__ import annotations

import functools
import io
import json
import math
import pickle
import warnings
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tracekit.log.rawlog import (
    Admissions,
    Counters,
    Coverage,
    Emissions,
    Evictions,
    Evictors,
    GcPauses,
    OsSamples,
    Preemptions,
    PrefillChunks,
    RawLog,
    Requests,
    Segments,
    Steps,
    Waits,
)

SEED = 20240607
#: A label or id that breaks naive JSON, HTML or line-oriented output.
HOSTILE = '"}</script><script>alert(1)</script>\n\u2028\U0001f600'


@dataclass(frozen=True)
class Case:
    name: str
    expect: str  # "reject", "ok" or "any"
    payload: bytes
    needle: str = ""  # in the error message (reject) or in a warning (ok)

    def write(self, path: Path) -> Path:
        path.write_bytes(self.payload)
        return path


class Pickled:
    """An object whose unpickling would leave a marker file: loading it must never happen."""

    marker = "/tmp/tracekit-pickle-executed"

    def __reduce__(self):
        return (open, (self.marker, "w"))


# -- the two valid bases -----------------------------------------------------------------


def base_log() -> RawLog:
    """A small but complete run: 3 requests, 12 steps, every table non-empty, eager steps,
    an eviction with its readmission, a GC pause, an engine-defined label, counters."""
    n_steps = 12
    t0 = np.arange(n_steps) * 0.010
    t1 = t0 + 0.008
    graph = np.array([8, 8, 0, 8, 16, 16, 0, 8, 8, 16, 8, 8])
    steps = Steps(
        t_start_s=t0,
        t_end_s=t1,
        num_decode=np.full(n_steps, 3),
        num_prefill_tokens=np.array([128] + [0] * (n_steps - 1)),
        graph_size=graph,
        num_preempted=np.array([0, 0, 0, 1] + [0] * 8),
        num_swapped_in=np.array([0] * 6 + [1] + [0] * 5),
    )
    seg_rows = []
    for s in range(n_steps):
        if s == 0:
            seg_rows.append((s, 2, t0[s], t0[s] + 0.003))  # prefill
        seg_rows.append((s, 3, t0[s] + 0.003, t1[s] - 0.001))  # decode
        if s % 4 == 1:
            seg_rows.append((s, 0, t1[s] - 0.001, t1[s]))  # tok
        if s == 5:
            seg_rows.append((s, 4, t0[s], t0[s] + 0.001))  # schedule (engine label)
    sg = np.array(seg_rows, dtype=np.float64)
    segments = Segments(
        step=sg[:, 0].astype(np.int64),
        label=sg[:, 1].astype(np.int64),
        t_start_s=sg[:, 2],
        t_end_s=sg[:, 3],
        thread=np.zeros(len(sg), np.int64),
        is_device=np.zeros(len(sg), np.int8),
    )
    em = []
    for s in range(n_steps):
        for r in range(3):
            if r == 1 and 3 <= s <= 5:  # request 1 evicted at step 3, back at step 6
                continue
            em.append((r, t1[s] - 0.0005, s))
    e = np.array(em, dtype=np.float64)
    emissions = Emissions(
        request=e[:, 0].astype(np.int64),
        t_s=e[:, 1],
        step=e[:, 2].astype(np.int64),
        num_tokens=np.ones(len(e), np.int64),
    )
    return RawLog(
        steps=steps,
        segments=segments,
        gc_pauses=GcPauses(np.array([0.0405]), np.array([0.0425]), np.array([0])),
        emissions=emissions,
        evictions=Evictions(
            request=np.array([1]),
            t_evict_s=np.array([0.031]),
            t_readmit_s=np.array([0.061]),
            mode=np.array([0]),
        ),
        requests=Requests(
            arrival_s=np.array([-0.002, -0.001, 0.0]),
            prompt_tokens=np.array([100, 200, 300]),
            max_new_tokens=np.array([50, 50, 50]),
            first_token_s=np.array([t1[0] - 0.0005] * 3),
        ),
        counters=Counters(
            name=np.array([0, 0, 1]), t_s=np.array([0.0, 0.05, 0.1]), value=np.array([3, 2, 3.0])
        ),
        labels=("tok", "swap", "prefill", "decode", "schedule"),
        request_ids=("req-a", "req-b", "req-c"),
        counter_names=("batch", "free_blocks"),
        # TTFT tables: all three admitted at 0 (after arrival, before the first token),
        # prompts prefilled in step 0; request 2 had waited for KV in step 0's decision
        admissions=Admissions.from_columns(request=[0, 1, 2], t_s=[0.0, 0.0, 0.0]),
        prefill_chunks=PrefillChunks.from_columns(
            step=[0, 0, 0], request=[0, 1, 2], num_tokens=[100, 200, 300]
        ),
        waits=Waits.from_columns(step=[0], request=[2], reason=[0]),
        # OS evidence: the loop thread at every step's start and end (2 ms run-queue wait
        # in step 4, 1 ms blocked in step 7)
        os_samples=_os_samples(t0, t1),
        # coverage: the one process from its start to its clean stop at the wall time
        coverage=Coverage.from_columns(
            process=[0], t_start_s=[0.0], t_end_s=[0.125], is_clean_stop=[1]
        ),  # fmt: skip
        # the eviction's cause: request 2 needed the blocks (KV full), request 1 lost its
        # 203 computed tokens (prompt and 3 decoded), no block free of 12
        preemptions=Preemptions.from_columns(
            step=[3],
            request=[1],
            t_s=[0.031],
            reason=[0],
            num_computed_tokens_lost=[203],
            num_free_blocks=[0],
            num_used_blocks=[12],
        ),  # fmt: skip
        evictors=Evictors.from_columns(request=[1], t_s=[0.031], evictor=[2]),
        config={"rung": "baseline", "seed": 1, "engine": {"max_batch": 16}},
        wall_s=0.125,
        meta={"source": "tracekit", "clock": "fake"},
    )


def _os_samples(t0: np.ndarray, t1: np.ndarray) -> OsSamples:
    rows = []
    cpu = runq = 0
    for s, (a, b) in enumerate(zip(t0.tolist(), t1.tolist(), strict=True)):
        rows.append((0, 0, a, cpu, runq, s, s, 0))
        wait = 2_000_000 if s == 4 else 0
        blocked = 1_000_000 if s == 7 else 0
        runq += wait
        cpu += round((b - a) * 1e9) - wait - blocked
        rows.append((0, 1, b, cpu, runq, s + 1, s, 0))
    return OsSamples.from_rows(np.array(rows, dtype=np.float64))


def v1_arrays() -> dict[str, np.ndarray]:
    """The arrays `RawLog.save` writes for `base_log()` (through the real writer)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = base_log().save(Path(d) / "base.npz")
        with np.load(p, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}


def published_arrays() -> dict[str, np.ndarray]:
    """The published layout for a run like `base_log()`; request ids are not 0..n-1."""
    log = base_log()
    ids = np.array([1007.0, 1003.0, 1011.0])  # arbitrary, unsorted: ids are looked up
    st = log.steps
    steps = np.column_stack(
        [st.t_start_s, st.t_end_s, st.num_decode, st.num_prefill_tokens, st.graph_size,
         st.num_preempted, st.num_swapped_in]
    ).astype(np.float64)  # fmt: skip
    sg = log.segments
    keep = sg.label <= 3  # the published layout has four codes only
    segs = np.column_stack([sg.step, sg.label, sg.t_start_s, sg.t_end_s])[keep]
    em = log.emissions
    rq = log.requests
    return {
        "steps": steps,
        "segs": segs.astype(np.float64),
        "gcs": np.array([[0.0405, 0.0425, 0.0]]),
        "emissions": np.column_stack([ids[em.request], em.t_s, em.step]).astype(np.float64),
        "evictions": np.array([[ids[1], 0.031, 0.061]]),
        "requests": np.column_stack(
            [ids, rq.arrival_s, rq.prompt_tokens, rq.max_new_tokens, rq.first_token_s]
        ).astype(np.float64),
        "trace": np.column_stack([ids, rq.arrival_s, [400, 800, 1200], [50, 50, 50]]),
        "wall": np.array(0.125),
        "config": np.array(json.dumps({"rung": "baseline", "seed": 1, "rate": 4.0})),
    }


def npz_bytes(arrays: dict[str, np.ndarray], *, compressed: bool = False) -> bytes:
    """What `np.savez` (or `savez_compressed`) writes, with fixed member timestamps so the
    corpus is the same bytes on every run."""
    buf = io.BytesIO()
    method = zipfile.ZIP_DEFLATED if compressed else zipfile.ZIP_STORED
    with zipfile.ZipFile(buf, "w") as zf:
        for k, a in arrays.items():
            _add(zf, k + ".npy", _npy(np.asanyarray(a)), method)
    return buf.getvalue()


def _add(zf: zipfile.ZipFile, name: str, data: bytes, method: int = zipfile.ZIP_STORED) -> None:
    info = zipfile.ZipInfo(name, date_time=(2024, 6, 7, 0, 0, 0))
    info.compress_type = method
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Duplicate name": one case wants exactly that
        zf.writestr(info, data)


def object_npy(obj: object) -> bytes:
    """A .npy member holding a pickled object array (written with pickling allowed)."""
    buf = io.BytesIO()
    a = np.empty(1, dtype=object)
    a[0] = obj
    np.lib.format.write_array(buf, a, allow_pickle=True)
    return buf.getvalue()


def zip_with(arrays: dict[str, np.ndarray], extra: dict[str, bytes]) -> bytes:
    """An npz of `arrays` plus raw members (name -> bytes) added as they are."""
    buf = io.BytesIO(npz_bytes(arrays))
    with zipfile.ZipFile(buf, "a") as zf:
        for name, data in extra.items():
            _add(zf, name, data)
    return buf.getvalue()


def deflated_zeros_npz(
    arrays: dict[str, np.ndarray], zeros: dict[str, tuple[np.dtype, tuple[int, ...]]]
) -> bytes:
    """An npz of `arrays` plus, deflated at level 9, members of all-zero arrays (name ->
    dtype, shape) written in 1 MiB chunks: a few hundred KB on disk that inflate to
    hundreds of MB, never held whole in memory here."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for k, a in arrays.items():
            if k not in zeros:
                _add(zf, k + ".npy", _npy(np.asanyarray(a)))
        for k, (dtype, shape) in zeros.items():
            info = zipfile.ZipInfo(k + ".npy", date_time=(2024, 6, 7, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info._compresslevel = 9  # type: ignore[attr-defined]  # ZipInfo has no public knob
            header = io.BytesIO()
            np.lib.format.write_array_header_1_0(
                header, {"descr": np.dtype(dtype).str, "fortran_order": False, "shape": shape}
            )
            left = math.prod(shape) * np.dtype(dtype).itemsize
            with zf.open(info, "w") as fh:
                fh.write(header.getvalue())
                chunk = bytes(1 << 20)
                while left > 0:
                    fh.write(chunk[: min(left, len(chunk))])
                    left -= len(chunk)
    return buf.getvalue()


@functools.lru_cache(maxsize=1)
def bomb_cases() -> tuple[Case, ...]:
    """Archives whose members claim far more than the file holds (built once: ~1 s).

    Each claims over 256 MiB, the default inflate limit's floor (64x the file is far less
    here), so each is refused before any member is inflated: the message says by how much
    and how to raise the limit."""
    v1 = v1_arrays()
    pub = published_arrays()
    n = 5_000_000  # 7 step columns of 5M rows x 8 bytes = 280 MB
    return (
        Case(
            "deflate bomb in an unused extra.* member",
            "reject",
            deflated_zeros_npz(v1, {"extra.bomb": (np.dtype(np.float64), (36_000_000,))}),
            "--max-inflate-mb",
        ),
        Case(
            "zero-filled step columns claiming 280 MB",
            "reject",
            deflated_zeros_npz(
                v1, {f"steps.{c}": (np.dtype(dt), (n,)) for c, dt in Steps.DTYPES.items()}
            ),
            "would inflate to",
        ),
        Case(
            "published steps zero-filled claiming 280 MB",
            "reject",
            deflated_zeros_npz(pub, {"steps": (np.dtype(np.float64), (n, 7))}),
            "would inflate to",
        ),
    )


# -- array-level mutations ---------------------------------------------------------------

V1_TIME_COLS = {
    # column -> may it be NaN (not recorded)?
    "steps.t_start_s": False,
    "steps.t_end_s": False,
    "segments.t_start_s": False,
    "segments.t_end_s": False,
    "gc_pauses.t_start_s": False,
    "gc_pauses.t_end_s": False,
    "emissions.t_s": False,
    "evictions.t_evict_s": False,
    "evictions.t_readmit_s": True,
    "requests.arrival_s": True,
    "requests.first_token_s": True,
    "counters.t_s": False,
    "admissions.t_s": False,
    "os_samples.t_s": False,
    "coverage.t_start_s": False,
    "coverage.t_end_s": False,
    "preemptions.t_s": False,
    "evictors.t_s": False,
}
V1_INDEX_COLS = {  # column -> lowest valid value
    "segments.label": 0,
    "segments.step": -1,
    "emissions.request": 0,
    "emissions.step": -1,
    "evictions.request": 0,
    "counters.name": 0,
    "admissions.request": 0,
    "prefill_chunks.step": 0,
    "prefill_chunks.request": 0,
    "waits.step": 0,
    "waits.request": 0,
    "waits.reason": 0,
    "os_samples.kind": 0,
    "coverage.process": 0,
    "preemptions.step": -1,
    "preemptions.request": 0,
    "preemptions.reason": 0,
    "evictors.request": 0,
    "evictors.evictor": 0,
}
V1_COUNT_COLS = {  # column -> lowest valid value
    "steps.num_decode": 0,
    "steps.num_prefill_tokens": 0,
    "steps.num_preempted": 0,
    "steps.num_swapped_in": 0,
    "steps.graph_size": -1,
    "emissions.num_tokens": 1,
    "gc_pauses.generation": 0,
    "prefill_chunks.num_tokens": 0,
    "os_samples.thread": 0,
    "os_samples.cpu_ns": -1,  # -1: not available
    "os_samples.runqueue_ns": -1,
    "os_samples.num_voluntary_switches": -1,
    "os_samples.num_involuntary_switches": -1,
    "os_samples.num_major_faults": -1,
    "coverage.is_clean_stop": 0,
    "preemptions.num_computed_tokens_lost": -1,  # -1: not told
    "preemptions.num_free_blocks": -1,
    "preemptions.num_used_blocks": -1,
}
#: Columns of ns totals: 2**40 ns (18 minutes of CPU) is a measurement, not absurd.
NS_COLS = frozenset({"os_samples.cpu_ns", "os_samples.runqueue_ns"})
V1_REQUIRED = (
    ["schema", "schema_version", "wall_s"]
    + [k for k in list(V1_TIME_COLS) + list(V1_INDEX_COLS) + list(V1_COUNT_COLS)
       if not k.startswith("counters.")]
    + ["segments.thread", "segments.is_device", "evictions.mode", "requests.prompt_tokens",
       "requests.max_new_tokens"]
)  # fmt: skip


def _with(arrays: dict[str, np.ndarray], **changes: np.ndarray | None) -> dict[str, np.ndarray]:
    out = dict(arrays)
    for k, v in changes.items():
        k = k.replace("__", ".")
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def _rows(arrays: dict[str, np.ndarray], table: str, idx) -> dict[str, np.ndarray]:
    """Changes (for `_with`) that keep rows `idx` of every column of `table`, in that order."""
    p = table + "." if table else ""
    return {k.replace(".", "__"): arrays[k][idx] for k in arrays if k.startswith(p) and "." in k}


def _set(a: np.ndarray, i: int, v: float) -> np.ndarray:
    a = a.astype(np.float64 if isinstance(v, float) else a.dtype, copy=True)
    a[i] = v
    return a


def _column_cases(base: dict[str, np.ndarray], rng: np.random.Generator) -> Iterator[Case]:
    """Every v1 column: missing, wrong shape, wrong dtype, non-finite, absurd."""
    for key in sorted(k for k in base if "." in k):
        a = base[key]
        n = len(a)
        i = int(rng.integers(n))
        required = key in V1_REQUIRED or key.startswith("counters.")
        if required:
            yield Case(f"v1 {key} missing", "reject", npz_bytes(_with(base, **{key: None})), key)
        yield Case(f"v1 {key} 2-D", "reject", npz_bytes({**base, key: a.reshape(-1, 1)}), key)
        yield Case(f"v1 {key} scalar", "reject", npz_bytes({**base, key: a[0]}), key)
        yield Case(f"v1 {key} one row short", "reject", npz_bytes({**base, key: a[:-1]}), "length")
        yield Case(f"v1 {key} as strings", "reject", npz_bytes({**base, key: a.astype(str)}), key)
        yield Case(
            f"v1 {key} complex", "reject", npz_bytes({**base, key: a.astype(np.complex128)}), key
        )
        yield Case(
            f"v1 {key} datetimes",
            "reject",
            npz_bytes({**base, key: np.zeros(n, "datetime64[s]")}),
            key,
        )
        yield Case(
            f"v1 {key} pickled objects",
            "reject",
            zip_with(_with(base, **{key: None}), {key + ".npy": object_npy(Pickled())}),
            "pickle",
        )
        yield Case(
            f"v1 {key} big-endian",
            "ok",
            npz_bytes({**base, key: a.astype(a.dtype.newbyteorder(">"))}),
        )
        if key == "counters.value":  # a sampled value: any float, NaN included
            for v in (math.nan, math.inf, -1e300):
                yield Case(f"v1 {key} = {v}", "ok", npz_bytes({**base, key: _set(a, i, v)}))
        elif key in V1_TIME_COLS:
            nan_ok = V1_TIME_COLS[key]
            yield Case(
                f"v1 {key} NaN row {i}",
                "ok" if nan_ok else "reject",
                npz_bytes({**base, key: _set(a, i, math.nan)}),
                "" if nan_ok else "non-finite",
            )
            for v in (math.inf, -math.inf):
                yield Case(
                    f"v1 {key} {v} row {i}",
                    "reject",
                    npz_bytes({**base, key: _set(a, i, v)}),
                    "non-finite",
                )
            for v in (1e300, -1e300, 1e8, 5e307):
                yield Case(
                    f"v1 {key} absurd {v}",
                    "reject",
                    npz_bytes({**base, key: _set(a, i, v)}),
                    "absurd",
                )
            yield Case(
                f"v1 {key} as float32", "any", npz_bytes({**base, key: a.astype(np.float32)})
            )
        else:
            lo = V1_INDEX_COLS.get(key, V1_COUNT_COLS.get(key))
            info = np.iinfo(np.int64)
            bad_values = [info.max, info.min] + ([] if key in NS_COLS else [2**40])
            if lo is not None:
                bad_values += [lo - 1, lo - 1000]
            if key in V1_INDEX_COLS:
                bad_values.append(int(a.max()) + 1000)
            if key in ("segments.is_device",):
                bad_values += [2, 256, -1]
            if key in ("evictions.mode",):
                bad_values += [7, -5]
            if key == "gc_pauses.generation":
                bad_values += [3, 10**12]
            if key == "os_samples.kind":
                bad_values += [4]
            for v in bad_values:
                b = a.astype(np.int64, copy=True)
                b[i] = v
                yield Case(f"v1 {key} = {v}", "reject", npz_bytes({**base, key: b}), key)
            for v in (math.nan, math.inf, 0.5, 1e19, -1e19, 1e300):
                yield Case(
                    f"v1 {key} float {v}",
                    "reject",
                    npz_bytes({**base, key: _set(a.astype(np.float64), i, v)}),
                    key,
                )
            yield Case(
                f"v1 {key} integral floats", "ok", npz_bytes({**base, key: a.astype(np.float64)})
            )
            yield Case(f"v1 {key} as int32", "ok", npz_bytes({**base, key: a.astype(np.int32)}))
            yield Case(f"v1 {key} as uint64", "any", npz_bytes({**base, key: a.astype(np.uint64)}))


def _v1_scalar_cases(base: dict[str, np.ndarray]) -> Iterator[Case]:
    def c(name: str, expect: str, needle: str = "", **changes):
        return Case(f"v1 {name}", expect, npz_bytes(_with(base, **changes)), needle)

    yield c("schema missing", "reject", "schema", schema=None)
    yield c("schema is another format", "reject", "schema", schema=np.array("other.format"))
    yield c("schema as bytes", "reject", "schema", schema=np.array(b"tracekit.rawlog"))
    yield c("schema as int", "reject", "schema", schema=np.array(1))
    yield c("schema as list", "reject", "schema", schema=np.array(["tracekit.rawlog"]))
    yield c("schema is empty", "reject", "schema", schema=np.array(""))
    for v in (0, 6, 99, -1, 2**62):
        yield c(f"schema_version {v}", "reject", "schema_version", schema_version=np.array(v))
    yield c("schema_version missing", "reject", "schema_version", schema_version=None)
    yield c("schema_version float", "reject", "schema_version", schema_version=np.array(1.5))
    yield c("schema_version string", "reject", "schema_version", schema_version=np.array("1"))
    yield c("schema_version array", "reject", "schema_version", schema_version=np.array([1]))
    for v in (math.nan, math.inf, -1.0, 1e300, 5e7):
        yield c(f"wall_s {v}", "reject", "wall_s", wall_s=np.array(v))
    yield c("wall_s missing", "reject", "wall_s", wall_s=None)
    yield c("wall_s string", "reject", "wall_s", wall_s=np.array("1.0"))
    yield c("wall_s 2 values", "reject", "wall_s", wall_s=np.array([1.0, 2.0]))
    yield c("wall_s zero", "ok", wall_s=np.array(0.0))
    yield c("wall_s int", "ok", wall_s=np.array(1))
    # string vocabularies
    yield c("labels missing", "reject", "segments.label", labels=None)
    yield c("labels as ints", "reject", "labels", labels=np.arange(5))
    yield c("labels 2-D", "reject", "labels", labels=base["labels"].reshape(1, -1))
    yield c("labels scalar", "reject", "labels", labels=np.array("tok"))
    yield c("labels one short", "reject", "segments.label", labels=base["labels"][:-1])
    yield c("labels duplicated", "ok", labels=np.array(["tok", "swap", "prefill", "decode", "tok"]))
    yield c("labels empty strings", "ok", labels=np.array(["tok", "swap", "prefill", "decode", ""]))
    yield c("request_ids missing", "ok", request_ids=None)
    yield c("request_ids one short", "reject", "request_ids", request_ids=base["request_ids"][:2])
    yield c(
        "request_ids duplicated", "reject", "request_ids", request_ids=np.array(["a", "a", "b"])
    )
    yield c("request_ids as ints", "reject", "request_ids", request_ids=np.arange(3))
    # names beyond the name limit (1000 characters) are shortened, with a warning
    huge = "X" * 20_000
    yield c("a 20,000-character label", "ok", "labels: names longer than 1000",
            labels=np.array(["tok", "swap", "prefill", "decode", huge]))  # fmt: skip
    yield c("a 20,000-character request id", "ok", "request_ids: names longer than 1000",
            request_ids=np.array(["req-a", huge, "req-b"]))  # fmt: skip
    yield c("40 more labels than segments use", "ok",
            labels=np.array(["tok", "swap", "prefill", "decode", "schedule"]
                            + [f"lab{i:02d}" for i in range(40)]))  # fmt: skip
    yield c("counter_names missing", "reject", "counters.name", counter_names=None)
    yield c("counter_names as floats", "reject", "counter_names", counter_names=np.zeros(2))
    # JSON fields
    for key in ("config", "meta", "cause_map"):
        yield c(f"{key} missing", "ok", **{key: None})
        yield c(f"{key} not JSON", "reject", key, **{key: np.array("{rung: baseline")})
        yield c(f"{key} JSON list", "reject", key, **{key: np.array("[1, 2]")})
        yield c(f"{key} JSON null", "reject", key, **{key: np.array("null")})
        yield c(f"{key} as bytes", "reject", key, **{key: np.array(b"{}")})
        yield c(f"{key} as number", "reject", key, **{key: np.array(3.0)})
        yield c(f"{key} array of strings", "reject", key, **{key: np.array(["{}", "{}"])})
        yield c(f"{key} empty string", "reject", key, **{key: np.array("")})
        yield c(
            f"{key} deeply nested",
            "reject",
            key,
            **{key: np.array('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")},
        )
        yield c(
            f"{key} 5000-digit int", "reject", key, **{key: np.array('{"a": ' + "9" * 5000 + "}")}
        )
        yield Case(
            f"v1 {key} pickled",
            "reject",
            zip_with(_with(base, **{key: None}), {key + ".npy": object_npy(Pickled())}),
            "pickle",
        )
    yield c("config NaN and Infinity", "ok", config=np.array('{"rate": NaN, "cap": Infinity}'))
    yield c("config huge", "ok", config=np.array(json.dumps({f"k{i}": i for i in range(20_000)})))
    yield c("cause_map values not strings", "reject", "cause_map", cause_map=np.array('{"tok": 1}'))
    for target in ("forward", "residual", "graph", "gc", "decode", "preempt", "", "\n"):
        yield c(
            f"cause_map schedule -> {target!r}",
            "ok",
            cause_map=np.array(json.dumps({"schedule": target, "swap": "preempt"})),
        )
    yield c(
        "cause_map everything -> decode",
        "ok",
        cause_map=np.array(
            json.dumps({k: "decode" for k in ("tok", "swap", "prefill", "schedule")})
        ),
    )


def _v1_semantic_cases(base: dict[str, np.ndarray]) -> Iterator[Case]:
    """Valid arrays, odd or impossible runs."""

    def c(name: str, expect: str, needle: str = "", **changes):
        return Case(f"v1 {name}", expect, npz_bytes(_with(base, **changes)), needle)

    st0, st1 = base["steps.t_start_s"], base["steps.t_end_s"]
    sg0, sg1 = base["segments.t_start_s"], base["segments.t_end_s"]
    for i in (0, 3, len(st0) - 1):
        yield c(f"step {i} reversed", "reject", "before it starts",
                steps__t_start_s=_set(st0, i, st1[i] + 0.001))  # fmt: skip
        yield c(f"step {i} zero-length", "ok", steps__t_start_s=_set(st0, i, st1[i]))
    for i in (0, 5, len(sg0) - 1):
        yield c(f"segment {i} reversed", "reject", "before it starts",
                segments__t_end_s=_set(sg1, i, sg0[i] - 0.001))  # fmt: skip
        yield c(f"segment {i} zero-length", "ok", segments__t_end_s=_set(sg1, i, sg0[i]))
    yield c("gc reversed", "reject", "before it starts",
            gc_pauses__t_end_s=np.array([0.0400]))  # fmt: skip
    yield c("gc zero-length", "ok", gc_pauses__t_end_s=np.array([0.0405]))
    yield c(
        "gc pauses overlap",
        "ok",
        "overlapping GC",
        gc_pauses__t_start_s=np.array([0.0405, 0.041, 0.020]),
        gc_pauses__t_end_s=np.array([0.0425, 0.043, 0.0201]),
        gc_pauses__generation=np.array([0, 1, 2]),
    )
    yield c(
        "gc pause nested in another",
        "ok",
        "overlapping GC",
        gc_pauses__t_start_s=np.array([0.040, 0.041]),
        gc_pauses__t_end_s=np.array([0.050, 0.042]),
        gc_pauses__generation=np.array([2, 0]),
    )
    yield c(
        "gc pause covers the whole run",
        "ok",
        gc_pauses__t_start_s=np.array([-1.0]),
        gc_pauses__t_end_s=np.array([10.0]),
    )
    em_t = base["emissions.t_s"]
    rng = np.random.default_rng(SEED)
    yield c(
        "emissions reversed", "ok", "time order", **_rows(base, "emissions", slice(None, None, -1))
    )
    yield c(
        "emissions shuffled",
        "ok",
        "time order",
        **_rows(base, "emissions", rng.permutation(len(em_t))),
    )
    yield c("steps shuffled", "ok", **_rows(base, "steps", rng.permutation(len(st0))))
    yield c("segments shuffled", "ok", **_rows(base, "segments", rng.permutation(len(sg0))))
    yield c("emissions all at one time", "ok", emissions__t_s=np.full(len(em_t), 0.05))
    yield c("emission of an unknown request", "reject", "emissions.request",
            emissions__request=_set(base["emissions.request"], 4, 3))  # fmt: skip
    yield c("emission of a negative request", "reject", "emissions.request",
            emissions__request=_set(base["emissions.request"], 4, -1))  # fmt: skip
    yield c("emission at an unknown step", "reject", "emissions.step",
            emissions__step=_set(base["emissions.step"], 4, 12))  # fmt: skip
    yield c("emission outside any step", "ok", emissions__step=_set(base["emissions.step"], 4, -1))
    # a first emission before arrival reverses the TTFT window: rejected where the log has
    # TTFT events (docs/ttft.md), a warning without them
    yield c("emission before its request arrived", "reject", "requests.first_token_s",
            requests__arrival_s=np.array([0.5, 0.5, 0.5]))  # fmt: skip
    yield c("emission before arrival, no TTFT events", "ok", "before their request",
            requests__arrival_s=np.array([0.5, 0.5, 0.5]),
            **{k.replace(".", "__"): None for k in base
               if k.split(".")[0] in ("admissions", "prefill_chunks", "waits")})  # fmt: skip
    yield c("admission before arrival", "reject", "admissions.t_s",
            admissions__t_s=np.array([-0.01, 0.0, 0.0]))  # fmt: skip
    yield c("admission after the first token", "reject", "admissions.t_s",
            admissions__t_s=np.array([0.0, 0.05, 0.0]))  # fmt: skip
    yield c("admission before the engine core added it", "reject", "admissions.t_s",
            requests__engine_s=np.array([0.001, -0.001, 0.0]))  # fmt: skip
    yield c("engine core adds before each admission", "ok",
            requests__engine_s=np.array([0.0, -0.001, math.nan]))  # fmt: skip
    yield c("request admitted twice", "reject", "admissions.request",
            admissions__request=np.array([0, 1, 1]))  # fmt: skip
    yield c("prefill row for an unknown request", "reject", "prefill_chunks.request",
            prefill_chunks__request=np.array([0, 1, 3]))  # fmt: skip
    yield c("two wait reasons for one request in a step", "reject", "waits.request",
            waits__step=np.array([0, 0]), waits__request=np.array([2, 2]),
            waits__reason=np.array([0, 1]))  # fmt: skip
    yield c("evicted before its admission", "reject", "evictions.t_evict_s",
            admissions__t_s=np.array([0.0, 0.0075, 0.0]),
            evictions__t_evict_s=np.array([0.005]),
            evictions__t_readmit_s=np.array([0.061]))  # fmt: skip
    yield c("no TTFT tables (a version-1 log)", "ok", schema_version=np.array(1),
            **{k.replace(".", "__"): None for k in base
               if k.split(".")[0] in ("admissions", "prefill_chunks", "waits")})  # fmt: skip
    yield c("no coverage table (a version-3 log: coverage unknown)", "ok",
            schema_version=np.array(3),
            **{k.replace(".", "__"): None for k in base if k.startswith("coverage.")})  # fmt: skip
    no_rows = {k.replace(".", "__"): base[k][:0] for k in base if k.startswith("coverage.")}
    yield c("empty coverage (coverage unknown)", "ok", **no_rows)
    yield c("coverage ends before it starts", "reject", "coverage.t_end_s",
            coverage__t_end_s=np.array([-0.5]))  # fmt: skip
    yield c("coverage of a process the log does not have", "reject", "coverage.process",
            coverage__process=np.array([1]))  # fmt: skip
    yield c("coverage with two rows for one process", "reject", "coverage.process",
            coverage__process=np.array([0, 0]), coverage__t_start_s=np.array([0.0, 0.0]),
            coverage__t_end_s=np.array([0.1, 0.125]),
            coverage__is_clean_stop=np.array([1, 1]))  # fmt: skip
    yield c("coverage clean-stop flag 2", "reject", "coverage.is_clean_stop",
            coverage__is_clean_stop=np.array([2]))  # fmt: skip
    # an API server's OS intervals (a merged run's proc_os): two valid rows, then each rule
    po = {"proc_os__process": np.array([0, 0]), "proc_os__t_start_s": np.array([0.01, 0.03]),
          "proc_os__t_end_s": np.array([0.02, 0.04]),
          "proc_os__runqueue_s": np.array([0.002, 0.0]),
          "proc_os__offcpu_s": np.array([0.001, 0.01]),
          "proc_os__in_segment": np.array([1, 0])}  # fmt: skip
    yield c("proc_os: two intervals of one API server", "ok", **po)
    yield c("proc_os: an interval ends before it starts", "reject", "proc_os.t_end_s",
            **{**po, "proc_os__t_end_s": np.array([0.005, 0.04])})  # fmt: skip
    yield c("proc_os: overlapping intervals of one process", "reject", "proc_os.t_start_s",
            **{**po, "proc_os__t_start_s": np.array([0.01, 0.015]),
               "proc_os__runqueue_s": np.array([0.002, 0.0]),
               "proc_os__offcpu_s": np.array([0.001, 0.001])})  # fmt: skip
    yield c("proc_os: shares exceed the interval", "reject", "proc_os.offcpu_s",
            **{**po, "proc_os__offcpu_s": np.array([0.009, 0.01])})  # fmt: skip
    yield c("proc_os: a negative share", "reject", "proc_os.runqueue_s",
            **{**po, "proc_os__runqueue_s": np.array([-0.001, 0.0])})  # fmt: skip
    yield c("proc_os: a NaN share", "reject", "proc_os.offcpu_s",
            **{**po, "proc_os__offcpu_s": np.array([math.nan, 0.0])})  # fmt: skip
    yield c("proc_os: a process the log does not have", "reject", "proc_os.process",
            **{**po, "proc_os__process": np.array([0, 3])})  # fmt: skip
    yield c("proc_os: in_segment 2", "reject", "proc_os.in_segment",
            **{**po, "proc_os__in_segment": np.array([2, 0])})  # fmt: skip
    yield c("proc_os: a column missing", "reject", "proc_os.offcpu_s",
            **{**po, "proc_os__offcpu_s": None})  # fmt: skip
    yield c("eviction never readmitted", "ok", "never readmitted",
            evictions__t_readmit_s=np.array([math.nan]))  # fmt: skip
    yield c("readmission before eviction", "reject", "readmitted before",
            evictions__t_readmit_s=np.array([0.02]))  # fmt: skip
    yield c("zero-length eviction", "ok", evictions__t_readmit_s=np.array([0.031]))
    yield c("eviction of an unknown request", "reject", "evictions.request",
            evictions__request=np.array([7]))  # fmt: skip
    yield c(
        "evictions overlap",
        "ok",
        "overlapping evictions",
        evictions__request=np.array([1, 1]),
        evictions__t_evict_s=np.array([0.031, 0.035]),
        evictions__t_readmit_s=np.array([0.061, math.nan]),
        evictions__mode=np.array([0, 1]),
    )
    yield c(
        "many evictions never readmitted",
        "ok",
        "never readmitted",
        evictions__request=np.array([0, 1, 2, 0]),
        evictions__t_evict_s=np.array([0.0, 0.031, 0.05, 0.09]),
        evictions__t_readmit_s=np.full(4, math.nan),
        evictions__mode=np.array([0, 1, -1, 0]),
    )
    yield c("segments outside any step", "ok", segments__step=np.full(len(sg0), -1))
    yield c("segments on other threads", "ok", segments__thread=np.arange(len(sg0)))
    yield c("all segments device time", "ok", segments__is_device=np.ones(len(sg0), np.int8))
    yield c(
        "every step eager",
        "ok",
        "no captured steps",
        steps__graph_size=np.zeros(len(st0), np.int64),
    )
    yield c("no step decodes", "ok", steps__graph_size=np.full(len(st0), -1),
            steps__num_decode=np.zeros(len(st0), np.int64))  # fmt: skip
    yield c("huge but plausible counts", "ok",
            steps__num_prefill_tokens=np.full(len(st0), 2_000_000),
            steps__graph_size=np.full(len(st0), 4096))  # fmt: skip
    yield c("many tokens per emission", "ok",
            emissions__num_tokens=np.full(len(em_t), 1000))  # fmt: skip
    times = [k.replace(".", "__") for k in V1_TIME_COLS]
    yield c("times negative (before engine start)", "ok",
            **{k: base[k.replace("__", ".")] - 5.0 for k in times})  # fmt: skip
    yield c("times near the absurd limit", "ok",
            **{k: base[k.replace("__", ".")] + 9.0e6 for k in times})  # fmt: skip
    # empty runs
    no_ids = np.array([], dtype=str)
    yield c("empty run", "ok", "no emissions", request_ids=no_ids, **_rows(base, "", slice(0)))
    yield c("no emissions", "ok", "no emissions", **_rows(base, "emissions", slice(0)))
    yield c("no requests but emissions", "reject", "emissions.request",
            request_ids=no_ids, **_rows(base, "requests", slice(0)))  # fmt: skip
    yield c("no steps but segments", "reject", "segments.step", **_rows(base, "steps", slice(0)))
    yield c("one emission", "ok", "no gaps", **_rows(base, "emissions", slice(0, 1)))
    yield c("no counters", "ok", **{k: None for k in _rows(base, "counters", slice(0))})
    yield c("no emissions.device_step (older v1 logs)", "ok", emissions__device_step=None)
    # hostile strings (must come out of JSON output intact)
    yield c("hostile labels", "ok", labels=np.array(["tok", "swap", "prefill", "decode", HOSTILE]))
    yield c(
        "hostile request ids", "ok", request_ids=np.array(['a"b', "c\nd", "\u00e9\u2603\U0001f600"])
    )
    yield c(
        "lone surrogate label",
        "any",
        labels=np.array(["tok", "swap", "prefill", "decode", "\ud800"]),
    )
    yield c("hostile config", "ok", config=np.array(json.dumps(
        {"rung": "</script>\n\"'", "seed": "__import__('os').system('false')",
         "x": {"__reduce__": "os.system"}}
    )))  # fmt: skip


def _published_cases(base: dict[str, np.ndarray], rng: np.random.Generator) -> Iterator[Case]:
    def c(name: str, expect: str, needle: str = "", **changes):
        return Case(f"published {name}", expect, npz_bytes(_with(base, **changes)), needle)

    yield c("as is", "ok")
    yield Case("published compressed", "ok", npz_bytes(base, compressed=True))
    for key in ("steps", "segs", "gcs", "emissions", "evictions", "requests"):
        a = base[key]
        ncol = a.shape[1]
        i = int(rng.integers(len(a)))
        yield c(f"{key} missing", "reject", key, **{key: None})
        yield c(f"{key} 1-D", "reject", key, **{key: a.reshape(-1)})
        yield c(f"{key} 3-D", "reject", key, **{key: a.reshape(1, *a.shape)})
        yield c(f"{key} one column short", "reject", key, **{key: a[:, :-1]})
        yield c(f"{key} one column extra", "reject", key, **{key: np.column_stack([a, a[:, :1]])})
        if a.shape[0] != ncol:
            yield c(f"{key} transposed", "reject", key, **{key: a.T.copy()})
        yield c(f"{key} as strings", "reject", key, **{key: a.astype(str)})
        yield c(f"{key} as complex", "reject", key, **{key: a.astype(complex)})
        yield c(f"{key} empty", "any", **{key: np.zeros((0, ncol))})
        yield c(f"{key} empty 1-D", "any", **{key: np.zeros(0)})
        yield c(f"{key} as float32", "any", **{key: a.astype(np.float32)})
        yield c(f"{key} as int", "any", **{key: a.astype(np.int64)})
        yield Case(
            f"published {key} pickled",
            "reject",
            zip_with(_with(base, **{key: None}), {key + ".npy": object_npy(Pickled())}),
            "pickle",
        )
        for j in range(ncol):
            for v in (math.nan, math.inf, -math.inf, 1e300, -1e300, 0.5, 2.0**70):
                b = a.copy()
                b[i, j] = v
                expect = "reject"
                if key == "evictions" and j == 2 and math.isnan(v):
                    expect = "ok"  # never readmitted
                if key == "requests" and j in (1, 4) and math.isnan(v):
                    expect = "ok"  # arrival or first token not recorded
                if v == 0.5 and (
                    (key in ("steps", "segs", "gcs") and j in ((0, 1) if key != "segs" else (2, 3)))
                    or (key == "emissions" and j == 1)
                    or (key == "evictions" and j in (1, 2))
                    or (key == "requests" and j in (1, 4))
                ):
                    expect = "any"  # a time of 0.5 s may be perfectly valid or reversed
                yield c(f"{key}[{i},{j}] = {v}", expect, **{key: b})
    yield c("wall missing", "reject", "wall", wall=None)
    yield c("wall NaN", "reject", "wall", wall=np.array(math.nan))
    yield c("wall negative", "reject", "wall", wall=np.array(-1.0))
    yield c("wall absurd", "reject", "wall", wall=np.array(1e300))
    yield c("wall as string", "reject", "wall", wall=np.array("0.125"))
    yield c("wall as list", "ok", wall=np.array([0.125]))
    yield c("config missing", "ok", config=None)
    yield c("config not JSON", "reject", "config", config=np.array("{{"))
    yield c("config JSON list", "reject", "config", config=np.array("[]"))
    yield c("config nested deep", "reject", "config",
            config=np.array("[" * 50_000 + "]" * 50_000))  # fmt: skip
    yield c("trace missing", "ok", trace=None)
    yield c("trace malformed", "ok", trace=np.array(["x"]))
    yield c("segment code 4", "reject", "segs", segs=_cell(base["segs"], 0, 1, 4.0))
    yield c("segment code -1", "reject", "segs", segs=_cell(base["segs"], 0, 1, -1.0))
    yield c("duplicate request ids", "reject", "duplicate",
            requests=_cell(base["requests"], 1, 0, base["requests"][0, 0]))  # fmt: skip
    yield c("emission of an unknown request", "reject", "unknown request",
            emissions=_cell(base["emissions"], 3, 0, 5.0))  # fmt: skip
    yield c("eviction of an unknown request", "reject", "unknown request",
            evictions=_cell(base["evictions"], 0, 0, 5.0))  # fmt: skip
    yield c("eviction never readmitted", "ok", "never readmitted",
            evictions=_cell(base["evictions"], 0, 2, math.nan))  # fmt: skip
    yield c("readmitted before evicted", "reject", "readmitted before",
            evictions=_cell(base["evictions"], 0, 2, 0.01))  # fmt: skip
    yield c("emissions shuffled", "ok", "time order",
            emissions=base["emissions"][rng.permutation(len(base["emissions"]))])  # fmt: skip
    yield c("gc pauses overlap", "ok", "overlapping GC",
            gcs=np.array([[0.0405, 0.0425, 0], [0.041, 0.050, 2]]))  # fmt: skip
    yield c("gc generation 5", "reject", "generation", gcs=np.array([[0.0405, 0.0425, 5]]))
    yield c("step reversed", "reject", "before it starts", steps=_cell(base["steps"], 2, 0, 1.0))
    none = {k: np.zeros((0, base[k].shape[1])) for k in ("requests", "emissions", "evictions")}
    yield c("no requests, no emissions", "ok", "no emissions", **none)
    empty = {k: np.zeros((0, v.shape[1])) for k, v in base.items() if v.ndim == 2 and k != "trace"}
    yield c("empty run", "ok", "no emissions", **empty)
    yield c("all arrays empty 1-D", "ok", "no emissions", **{k: np.zeros(0) for k in empty})
    yield c("emissions refer to requests but none exist", "reject", "emissions",
            requests=np.zeros((0, 5)))  # fmt: skip
    yield c("only steps", "reject", "segs", **{k: None for k in base if k != "steps"})
    yield c("only segs", "reject", "steps", **{k: None for k in base if k != "segs"})


def _cell(a: np.ndarray, i: int, j: int, v: float) -> np.ndarray:
    b = a.copy()
    b[i, j] = v
    return b


def _archive_cases(v1: dict[str, np.ndarray], pub: dict[str, np.ndarray]) -> Iterator[Case]:
    """Not an npz, or an npz with something wrong in the archive itself."""
    good = npz_bytes(v1)
    yield Case("empty file", "reject", b"", "not a readable")
    yield Case("text named .npz", "reject", b"step,t0,t1\n0,0.0,0.01\n", "not a readable")
    yield Case("JSON named .npz", "reject", json.dumps({"schema": "tracekit.rawlog"}).encode())
    yield Case("HTML named .npz", "reject", b"<html><body>404 Not Found</body></html>\n")
    yield Case("one .npy named .npz", "reject", _npy(np.zeros((3, 7))), "not a readable")
    yield Case("a pickle named .npz", "reject", pickle.dumps(Pickled()), "not a readable")
    yield Case("a pickle of arrays named .npz", "reject", pickle.dumps(v1), "not a readable")
    yield Case("zip magic only", "reject", b"PK\x03\x04", "not a readable")
    yield Case("empty zip", "reject", _zip({}), "not a tracekit log")
    yield Case("zip of text members", "reject", _zip({"steps": b"1,2,3", "segs": b"x"}))
    yield Case("npy then zip (polyglot)", "any", _npy(np.zeros(3)) + good)
    yield Case("junk then zip", "any", b"#!/bin/sh\necho hi\n" + good)
    yield Case("zip then junk", "any", good + b"\x00" * 100)
    yield Case("npz twice", "any", good + good)
    yield Case("gzip named .npz", "reject", _gzip(good), "not a readable")
    yield Case("v1 compressed", "ok", npz_bytes(v1, compressed=True))
    yield Case(
        "zip with an extra text member",
        "ok",
        zip_with(v1, {"README.txt": b"notes about this run\n"}),
        "ignored",
    )
    yield Case(
        "zip with an extra unknown array",
        "ok",
        zip_with(v1, {"mystery.npy": _npy(np.arange(3))}),
        "ignored",
    )
    yield Case(
        "zip with an extra pickle member",
        "ok",
        zip_with(v1, {"payload.npy": object_npy(Pickled())}),
        "ignored",
    )
    yield Case("zip with a directory member", "ok", zip_with(v1, {"sub/": b""}), "ignored")
    yield Case("zip with a nested npz", "ok", zip_with(v1, {"inner.npz": good}), "ignored")
    yield Case(
        "zip with a duplicate member",
        "any",
        zip_with(v1, {"wall_s.npy": _npy(np.array(-1.0))}),
    )
    yield Case(
        "zip member with a newline in its name",
        "any",
        zip_with(v1, {"steps.t_start_s\nTraceback (most recent call last):.npy": b"junk"}),
    )
    yield Case(
        "published with an extra text member",
        "ok",
        zip_with(pub, {"notes.txt": b"hello"}),
        "ignored",
    )
    yield Case(
        "extra.* array pickled",
        "reject",
        zip_with(v1, {"extra.x.npy": object_npy(Pickled())}),
        "pickle",
    )
    yield Case("extra.* array", "ok", zip_with(v1, {"extra.x.npy": _npy(np.arange(3))}))
    yield from bomb_cases()
    # .npy members whose header lies about their size
    for name, arr, hdr_shape in (
        ("steps.t_start_s", v1["steps.t_start_s"], (10**12,)),
        ("steps.t_start_s", v1["steps.t_start_s"], (2**62,)),
        ("steps.t_start_s", v1["steps.t_start_s"], (3,)),
        ("wall_s", np.array(1.0), (10**9, 10**9)),
        ("segments.label", v1["segments.label"], (-1,)),
    ):
        yield Case(
            f"{name} header claims shape {hdr_shape}",
            "reject",
            _replace_member(v1, name, _lying_npy(arr, hdr_shape)),
            name,
        )
    yield Case(
        "steps.t_start_s with a bad npy magic",
        "reject",
        _replace_member(v1, "steps.t_start_s", b"\x93NUMPX" + _npy(v1["steps.t_start_s"])[6:]),
        "steps.t_start_s",
    )
    yield Case(
        "steps.t_start_s npy version 9",
        "reject",
        _replace_member(
            v1,
            "steps.t_start_s",
            _npy(v1["steps.t_start_s"])[:6] + b"\x09\x00" + _npy(v1["steps.t_start_s"])[8:],
        ),
        "steps.t_start_s",
    )
    yield Case(
        "steps.t_start_s structured dtype",
        "reject",
        npz_bytes({**v1, "steps.t_start_s": np.zeros(12, dtype=[("a", "f8"), ("b", "i8")])}),
        "steps.t_start_s",
    )
    yield Case(
        "steps.t_start_s a void dtype",
        "reject",
        npz_bytes({**v1, "steps.t_start_s": np.zeros(12, dtype="V8")}),
        "steps.t_start_s",
    )


def _replace_member(arrays: dict[str, np.ndarray], name: str, data: bytes) -> bytes:
    rest = {k: v for k, v in arrays.items() if k != name}
    return zip_with(rest, {name + ".npy": data})


def _lying_npy(arr: np.ndarray, shape: tuple[int, ...]) -> bytes:
    """A .npy of `arr`'s bytes whose header claims `shape`."""
    buf = io.BytesIO()
    header = {
        "descr": np.lib.format.dtype_to_descr(arr.dtype),
        "fortran_order": False,
        "shape": shape,
    }
    np.lib.format.write_array_header_1_0(buf, header)
    buf.write(arr.tobytes())
    return buf.getvalue()


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def _zip(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for k, v in members.items():
            _add(zf, k, v)
    return buf.getvalue()


def _gzip(data: bytes) -> bytes:
    import gzip

    return gzip.compress(data, mtime=0)


def _byte_cases(name: str, payload: bytes, rng: np.random.Generator, n_trunc: int, n_flip: int):
    """Truncations at spread-out lengths and single-byte flips at random offsets."""
    size = len(payload)
    cuts = sorted({0, 1, 4, 22, size - 1, size - 22, *rng.integers(1, size, n_trunc).tolist()})
    for k in cuts:
        yield Case(f"{name} truncated to {k} of {size} bytes", "reject", payload[:k])
    for j, off in enumerate(rng.integers(0, size, n_flip).tolist()):
        b = bytearray(payload)
        b[off] ^= 1 << int(rng.integers(8))
        yield Case(f"{name} flip {j}: a bit of byte {off}", "any", bytes(b))
    for j, off in enumerate(rng.integers(0, size - 3, n_flip // 4).tolist()):
        b = bytearray(payload)
        b[off : off + 3] = bytes([int(rng.integers(256)), 0xFF, 0xFF])
        yield Case(f"{name} smash {j}: bytes {off}-{off + 2}", "any", bytes(b))


def cases() -> list[Case]:
    """The whole corpus, in a fixed order (>= 1,000 cases)."""
    rng = np.random.default_rng(SEED)
    v1 = v1_arrays()
    pub = published_arrays()
    out: list[Case] = [Case("v1 as is", "ok", npz_bytes(v1))]
    gens: list[Callable[[], Iterator[Case]]] = [
        lambda: _column_cases(v1, rng),
        lambda: _v1_scalar_cases(v1),
        lambda: _v1_semantic_cases(v1),
        lambda: _published_cases(pub, rng),
        lambda: _archive_cases(v1, pub),
        lambda: _byte_cases("v1", npz_bytes(v1), rng, 60, 200),
        lambda: _byte_cases("v1 compressed", npz_bytes(v1, compressed=True), rng, 20, 100),
        lambda: _byte_cases("published", npz_bytes(pub), rng, 30, 100),
    ]
    for g in gens:
        out.extend(c for c in g() if c is not None)
    names = [c.name for c in out]
    dupes = {n for n in names if names.count(n) > 1}
    assert not dupes, f"duplicate case names: {sorted(dupes)[:5]}"
    return out


# -- parts folders (what `tracekit recover` reads) -----------------------------------------


@dataclass(frozen=True)
class PartsCase:
    """A parts folder to write and what `recover` must do with it: ``reject`` (one-line
    `TracekitError` naming `needle`, nothing written) or ``ok`` (a log is written; `needle`,
    if set, is in one of its warnings)."""

    name: str
    expect: str
    meta: bytes
    files: tuple[tuple[str, bytes], ...]  # (name in the folder, contents); "" = a folder
    needle: str = ""

    def write(self, folder: Path) -> Path:
        folder.mkdir()
        (folder / "meta.json").write_bytes(self.meta)
        for name, data in self.files:
            if data == b"":
                (folder / name).mkdir()
            else:
                (folder / name).write_bytes(data)
        return folder


def recorded_chunks() -> tuple[dict, list[dict[str, np.ndarray]]]:
    """A small recorded run as its meta and three flushed chunks (a counting clock, flushes
    where the run asks for them, each delivered before the next: deterministic)."""
    import itertools
    import time

    from tracekit.capture.recorder import Recorder

    class Keep:
        def __init__(self) -> None:
            self.meta: dict = {}
            self.chunks: list[dict[str, np.ndarray]] = []

        def open(self, meta):
            self.meta = dict(meta)

        def write(self, chunk):
            self.chunks.append(dict(chunk))

        def close(self, final):
            pass

    keep = Keep()
    clock = itertools.count(0, 1000).__next__
    rec = Recorder(None, clock=clock, gc=False, handle_signals=False, flush_interval_s=1e6,
                   config={"rung": "parts"}, sinks=[keep])  # fmt: skip
    with rec:
        for phase in range(3):
            for i in range(4):
                rid = f"r{phase}-{i % 2}"
                rec.request(rid, prompt_tokens=10, max_new_tokens=5)
                with rec.step():
                    with rec.segment("decode"):
                        pass
                    if i == 1:
                        rec.evict(rid)
                    if i == 2:
                        rec.readmit(f"r{phase}-1")
                    rec.emit([rid])
                    rec.counter("batch", 1.0)
            if phase < 2:
                rec._flush()
                t_end = time.monotonic() + 30  # one chunk per phase: let it reach the sink
                while len(keep.chunks) < phase + 1 and time.monotonic() < t_end:
                    time.sleep(0.001)
    meta = {k: v for k, v in keep.meta.items() if k != "started_unix_s"}
    return meta, keep.chunks


def parts_cases() -> list[PartsCase]:
    """Parts folders: one valid, then one problem each."""
    meta, chunks = recorded_chunks()
    good_meta = json.dumps(meta).encode()

    def part(c: dict[str, np.ndarray]) -> bytes:
        buf = io.BytesIO()
        np.savez(buf, **c)
        return buf.getvalue()

    def files(cs: list[dict[str, np.ndarray]]) -> tuple[tuple[str, bytes], ...]:
        return tuple((f"part-{i:06d}.npz", part(c)) for i, c in enumerate(cs, 1))

    def with_part(i: int, **changes) -> tuple[tuple[str, bytes], ...]:
        cs = [dict(c) for c in chunks]
        for k, v in changes.items():
            if v is None:
                del cs[i][k]
            else:
                cs[i][k] = v
        return files(cs)

    def meta_with(**changes) -> bytes:
        m = dict(meta)
        for k, v in changes.items():
            if v is None:
                m.pop(k, None)
            else:
                m[k] = v
        return json.dumps(m).encode()

    ok = files(chunks)
    out = [
        PartsCase("parts as recorded", "ok", good_meta, ok),
        PartsCase("parts: none yet", "ok", good_meta, ()),
        PartsCase(
            "parts: glob characters and strays around them",
            "ok",
            good_meta,
            (
                *ok,
                ("part-1.npz", b"junk"),
                ("part-000001.npz.tmp", b"junk"),
                ("part-[0-9]*.npz", b"junk"),
            ),
        ),  # fmt: skip
        PartsCase(
            "parts: a truncated part",
            "ok",
            good_meta,
            (*ok[:1], (ok[1][0], ok[1][1][:300]), *ok[2:]),
            "unreadable",
        ),  # fmt: skip
        PartsCase(
            "parts: a folder named like a part",
            "ok",
            good_meta,
            (*ok[:2], ("part-000003.npz", b"")),
            "unreadable",
        ),  # fmt: skip
        PartsCase(
            "parts: a part without labels", "ok", good_meta, with_part(2, labels=None), "unreadable"
        ),  # fmt: skip
        PartsCase("meta: not JSON", "reject", b"{not json", ok, "meta.json"),
        PartsCase("meta: a list", "reject", b"[1, 2]", ok, "meta.json"),
        PartsCase("meta: no t0_tick", "reject", meta_with(t0_tick=None), ok, "t0_tick"),
        PartsCase("meta: t0_tick true", "reject", meta_with(t0_tick=True), ok, "t0_tick"),
        PartsCase("meta: t0_tick 2**70", "reject", meta_with(t0_tick=2**70), ok, "t0_tick"),
        PartsCase("meta: t0_tick a float", "reject", meta_with(t0_tick=1.5), ok, "t0_tick"),
        PartsCase(
            "meta: seconds_per_tick text",
            "reject",
            meta_with(seconds_per_tick="ns"),
            ok,
            "seconds_per_tick",
        ),  # fmt: skip
        PartsCase(
            "meta: seconds_per_tick 0",
            "reject",
            meta_with(seconds_per_tick=0),
            ok,
            "seconds_per_tick",
        ),  # fmt: skip
        PartsCase(
            "meta: seconds_per_tick NaN",
            "reject",
            json.dumps({**meta, "seconds_per_tick": float("nan")}).encode(),
            ok,
            "seconds_per_tick",
        ),  # fmt: skip
        PartsCase("meta: config a list", "reject", meta_with(config=[1]), ok, "config"),
        PartsCase(
            "meta: cause_map numbers", "reject", meta_with(cause_map={"swap": 1}), ok, "cause_map"
        ),  # fmt: skip
        PartsCase("meta: warnings text", "reject", meta_with(warnings="x"), ok, "warnings"),
    ]
    n_ids_1 = int(chunks[0]["request_ids"].size)
    for name, change, needle in [
        ("request_ids_start negative", {"request_ids_start": np.array(-1)}, "request_ids_start"),
        ("request_ids_start overlapping", {"request_ids_start": np.array(n_ids_1 - 1)},
         "request_ids_start"),
        ("request_ids_start skipping", {"request_ids_start": np.array(n_ids_1 + 1)},
         "request_ids_start"),
        ("request_ids_start two numbers", {"request_ids_start": np.array([0, 1])},
         "request_ids_start"),
        ("request_ids_start text", {"request_ids_start": np.array("0")}, "request_ids_start"),
        ("flush_tick a float", {"flush_tick": np.array(1.5)}, "flush_tick"),
        ("stop_tick two numbers", {"stop_tick": np.array([1, 2])}, "stop_tick"),
        ("dropped_rows text", {"dropped_rows": np.array("x")}, "dropped_rows"),
        ("dropped_rows negative", {"dropped_rows": np.array(-4)}, "dropped_rows"),
        ("config not JSON", {"config": np.array("{")}, "config"),
        ("config a list", {"config": np.array("[1]")}, "config"),
        ("steps not whole rows", {"steps": np.arange(8)}, "steps"),
        ("steps floats", {"steps": np.zeros(7)}, "steps"),
        ("counters integers", {"counters": np.zeros(3, dtype=np.int64)}, "counters"),
        ("emissions of an unknown request", {"emissions": np.array([99, 1, -1, 1, -1])},
         "emissions.request"),
        ("emissions of request -1", {"emissions": np.array([-1, 1, -1, 1, -1])},
         "emissions.request"),
        ("requests of an unknown request", {"requests": np.array([99, 1, 1, 1])},
         "requests.request"),
        ("events of an unknown request", {"events": np.array([99, 0, 1, 0])}, "events.request"),
    ]:  # fmt: skip
        out.append(
            PartsCase(
                f"part 2: {name}",
                "reject",
                good_meta,
                with_part(1, **change),
                f"part-000002.npz: {needle}",
            )  # fmt: skip
        )
    return out
