"""`tracekit export` datasets read back without tracekit, and `tracekit fleet` rollups
checked against the same computation done with pandas on the exported dataset."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pandas as pd
import pyarrow.dataset as ds
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from synthlog import synthetic_log

import tracekit
from tracekit.analysis.export import export
from tracekit.analysis.figures import analyze
from tracekit.analysis.fleet import DatasetError, QuantileSketch, rollup, rollup_logs
from tracekit.attribution.itl import partition
from tracekit.cli import main


def write_runs(d, n: int, *, rungs=("baseline", "+watermark", "+budget")) -> list[str]:
    """`n` small runs, round-robin over `rungs` and two replicas; run 1 has no `schedule`
    segments (an engine label only the other runs have), every fourth one has a small KV
    pool (run 0's is too small to admit anyone: a run without gaps)."""
    paths = []
    for i in range(n):
        log = synthetic_log(
            seed=100 + i,
            rung=rungs[i % len(rungs)],
            duration_s=0.6,
            rate_per_s=20,
            gc_every_steps=15,
            num_kv_blocks=60 if i % 4 == 0 else 500,
            extra_label=None if i == 1 else "schedule",
            config={"replica": f"r{i % 2}", "date": "2026-12-01"},
        )
        paths.append(log.save(os.path.join(d, f"run{i:03d}.npz")))
    return paths


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    d = tmp_path_factory.mktemp("fleet")
    paths = write_runs(str(d), 12)
    root = str(d / "dataset")
    export(paths, root, ["rung", "replica"])
    return paths, root


def test_export_reads_back_in_pandas_pyarrow_and_duckdb(dataset):
    duckdb = pytest.importorskip("duckdb")
    paths, root = dataset
    logs = {os.path.basename(p)[:-4]: p for p in paths}
    gaps = pd.read_parquet(os.path.join(root, "gaps"))
    runs = pd.read_parquet(os.path.join(root, "runs"))
    # one row per gap of every run, one row per run; hive keys come back as columns
    want_gaps = {r: len(partition(tracekit.load(p))) for r, p in logs.items()}
    assert want_gaps["run000"] == 0  # its KV pool is too small to admit anyone: no gaps
    assert gaps.groupby("run", observed=True).size().to_dict() == {
        r: n for r, n in want_gaps.items() if n
    }
    assert sorted(runs["run"]) == sorted(logs)
    assert {"rung", "replica"} <= set(gaps.columns) and {"rung", "replica"} <= set(runs.columns)
    # the parts of every gap sum to it (the partition's reconciliation survives the export)
    parts = [c for c in gaps.columns if c.startswith("part_") and c.endswith("_ms")]
    assert "part_schedule_ms" in parts and "part_preempt_ms" in parts
    np.testing.assert_allclose(gaps[parts].sum(axis=1), gaps["gap_ms"], rtol=0, atol=1e-6)
    # run 1 recorded no `schedule` segment: its column exists and owns 0 ms
    assert (gaps.loc[gaps["run"] == "run001", "part_schedule_ms"] == 0).all()
    assert gaps.loc[gaps["run"] != "run001", "part_schedule_ms"].sum() > 0
    # t0_s/t1_s are the emissions, gap_ms their difference in ms
    np.testing.assert_allclose(gaps["gap_ms"], (gaps["t1_s"] - gaps["t0_s"]) * 1e3, rtol=1e-12)
    # the runs table holds the analysis' own figures
    for r, p in logs.items():
        a = analyze(tracekit.load(p))
        row = runs[runs["run"] == r].iloc[0]
        assert row["gaps"] == a.gaps and row["tok_per_s"] == a.tok_per_s
        assert row["itl_p99"] == a.itl_p99 or (math.isnan(row["itl_p99"]) and not a.gaps)
        assert row["tail_share_preempt"] == a.tail_share["preempt"]
        assert row["rung"] == a.rung and json.loads(row["config_json"])["seed"] == a.seed
    # pyarrow's own dataset reader, with the hive partitioning
    t = ds.dataset(os.path.join(root, "gaps"), format="parquet", partitioning="hive").to_table()
    assert t.num_rows == len(gaps)
    # DuckDB, straight from the files
    con = duckdb.connect()
    glob = os.path.join(root, "gaps", "**", "*.parquet")
    got = con.execute(
        f"SELECT rung, count(*), sum(gap_ms) FROM read_parquet('{glob}', hive_partitioning=true) "
        "GROUP BY rung ORDER BY rung"
    ).fetchall()
    by_rung = gaps.groupby("rung", observed=True)["gap_ms"].agg(["count", "sum"]).sort_index()
    assert [g[0] for g in got] == list(by_rung.index)
    assert [g[1] for g in got] == by_rung["count"].tolist()
    np.testing.assert_allclose([g[2] for g in got], by_rung["sum"], rtol=1e-12)
    p99 = con.execute(
        f"SELECT max(itl_p99) FROM read_parquet('{os.path.join(root, 'runs', '**', '*.parquet')}',"
        " hive_partitioning=true)"
    ).fetchone()[0]
    assert p99 == runs["itl_p99"].max()


def pandas_rollup(root: str, by: str) -> dict[str, dict]:
    """The rollup, computed here with pandas from the dataset files alone."""
    runs = pd.read_parquet(os.path.join(root, "runs"))
    gaps = pd.read_parquet(os.path.join(root, "gaps"))
    runs[by] = runs[by].astype(str)
    gaps[by] = gaps[by].astype(str)
    skip = {"rung", "replica", "run"}
    figs = [c for c in runs.columns if c not in skip and pd.api.types.is_numeric_dtype(runs[c])
            and not pd.api.types.is_bool_dtype(runs[c])]  # fmt: skip
    parts = [c for c in gaps.columns if c.startswith("part_")]
    out = {}
    for key, g in gaps.groupby(by, observed=True):
        r = runs[runs[by] == key]
        # pooled: numpy's linear percentiles of all the group's gaps; tail: gaps >= p99
        q = np.percentile(g["gap_ms"].to_numpy(), [50, 90, 99, 99.9])
        tail = g[g["gap_ms"] >= q[2]]
        out[key] = {
            "runs": len(r),
            "gaps": len(g),
            "figures": {
                c: (r[c].median(), r[c].min(), r[c].max(), int(r[c].notna().sum())) for c in figs
            },
            "pooled": dict(zip(["itl_p50", "itl_p90", "itl_p99", "itl_p999"], q, strict=True))
            | {"itl_max": g["gap_ms"].max()},
            "tail_gaps": len(tail),
            "tail_share": {c[5:-3]: tail[c].sum() / tail["gap_ms"].sum() for c in parts},
            "tail_count": tail["primary"].astype(str).value_counts().to_dict(),
        }
    return out


def test_fleet_rollup_equals_pandas_over_the_exported_dataset(dataset, monkeypatch):
    _, root = dataset
    want = pandas_rollup(root, "rung")
    monkeypatch.setattr("tracekit.analysis.fleet.FILES_PER_TASK", 5)  # three batches to combine
    got = rollup(root, "rung")
    assert [g.key for g in got.groups] == ["baseline", "+watermark", "+budget"]  # run order
    for g in got.groups:
        w = want[g.key]
        assert len(g.runs) == w["runs"] == 4 and g.gaps == w["gaps"] and g.method == "exact"
        assert set(g.figures) == set(w["figures"])
        for name, (med, lo, hi, n) in g.figures.items():
            wm, wlo, whi, wn = w["figures"][name]
            assert n == wn, name
            if n:
                assert (lo, hi) == (wlo, whi), name
                assert med == pytest.approx(wm, rel=1e-12, abs=1e-12), name
        for name, (v, err) in g.pooled.items():
            assert v == w["pooled"][name] and err == 0, name
        assert g.tail_gaps == w["tail_gaps"]
        for lb, share in g.tail_share.items():
            assert share == pytest.approx(w["tail_share"][lb], rel=1e-12, abs=1e-15), lb
        assert sum(g.tail_share.values()) == pytest.approx(1.0, abs=1e-9)
        assert g.tail_count == w["tail_count"]


def test_fleet_sketch_states_a_rank_error_that_holds(dataset, monkeypatch):
    _, root = dataset
    monkeypatch.setattr("tracekit.analysis.fleet.FILES_PER_TASK", 5)
    gaps = pd.read_parquet(os.path.join(root, "gaps"))
    got = rollup(root, "replica", memory_budget_bytes=0, sketch_points=32)
    for g in got.groups:
        assert g.method == "sketch"
        v = np.sort(gaps.loc[gaps["replica"].astype(str) == g.key, "gap_ms"].to_numpy())
        n = len(v)
        assert g.gaps == n and g.pooled["itl_max"] == (v[-1], 0)
        errs = []
        for name, q in (("itl_p50", 50), ("itl_p90", 90), ("itl_p99", 99), ("itl_p999", 99.9)):
            x, err = g.pooled[name]
            h = q / 100 * (n - 1)  # the position numpy's percentile reads
            first, last = np.searchsorted(v, x, "left"), np.searchsorted(v, x, "right") - 1
            assert first <= last, "the sketch returns one of the gaps"
            # some position of x lies within the stated error of h
            assert min(abs(first - h), abs(last - h), 0 if first <= h <= last else n) <= err
            errs.append(err)
        assert 0 < max(errs) < n / 8  # 32 points: coarse but bounded, and stated


@settings(max_examples=60, deadline=None)
@given(
    chunks=st.lists(
        st.lists(st.floats(0, 1e4, allow_nan=False), min_size=0, max_size=300),
        min_size=1,
        max_size=8,
    ),
    points=st.integers(4, 64),
    q=st.sampled_from([0.0, 1.0, 50.0, 90.0, 99.0, 99.9, 100.0]),
)
def test_merged_sketch_bounds_hold_against_the_exact_sort(chunks, points, q):
    sk = QuantileSketch.of(np.zeros(0))
    for c in chunks:
        sk = sk.merge(QuantileSketch.of(np.array(c), points), points)
    allv = np.sort(np.concatenate([np.array(c, dtype=float) for c in chunks]))
    assert sk.count == len(allv)
    if not len(allv):
        return
    x, err = sk.quantile(q)
    h = q / 100 * (len(allv) - 1)
    first, last = np.searchsorted(allv, x, "left"), np.searchsorted(allv, x, "right") - 1
    assert first <= last
    assert (first <= h <= last) or min(abs(first - h), abs(last - h)) <= err
    assert sk.max == allv[-1]


def test_fleet_over_raw_logs_equals_fleet_over_their_dataset(dataset):
    paths, root = dataset
    a = rollup_logs(paths, "rung").to_records()
    b = rollup(root, "rung").to_records()
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_cli_export_and_fleet(tmp_path):
    paths = write_runs(str(tmp_path), 3)
    runner = CliRunner()
    out = str(tmp_path / "ds")
    r = runner.invoke(main, ["export", *paths, "-o", out, "--partition-by", "rung"])
    assert r.exit_code == 0, r.output
    assert sorted(os.listdir(os.path.join(out, "gaps"))) == [
        "rung=+budget", "rung=+watermark", "rung=baseline"
    ]  # fmt: skip
    r = runner.invoke(main, ["fleet", out, "--by", "rung", "--format", "jsonl"])
    assert r.exit_code == 0, r.output
    recs = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["group"] for x in recs] == ["baseline", "+watermark", "+budget"]
    assert all(x["pooled"]["method"] == "exact" and x["runs"] == 1 for x in recs)
    # the table names the sketch's rank error when it is used
    r = runner.invoke(main, ["fleet", out, "--by", "rung", "--memory-mb", "0",
                             "--sketch-points", "16"])  # fmt: skip
    assert r.exit_code == 0 and "from a quantile sketch" in r.stdout and "ranks" in r.stdout
    # two processes write the same dataset
    r = runner.invoke(
        main, ["export", *paths, "-o", out + "2", "--partition-by", "rung", "-j", "2"]
    )
    assert r.exit_code == 0, r.output
    for table in ("gaps", "runs"):
        a = pd.read_parquet(os.path.join(out, table))
        b = pd.read_parquet(os.path.join(out + "2", table))
        pd.testing.assert_frame_equal(a, b)
    # exporting into a folder that already holds a dataset is refused, in one line
    r = runner.invoke(main, ["export", *paths, "-o", out])
    assert r.exit_code == 2 and "already holds a tracekit dataset" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    # a key no run has is an error, not one "(none)" group
    r = runner.invoke(main, ["fleet", out, "--by", "model"])
    assert r.exit_code == 2 and "--by model: no run has this config key" in r.stderr
    # a bad log: the same one line as `analyze`, and no half-written dataset left
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    r = runner.invoke(main, ["export", paths[0], str(bad), "-o", str(tmp_path / "half")])
    assert r.exit_code == 2 and str(bad) in r.stderr
    assert not os.path.exists(tmp_path / "half")
    r = runner.invoke(main, ["fleet", paths[0], str(bad), "--by", "rung"])
    assert r.exit_code == 2
    assert r.stderr.strip() == (
        f"tracekit: error: {bad}: file: not a readable .npz archive (File is not a zip file)"
    )


