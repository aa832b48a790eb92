"""`--ray` on a real local Ray (two CPUs): the same records as `--jobs 1`, the same one-line
errors, and fleet rollups through Ray tasks equal to the single-machine ones."""

from __future__ import annotations

import json
import os

import pandas as pd
import pytest
from click.testing import CliRunner
from test_fleet import pandas_rollup, write_runs

from tracekit.analysis import workers
from tracekit.cli import main

ray = pytest.importorskip("ray")

NUM_RUNS = 104


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the module (starting one costs seconds); the CLI uses it."""
    if ray.is_initialized():
        pytest.skip("a Ray is already running in this process")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("ray_runs")
    return write_runs(str(d), NUM_RUNS)


def invoke(*args: str):
    r = CliRunner().invoke(main, list(args))
    return r.exit_code, r.stdout, r.stderr


def test_an_unreachable_cluster_is_one_line_and_no_hang(runs):
    """Ray retries an address nobody answers at for minutes; tracekit says so at once.
    (First in this file: later tests connect this process to a local Ray.)"""
    assert not ray.is_initialized()
    code, out, err = invoke("analyze", "--ray", "127.0.0.1:1", runs[0])
    assert code == 2 and out == ""
    assert err == (
        "tracekit: error: --ray 127.0.0.1:1: cannot reach 127.0.0.1:1 (Connection refused); "
        "is the cluster up? `ray status` on its head node prints the address\n"
    )
    code, _, err = invoke("analyze", "--ray", "not-an-address", runs[0])
    assert code == 2 and "expected auto, HOST:PORT" in err


def test_ray_records_equal_jobs_1_in_order(local_ray, runs, tmp_path):
    code1, local, _ = invoke("analyze", "--format", "jsonl", "--jobs", "1", *runs)
    code2, on_ray, _ = invoke("analyze", "--format", "jsonl", "--ray", *runs)
    assert code1 == code2 == 0
    assert len(local.splitlines()) == NUM_RUNS
    assert [json.loads(x)["path"] for x in on_ray.splitlines()] == runs  # input order
    assert on_ray == local  # byte for byte
    html = [str(tmp_path / "local.html"), str(tmp_path / "ray.html")]
    assert invoke("report", *runs[:4], "-o", html[0])[0] == 0
    assert invoke("report", *runs[:4], "-o", html[1], "--ray")[0] == 0
    assert open(html[0], "rb").read() == open(html[1], "rb").read()
    code1, local, _ = invoke("compare", "--format", "jsonl", "--by", "replica", *runs)
    code2, on_ray, _ = invoke("compare", "--format", "jsonl", "--by", "replica", "--ray", *runs)
    assert code1 == code2 == 0 and on_ray == local and len(local.splitlines()) == 2


def test_a_bad_log_gives_the_same_one_line_error_on_ray(local_ray, runs, tmp_path):
    bad = tmp_path / "truncated.npz"
    bad.write_bytes(open(runs[5], "rb").read()[:300])
    args = [*runs[:5], str(bad), *runs[6:9]]
    code1, out1, err1 = invoke("analyze", "--format", "jsonl", *args)
    code2, out2, err2 = invoke("analyze", "--format", "jsonl", "--ray", *args)
    assert code1 == code2 == 2
    assert out1 == out2 == ""
    assert err2 == err1
    assert len(err2.strip().splitlines()) == 1 and str(bad) in err2
    assert "Traceback" not in err2 and "Ray" not in err2


def test_fleet_and_export_on_ray_equal_the_single_machine_path(local_ray, runs, tmp_path):
    local_ds, ray_ds = str(tmp_path / "local"), str(tmp_path / "ray")
    assert invoke("export", *runs, "-o", local_ds, "--partition-by", "rung,replica")[0] == 0
    assert invoke("export", *runs, "-o", ray_ds, "--partition-by", "rung,replica", "--ray")[0] == 0
    for table in ("gaps", "runs"):
        a = pd.read_parquet(os.path.join(local_ds, table)).sort_values("run", kind="stable")
        b = pd.read_parquet(os.path.join(ray_ds, table)).sort_values("run", kind="stable")
        pd.testing.assert_frame_equal(a.reset_index(drop=True), b.reset_index(drop=True))
    for extra in ([], ["--memory-mb", "0", "--sketch-points", "64"]):
        code1, local, _ = invoke("fleet", local_ds, "--by", "rung", "--format", "jsonl", *extra)
        code2, on_ray, _ = invoke(
            "fleet", local_ds, "--by", "rung", "--format", "jsonl", "--ray", *extra
        )
        assert code1 == code2 == 0 and on_ray == local
        recs = [json.loads(x) for x in local.splitlines()]
        assert sum(r["runs"] for r in recs) == NUM_RUNS
        assert {r["pooled"]["method"] for r in recs} == {"sketch" if extra else "exact"}
        if extra:
            continue
        # the Ray rollup equals the same computation done with pandas on the files
        want = pandas_rollup(local_ds, "rung")
        assert sorted(want) == sorted(r["group"] for r in recs)
        for r in recs:
            w = want[r["group"]]
            assert (r["runs"], r["gaps"], r["pooled_tail"]["gaps"]) == (
                w["runs"], w["gaps"], w["tail_gaps"]
            )  # fmt: skip
            for name, v in w["pooled"].items():
                assert r["pooled"][name] == {"ms": v, "rank_error": 0}, name
            for lb, v in w["tail_share"].items():
                assert r["pooled_tail"]["share"][lb] == pytest.approx(v, rel=1e-12, abs=1e-15)
            assert r["pooled_tail"]["count"] == w["tail_count"]
            for name, (med, lo, hi, n) in w["figures"].items():
                got = r["figures"][name]
                assert got["runs"] == n, name
                if n:
                    assert (got["min"], got["max"]) == (lo, hi), name
                    assert got["median"] == pytest.approx(med, rel=1e-12, abs=1e-12), name
    # Ray Data reads the dataset without tracekit
    n = ray.data.read_parquet(os.path.join(local_ds, "gaps")).count()
    assert n == len(pd.read_parquet(os.path.join(local_ds, "gaps"), columns=["gap_ms"]))


def _taken_as_sent(ray_address: str | None) -> None:
    """One run's slices (`slice_mapper`, `-j 2` or `--ray`) are taken from their iterable
    as they are sent, never all at once (a what-if's carry minutes of `R` each): when the
    first result comes back, four were taken (twice the pool's two processes; on Ray,
    `RAY_SLICES_AHEAD`, here 3, and the one sent as the first is taken back); every
    result comes back, in order."""
    taken = []

    def tasks():
        for i in range(20):
            taken.append(i)
            yield -i

    got = workers.slice_mapper(2, ray_address)(abs, tasks())
    assert next(got) == 0 and len(taken) == 4
    assert list(got) == list(range(1, 20)) and len(taken) == 20


def test_slices_are_taken_as_they_are_sent_by_a_pool():
    _taken_as_sent(None)


def test_slices_are_taken_as_they_are_sent_to_ray(local_ray, monkeypatch):
    monkeypatch.setattr(workers, "RAY_SLICES_AHEAD", 3)
    _taken_as_sent("")
