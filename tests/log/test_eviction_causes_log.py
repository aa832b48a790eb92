"""The eviction-cause tables in the raw log (schema v5): they round-trip, a v4 log loads
with them empty, a merged server run keeps them, and every row the analysis could not join
is refused in one line naming the field (the rejection list in `tracekit.log.validate`)."""

from __future__ import annotations

import io
import zipfile
from dataclasses import replace

import numpy as np
import pytest
from logbuilder import LogBuilder

import tracekit
from tracekit.errors import LogError
from tracekit.log.merge import merge_dir
from tracekit.log.rawlog import PREEMPT_REASONS, Evictors, Preemptions
from tracekit.log.validate import validate_log


def builder() -> LogBuilder:
    """Two requests: r0 runs steps 0-3; r1 is admitted in step 1 and evicts r0 there (KV
    full, 3 tokens lost, 0 free of 4 blocks); r0 is readmitted in step 2."""
    b = LogBuilder()
    for i in range(4):
        b.step(10 * i, 10 * i + 8)
        b.seg(i, "decode", 10 * i, 10 * i + 8)
    b.emit(0, 8, 0)
    b.emit(1, 18, 1)
    b.emit(0, 28, 2)
    b.emit(0, 38, 3)
    b.emit(1, 38, 3)
    b.evict(0, 12, 22, mode=1)
    b.cause(0, 12, 1, "kv_full", by=(1,), lost=3, free=0, used=4)
    return b


def rewrite(src, dst, drop=(), **replace_arrays) -> None:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            key = info.filename[: -len(".npy")]
            if any(key.startswith(d) for d in drop):
                continue
            if key in replace_arrays:
                buf = io.BytesIO()
                np.save(buf, replace_arrays[key])
                zout.writestr(info.filename, buf.getvalue())
            else:
                zout.writestr(info, zin.read(info))


def test_the_cause_tables_round_trip_with_their_vocabulary(tmp_path):
    log = validate_log(builder().build())
    path = log.save(tmp_path / "run.npz")
    back = tracekit.load(path)
    for table in ("preemptions", "evictors"):
        for col, a in getattr(log, table).columns().items():
            np.testing.assert_array_equal(getattr(getattr(back, table), col), a, err_msg=col)
    with np.load(path, allow_pickle=False) as z:
        assert tuple(z["preempt_reasons"].tolist()) == PREEMPT_REASONS
        assert int(z["schema_version"]) == 5


def test_a_version_4_log_loads_with_no_causes(tmp_path):
    path = builder().build().save(tmp_path / "run.npz")
    v4 = tmp_path / "v4.npz"
    rewrite(path, v4, drop=("preemptions.", "evictors.", "preempt_reasons"),
            schema_version=np.array(4, dtype=np.int64))  # fmt: skip
    log = tracekit.load(v4)
    assert len(log.preemptions) == len(log.evictors) == 0 and len(log.evictions) == 1


def test_a_foreign_reason_vocabulary_is_refused(tmp_path):
    path = builder().build().save(tmp_path / "run.npz")
    other = tmp_path / "other.npz"
    rewrite(path, other, preempt_reasons=np.array(["oom", "kv_full"]))
    with pytest.raises(LogError, match="preempt_reasons: vocabulary"):
        tracekit.load(other)


def _with(log, table: str, **cols):
    t = getattr(log, table)
    return replace(log, **{table: replace(t, **{k: np.asarray(v) for k, v in cols.items()})})


BAD = {
    "victim outside": ("preemptions", dict(request=[5]), "preemptions.request: row 0: index 5"),
    "step outside": ("preemptions", dict(step=[9]), "preemptions.step: row 0: index 9"),
    "reason outside": ("preemptions", dict(reason=[3]), "preemptions.reason: row 0: index 3"),
    "count below -1": (
        "preemptions",
        dict(num_free_blocks=[-2]),
        "preemptions.num_free_blocks: row 0: -2",
    ),
    "time not finite": ("preemptions", dict(t_s=[np.nan]), "preemptions.t_s: row 0: non-finite"),
    "no eviction then": ("preemptions", dict(t_s=[0.013]), "preemptions.t_s: row 0: request 0"),
    "evictor outside": ("evictors", dict(evictor=[7]), "evictors.evictor: row 0: index 7"),
    "own evictor": ("evictors", dict(evictor=[0]), "evictors.evictor: row 0: request 0 is its"),
    "evictor of nothing": ("evictors", dict(t_s=[0.02]), "evictors.t_s: row 0: request 0 has no"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_cause_row_that_cannot_be_joined_is_refused_in_one_line(name):
    table, cols, message = BAD[name]
    log = _with(builder().build(), table, **cols)
    with pytest.raises(LogError) as e:
        validate_log(log)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_two_causes_for_one_eviction_and_an_evictor_named_twice_are_refused():
    log = builder().build()
    two = replace(log, preemptions=Preemptions(**{
        k: np.concatenate([v, v]) for k, v in log.preemptions.columns().items()
    }))  # fmt: skip
    with pytest.raises(LogError, match=r"preemptions.request: row 1: request 0 has two causes"):
        validate_log(two)
    twice = replace(log, evictors=Evictors(**{
        k: np.concatenate([v, v]) for k, v in log.evictors.columns().items()
    }))  # fmt: skip
    with pytest.raises(LogError, match=r"evictors.evictor: row 1: request 1 named twice"):
        validate_log(twice)


def test_a_merged_server_run_keeps_the_engine_cores_causes(tmp_path):
    """The merge keeps the engine core's request indices: its cause rows name the same
    requests under the run's names."""
    ident = {"role": "engine_core", "pid": 1, "host": "h", "name": "engine_core",
             "boot_id": "b", "clock": "clock_gettime(CLOCK_MONOTONIC)"}  # fmt: skip
    rec = tracekit.Recorder(tmp_path / "engine_core-1.npz", gc=False, handle_signals=False,
                            config={"process": ident})  # fmt: skip
    with rec:
        rec.request("x", prompt_tokens=2)
        rec.request("y", prompt_tokens=2)
        with rec.step():
            rec.admit("x")
            rec.admit("y")
            rec.evict("x", mode="recompute", reason="kv_full", by=["y"], num_used_blocks=2)
            rec.emit(["y"])
    run = merge_dir(str(tmp_path))
    assert run.request_ids == ("x", "y")
    assert run.preemptions.request.tolist() == [0] and run.evictors.evictor.tolist() == [1]
    assert run.preemptions.num_used_blocks.tolist() == [2]