def test_nothing_but_the_ray_path_imports_ray(dataset, tmp_path):
    """`ray` is an optional extra: the package, the CLI and a whole analyse/export/fleet
    without --ray never import it (checked in a fresh interpreter)."""
    import subprocess
    import sys

    paths, root = dataset
    code = (
        "import sys, tracekit, tracekit.cli, tracekit.analysis.export, tracekit.analysis.fleet\n"
        "from click.testing import CliRunner\n"
        "r = CliRunner()\n"
        f"assert r.invoke(tracekit.cli.main, ['analyze', {paths[2]!r}]).exit_code == 0\n"
        f"assert r.invoke(tracekit.cli.main, ['fleet', {root!r}, '--by', 'rung']).exit_code == 0\n"
        f"assert r.invoke(tracekit.cli.main, ['export', {paths[2]!r}, '-o', "
        f"{str(tmp_path / 'd')!r}]).exit_code == 0\n"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_fleet_reads_a_dataset_compacted_by_duckdb(dataset, tmp_path):
    """docs/fleet.md advises compacting the one-file-per-run dataset; a gaps file then holds
    many runs (and DuckDB's own string encoding). The rollup is the same."""
    import shutil

    duckdb = pytest.importorskip("duckdb")
    _, root = dataset
    out = tmp_path / "compacted"
    shutil.copytree(os.path.join(root, "runs"), out / "runs")
    shutil.copy(os.path.join(root, "_tracekit_dataset.json"), out / "_tracekit_dataset.json")
    glob = os.path.join(root, "gaps", "**", "*.parquet")
    duckdb.connect().execute(
        f"COPY (SELECT * FROM read_parquet('{glob}', hive_partitioning = true)) "
        f"TO '{out / 'gaps'}' (FORMAT parquet, PARTITION_BY (rung))"
    )
    files = [f for _, _, fs in os.walk(out / "gaps") for f in fs]
    assert len(files) == 3  # one a rung, 4 runs each
    # by rung: one group a file; by replica: both replicas' runs in every file
    for by in ("rung", "replica"):
        a, b = rollup(root, by), rollup(str(out), by)
        assert [g.key for g in a.groups] == [g.key for g in b.groups]
        for ga, gb in zip(a.groups, b.groups, strict=True):
            assert (ga.gaps, ga.pooled, ga.tail_gaps, ga.tail_count) == (
                gb.gaps, gb.pooled, gb.tail_gaps, gb.tail_count
            )  # fmt: skip
            for lb, v in ga.tail_share.items():
                assert gb.tail_share[lb] == pytest.approx(v, rel=1e-12, abs=1e-15)
            assert ga.figures == gb.figures


@pytest.mark.parametrize("column", ["primary", "run", "gap_ms"])
def test_a_gaps_file_with_nulls_is_refused_naming_file_and_column(dataset, tmp_path, column):
    """A gaps file whose primary causes (or runs, or lengths) are null, as a hand-edited or
    foreign file can be, is one error naming the file and the column, never a crash."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    _, root = dataset
    out = tmp_path / "ds"
    shutil.copytree(root, out)
    files = sorted(p for p in out.joinpath("gaps").rglob("*.parquet"))
    victim = next(p for p in files if pq.read_metadata(p).num_rows > 2)
    t = pq.read_table(victim)
    col = t.column(column).to_pylist()
    col[1] = None
    i = t.schema.get_field_index(column)
    t = t.set_column(i, t.schema.field(i), pa.array(col, type=t.schema.field(i).type))
    pq.write_table(t, victim)
    with pytest.raises(DatasetError, match=rf"{victim.name}: column '{column}' has 1 null value"):
        rollup(str(out), "rung")
