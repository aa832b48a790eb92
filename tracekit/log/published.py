"""The published layout: the `.npz` files written by the method tracekit industrialises
(design.md's table), read unchanged into a `RawLog`.

Six 2-D float arrays (``steps``, ``segs``, ``gcs``, ``emissions``, ``evictions``,
``requests``) with a fixed number of columns each, a ``wall`` time, an optional ``config``
(JSON) and ``trace``. Request ids are numbers there; emissions and evictions refer to them
by id, which becomes an index into the requests table here. Tables the layout does not
have are empty. `save_published` writes a log back in that layout, for the published
method's own scripts (and for checking that both layouts give the same figures).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from tracekit.errors import LogError
from tracekit.fsio import atomic_open
from tracekit.labels import DEFAULT_CAUSE_MAP
from tracekit.log.archive import check_ints, json_member
from tracekit.log.rawlog import (
    MODE_SWAP,
    Emissions,
    Evictions,
    GcPauses,
    RawLog,
    Requests,
    Segments,
    Steps,
)

PUBLISHED_ARRAYS = {
    "steps": 7,
    "segs": 4,
    "gcs": 3,
    "emissions": 3,
    "evictions": 3,
    "requests": 5,
}
PUBLISHED_SEG_LABELS = ("tok", "swap", "prefill", "decode")
PUBLISHED_OTHERS = frozenset({"trace", "wall", "config"})
#: every member the layout defines (anything else is skipped unread)
PUBLISHED_MEMBERS = frozenset(PUBLISHED_ARRAYS) | PUBLISHED_OTHERS


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
    if col.dtype.kind == "f" and col.size:  # the common case: whole numbers well inside int64,
        hi, lo = col.max(), col.min()  # cast once and compared back
        if -(2.0**62) <= lo and hi <= 2.0**62:  # NaN compares False
            ints = col.astype(np.int64)
            if not np.any(ints != col):
                return ints
    check_ints(path, key, col, np.dtype(np.int64), name)  # `check_ints`' verdict and words
    return col.astype(np.int64)


def _ints(path: str, key: str, a: np.ndarray, names: dict[int, str]) -> np.ndarray:
    """`a`, once its integer columns (index -> the layout's column name) are checked to
    hold integers that fit int64."""
    for j, name in names.items():
        check_ints(path, key, a[:, j], np.dtype(np.int64), name)
    return a


def from_published(path: str, arrays: dict[str, np.ndarray]) -> RawLog:
    st = _published_array(path, arrays, "steps")
    sg = _published_array(path, arrays, "segs")
    gc_ = _published_array(path, arrays, "gcs")
    em = _published_array(path, arrays, "emissions")
    ev = _published_array(path, arrays, "evictions")
    rq = _published_array(path, arrays, "requests")

    # steps, segs (less thread and is_device), gcs and requests (after the id) have the
    # columns of their table, in its order
    step_ints = {2: "n_decode", 3: "n_prefill_tok", 4: "graph", 5: "preempted", 6: "swapped_in"}
    steps = Steps.from_rows(_ints(path, "steps", st, step_ints))
    segments = Segments.from_rows(
        _ints(path, "segs", sg, {0: "step", 1: "code"}), thread=0, is_device=0
    )
    if len(segments) and (segments.label.min() < 0 or segments.label.max() > 3):
        raise LogError(path, "segs", "column code: expected 0 tok, 1 swap, 2 prefill, 3 decode")
    gcs = GcPauses.from_rows(_ints(path, "gcs", gc_, {2: "generation"}))
    req_ids_num = _int_col(path, "requests", rq[:, 0], "request id")
    order = np.argsort(req_ids_num, kind="stable")
    if np.any(req_ids_num[order][1:] == req_ids_num[order][:-1]):  # sorted: neighbours
        raise LogError(path, "requests", "column request id: duplicate ids")

    sorted_ids = req_ids_num[order]
    lo_id = int(sorted_ids[0]) if len(order) else 0
    span = int(sorted_ids[-1]) - lo_id + 1 if len(order) else 0
    # ids are usually dense (first_id, first_id + 1, ...): a lookup table, one gather per
    # row, instead of a binary search
    lut = None
    if 0 < span <= 4 * len(order) + 1024:
        lut = np.full(span, -1, dtype=np.int64)
        lut[sorted_ids - lo_id] = order

    def to_index(key: str, ids: np.ndarray) -> np.ndarray:
        ids = _int_col(path, key, ids, "request id")
        if len(order) == 0 and len(ids):
            raise LogError(path, key, "refers to requests but the requests array is empty")
        if lut is not None and (
            not len(ids) or (ids.min() >= lo_id and ids.max() <= lo_id + span - 1)
        ):
            idx = lut[ids - lo_id]  # every id inside the table (the common case)
            known = idx >= 0
        elif lut is not None:
            # compared before subtracting: a difference of extreme ids would wrap
            inside = (ids >= lo_id) & (ids <= lo_id + span - 1)
            idx = lut[np.where(inside, ids - lo_id, 0)]
            known = inside & (idx >= 0)
        else:
            pos = np.clip(np.searchsorted(sorted_ids, ids), 0, max(len(order) - 1, 0))
            known = sorted_ids[pos] == ids if len(ids) else np.ones(0, bool)
            idx = order[pos]
        if not np.all(known):
            bad = ids[~known][:3].tolist()
            raise LogError(path, key, f"unknown request id(s) {bad} (not in requests)")
        return idx

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
    requests = Requests.from_rows(
        _ints(path, "requests", rq, {2: "prompt tokens", 3: "max new tokens"})[:, 1:]
    )
    wall = arrays.get("wall")
    if wall is None or wall.size != 1 or wall.dtype.kind not in "iuf":
        raise LogError(path, "wall", "missing or not a number")
    config: dict[str, Any] = {}
    if "config" in arrays:
        config = json_member(path, arrays, "config")
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


def save_published(
    log: RawLog, path: str | os.PathLike[str], *, compressed: bool = False, first_id: int = 100
) -> str:
    """Write `log` in the published layout (design.md's table), atomically. Requests get the
    numeric ids ``first_id, first_id + 1, ...`` in table order; segment labels must be the
    layout's four (``tok swap prefill decode``); what the layout has no place for (threads,
    device windows, counters, TTFT events) is left out."""
    unknown = sorted(set(log.labels) - set(PUBLISHED_SEG_LABELS))
    if unknown:
        raise ValueError(f"labels {unknown} have no code in the published layout")
    st, sg, em, ev, rq, gc_ = (
        log.steps, log.segments, log.emissions, log.evictions, log.requests, log.gc_pauses
    )  # fmt: skip
    ids = np.arange(len(rq), dtype=np.float64) + first_id
    code = np.array([PUBLISHED_SEG_LABELS.index(lb) for lb in log.labels], dtype=np.float64)
    arrays = {
        "steps": np.column_stack([st.t_start_s, st.t_end_s, st.num_decode, st.num_prefill_tokens,
                                  st.graph_size, st.num_preempted, st.num_swapped_in]),
        "segs": np.column_stack([sg.step, code[sg.label], sg.t_start_s, sg.t_end_s]),
        "gcs": np.column_stack([gc_.t_start_s, gc_.t_end_s, gc_.generation]),
        "emissions": np.column_stack([ids[em.request], em.t_s, em.step]),
        "evictions": np.column_stack([ids[ev.request], ev.t_evict_s, ev.t_readmit_s]),
        "requests": np.column_stack([ids, rq.arrival_s, rq.prompt_tokens, rq.max_new_tokens,
                                     rq.first_token_s]),
        "trace": np.column_stack([ids, rq.arrival_s, np.full(len(ids), 1000.0),
                                  rq.max_new_tokens]),
        "wall": np.array(log.wall_s),
        "config": np.array(json.dumps(dict(log.config))),
    }  # fmt: skip
    save = np.savez_compressed if compressed else np.savez
    with atomic_open(path) as fh:
        save(fh, **arrays)  # type: ignore[arg-type]  # stub: kwargs could be allow_pickle
    return os.fspath(path)
