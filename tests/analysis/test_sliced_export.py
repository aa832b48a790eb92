"""`tracekit export` and `fleet` of a long run read in slices (docs/reports.md, "Reading a
long run in slices"): the gaps file holds the whole run's rows in the whole run's order,
written a block at a time; its runs row is `analyze`'s of the run read in slices; the
fleet rollup reads gaps files in batches with the numbers it had reading them whole."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_sliced import _hand_run, _retained_run

import tracekit
from tracekit.analysis import fleet
from tracekit.analysis.export import export
from tracekit.analysis.fleet import rollup, rollup_logs

REPO = Path(__file__).resolve().parents[2]
SLICES = "TRACEKIT_SLICE_EMISSIONS"
WHOLE = "100000000"  # more emissions than any test run: read whole


def _gaps(root: Path):
    (f,) = list((root / "gaps").rglob("*.parquet"))
    return pq.read_table(f), pq.ParquetFile(f).num_row_groups


def _runs_row(root: Path) -> dict:
    (f,) = list((root / "runs").rglob("*.parquet"))
    return pq.read_table(f).to_pylist()[0]


def _close(a, b) -> bool:
    """Equal, floats to float rounding (a long run's sums add in another order)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or abs(a - b) <= 1e-9 * max(1.0, abs(a)) or (math.isnan(a) and math.isnan(b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _same_gaps(a, b) -> None:
    """The same schema (dictionaries too) and the same rows in the same order: every column
    exactly but the parts, which equal to float rounding (a slice's prefix sums over the
    timeline start at the slice, so a part may differ in its last bits, ~1e-16 ms)."""
    assert a.schema == b.schema and a.num_rows == b.num_rows
    parts = [c for c in a.column_names if c.startswith("part_")]
    rest = [c for c in a.column_names if c not in parts]
    assert a.select(rest).equals(b.select(rest))
    for c in parts:
        x, y = a.column(c).to_numpy(), b.column(c).to_numpy()
        assert np.abs(x - y).max(initial=0.0) <= 1e-9, c


def _export(monkeypatch, runs, root: Path, budget: str, **kw) -> dict:
    monkeypatch.setenv(SLICES, budget)
    return export([str(r) for r in runs], str(root), **kw)


def test_a_hand_runs_gaps_written_in_slices_are_its_rows_in_its_order(tmp_path, monkeypatch):
    """Hand case (docs/partition.md rules 1-3; tables: docs/design.md). "alive" emits at
    10, 20, .., 300 ms (steps 0..29): 29 gaps of 10 ms, all forward, clean. "long" emits
    at 10 ms (step 0) and 240 ms (step 23): one gap of 230 ms, evicted 30..230 ms (preempt
    200 ms), decode 10..30 and 230..240 (forward 30 ms); primary preempt. The table lists
    gaps by request (alive is named first), then time. Read one emission a slice: every
    part its own slice, the long gap's slice reaching back 23 parts."""
    out = tmp_path / "run.npz"
    _hand_run(out)
    meta = _export(monkeypatch, [out], tmp_path / "sliced", "1")
    assert meta["gaps"] == 30 and meta["runs"][0]["gaps"] == 30
    t, groups = _gaps(tmp_path / "sliced")
    assert groups == 2  # a block a request: written in blocks, not as one table
    assert not list((tmp_path / "sliced").glob(".tracekit-spill-*"))  # the spill is gone
    assert t.column("request").to_pylist() == ["alive"] * 29 + ["long"]
    assert t.column("run").to_pylist() == ["run"] * 30
    assert t.column("primary").to_pylist() == ["clean"] * 29 + ["preempt"]
    t0 = [10.0 * (k + 1) for k in range(29)] + [10.0]
    t1 = [10.0 * (k + 2) for k in range(29)] + [240.0]
    assert np.allclose(np.array(t.column("t0_s").to_pylist()) * 1e3, t0)
    assert np.allclose(np.array(t.column("t1_s").to_pylist()) * 1e3, t1)
    assert np.allclose(t.column("gap_ms").to_pylist(), [10.0] * 29 + [230.0])
    assert t.column("step0").to_pylist() == list(range(29)) + [0]
    assert t.column("step1").to_pylist() == list(range(1, 30)) + [23]
    assert np.allclose(t.column("part_preempt_ms").to_pylist(), [0.0] * 29 + [200.0])
    assert np.allclose(t.column("part_forward_ms").to_pylist(), [10.0] * 29 + [30.0])
    for lb in ("gc", "tok", "prefill", "graph", "residual"):
        assert np.allclose(t.column(f"part_{lb}_ms").to_pylist(), 0.0)
    _export(monkeypatch, [out], tmp_path / "whole", WHOLE)
    whole, whole_groups = _gaps(tmp_path / "whole")
    assert whole_groups == 1 and whole.equals(t) and whole.schema == t.schema


@settings(max_examples=6, deadline=None)
@given(budget=st.integers(min_value=1, max_value=8_000))
def test_any_slice_size_exports_the_whole_runs_gaps_and_figures(demo_run, tmp_path_factory,
                                                                 budget):  # fmt: skip
    """The gaps file of a run exported in slices of any size is the whole run's: the same
    schema (dictionaries too) and the same rows in the same order (parts to float
    rounding); its runs
    row is the whole run's, sums and shares to float rounding."""
    mp = pytest.MonkeyPatch()
    try:
        d = tmp_path_factory.mktemp("budget")
        whole_meta = _export(mp, [demo_run], d / "whole", WHOLE)
        meta = _export(mp, [demo_run], d / "sliced", str(budget))
    finally:
        mp.undo()
    assert meta == whole_meta
    whole, _ = _gaps(d / "whole")
    sliced, groups = _gaps(d / "sliced")
    assert groups > 1 or budget >= whole.num_rows  # in blocks
    _same_gaps(whole, sliced)
    for c in ("primary", "run"):  # the dictionary is the whole run's, in its order
        assert sliced.column(c).chunk(0).dictionary.equals(whole.column(c).chunk(0).dictionary)
    a, b = _runs_row(d / "whole"), _runs_row(d / "sliced")
    assert list(a) == list(b)
    assert [k for k in a if not _close(a[k], b[k])] == []
    for k in ("gaps", "tokens", "requests", "itl_p50", "itl_p99", "itl_max", "hist_json"):
        assert a[k] == b[k], k


def test_export_of_two_runs_one_long_widens_both_files_alike(demo_run, tmp_path, monkeypatch):
    """A long run beside a short one with a label of its own (`sample`) in one dataset:
    every gaps file gets the union of the labels (the long run's file widened row group by
    row group, its `part_sample_ms` 0), as when both are read whole."""
    out = tmp_path / "hand.npz"
    _hand_run(out, extra="sample")
    budget = str(len(tracekit.load(out).emissions))  # the hand run whole, the demo in slices
    _export(monkeypatch, [demo_run, out], tmp_path / "sliced", budget, keys=["rung"])
    _export(monkeypatch, [demo_run, out], tmp_path / "whole", WHOLE, keys=["rung"])
    for f in sorted((tmp_path / "whole" / "gaps").rglob("*.parquet")):
        g = tmp_path / "sliced" / f.relative_to(tmp_path / "whole")
        a, b = pq.read_table(f), pq.read_table(g)
        _same_gaps(a, b)
        assert "part_sample_ms" in a.column_names
    demo = pq.read_table(next((tmp_path / "sliced" / "gaps").rglob("baseline__s1.parquet")))
    assert demo.num_rows > 0 and set(demo.column("part_sample_ms").to_pylist()) == {0.0}


def test_the_rollup_reads_gaps_files_in_batches_with_the_same_numbers(demo_run, tmp_path,
                                                                      monkeypatch):  # fmt: skip
    """Pooled percentiles (exact and sketched), tail sums and counts from gaps files read
    a few rows at a time equal those from the files read in one batch, to the last bit."""
    monkeypatch.setenv(SLICES, "900")  # the file in row groups too
    export([demo_run], str(tmp_path / "ds"))
    for budget in (1 << 30, 0):  # exact, then a sketch
        kw = {"memory_budget_bytes": budget, "sketch_points": 64}
        monkeypatch.setattr(fleet, "BATCH_ROWS", 1 << 30)
        one = rollup(str(tmp_path / "ds"), "rung", **kw).to_records()
        monkeypatch.setattr(fleet, "BATCH_ROWS", 37)
        batched = rollup(str(tmp_path / "ds"), "rung", **kw).to_records()
        assert json.dumps(batched) == json.dumps(one)
        assert one[0]["pooled"]["method"] == ("exact" if budget else "sketch")
    monkeypatch.setattr(fleet, "BATCH_ROWS", 37)
    monkeypatch.setenv(SLICES, WHOLE)
    logs = rollup_logs([demo_run], "rung").to_records()
    assert logs[0]["pooled"] == rollup(str(tmp_path / "ds"), "rung").to_records()[0]["pooled"]


@pytest.mark.parametrize(
    "view",
    [{"window": "0.15..0.3"}, {"window": "0.3.."}, {"around": "worst", "width_s": 0.07},
     {"around": "p99", "width_s": 0.04}],
)  # fmt: skip
def test_a_window_of_a_long_run_exports_the_whole_runs_window(demo_run, demo_span, tmp_path,
                                                              monkeypatch, view):  # fmt: skip
    """`export --window`/`--around` of a run read in slices (only the parts the window's
    gaps need): the gaps file is the whole run's window (parts to float rounding), with
    every label of
    the run (docs/reports.md, "Windows"); the runs row is `analyze --window`'s."""
    # the modules whose functions this test swaps or asks: imported where they are used
    from tracekit.analysis import export as export_module
    from tracekit.analysis import workers
    from tracekit.analysis.window import WindowOptions

    def never(*_a, **_k):
        raise AssertionError("the long run was opened whole")

    if "window" in view:  # fractions of the run's span (`demo_span`)
        v = WindowOptions(window=demo_span.window(view["window"]))
    else:
        v = WindowOptions(around=view["around"], width_s=float(demo_span.width(view["width_s"])))
    monkeypatch.setenv(SLICES, "500")
    assert workers.sliced_window(demo_run, v) is not None  # read in slices
    with monkeypatch.context() as m:
        m.setattr(export_module, "open_run", never)
        sliced_meta = export([demo_run], str(tmp_path / "sliced"), view=v)
    monkeypatch.setenv(SLICES, WHOLE)
    whole_meta = export([demo_run], str(tmp_path / "whole"), view=v)
    assert sliced_meta == whole_meta and whole_meta["gaps"] > 0
    a, _ = _gaps(tmp_path / "whole")
    b, _ = _gaps(tmp_path / "sliced")
    _same_gaps(a, b)
    ra, rb = _runs_row(tmp_path / "whole"), _runs_row(tmp_path / "sliced")
    assert list(ra) == list(rb) and [k for k in ra if not _close(ra[k], rb[k])] == []


def test_a_run_whose_first_parts_were_removed_exports_as_read_whole(tmp_path, monkeypatch):
    """A run recorded with retention (its first parts removed) read in slices: steps
    numbered from the first part left and the requests named only in removed parts
    '(removed N)', as the whole-run reader gives them (docs/design.md, "The run's log on
    disk"): the same table (parts to float rounding)."""
    out = tmp_path / "run.npz"
    _retained_run(out)  # requests that live ~10 steps each, two emitting per step
    log = tracekit.load(out)
    assert any(n.startswith("(removed ") for n in log.request_ids)  # parts were removed
    _export(monkeypatch, [out], tmp_path / "sliced", str(len(log.emissions) // 3))
    _export(monkeypatch, [out], tmp_path / "whole", WHOLE)
    (a, _), (b, groups) = _gaps(tmp_path / "whole"), _gaps(tmp_path / "sliced")
    assert groups > 1 and a.num_rows > 0
    _same_gaps(a, b)
    assert "(removed" in a.column("request").to_pylist()[0]
