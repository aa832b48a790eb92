"""`--window` and `--around` on the commands that read many runs or write what they read:
`report`, `compare`, `whatif`, `export`, `fleet`; `check` refuses them (docs/reports.md,
"Windows: part of a long run").

The rule: partition the whole run, then select the gaps that end in [FROM, TO) and the
TTFTs whose first token lands in it, each with the whole run's parts. Every expected value
here is derived from that rule on the whole run's own rows (`tracekit gaps` and `tracekit
ttft` without a window), on two short demo runs: percentiles are numpy's linear ones, as
docs/partition.md and docs/whatif.md define them.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from tracekit.analysis.window import WindowOptions
from tracekit.cli import main
from tracekit.log.reader import load

ROOT = Path(__file__).resolve().parents[2]
#: the second run's wall-clock start is the first's plus this (seconds)
LATER_S = 0.5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two 200-step demo runs of one rung (seeds 1 and 2); the second's wall-clock start
    set to the first's + LATER_S, so one wall-clock window is a different window of each.
    Timed by the CPU clock: on the wall clock, a busy machine delayed the first step past
    the windows below (1..3 s held no gap)."""
    d = tmp_path_factory.mktemp("winruns")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for seed in ("1", "2"):
        subprocess.run(
            [sys.executable, "-m", "tracekit", "demo", "run", "--steps", "200", "--seed", seed,
             "--out", str(d), "--quiet", "--timer", "cpu"],
            check=True, env=env, capture_output=True, timeout=600,
        )  # fmt: skip
    a, b = str(d / "baseline__s1.npz"), str(d / "baseline__s2.npz")
    start = float(load(a).meta["started_unix_s"])
    log_b = load(b)
    log_b.meta["started_unix_s"] = start + LATER_S
    b2 = str(d / "later__s2.npz")
    log_b.save(b2)
    return a, b2


def invoke(*args):
    return CliRunner().invoke(main, [*args], catch_exceptions=False)


def jsonl(text):
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def whole_gaps(run):
    return jsonl(invoke("gaps", run, "--format", "jsonl").stdout)


def in_window(rows, key, lo, hi):
    lo = -np.inf if lo is None else lo
    hi = np.inf if hi is None else hi
    return [r for r in rows if lo <= r[key] < hi]


def pct(values, q):
    return float(np.percentile(np.asarray(values, dtype=float), q))


# -- whatif --------------------------------------------------------------------------------


def test_whatif_window_predicts_for_the_windows_gaps_and_ttfts(runs):
    run = runs[0]
    gs = in_window(whole_gaps(run), "t1_s", 1.0, 3.0)
    ts = in_window(jsonl(invoke("ttft", run, "--format", "jsonl").stdout), "first_token", 1.0, 3.0)
    assert gs and ts
    r = invoke("whatif", run, "--window", "1..3", "--format", "jsonl")
    assert r.exit_code == 0
    recs = jsonl(r.stdout)
    assert recs
    gap = np.array([g["gap_ms"] for g in gs])
    for rec in recs:
        assert rec["window"] == {"from_s": 1.0, "to_s": 3.0, "how": "--window 1..3"}
        # measured: the window's gaps and TTFTs, as in the whole run
        assert rec["measured_itl_p99_ms"] == pytest.approx(pct(gap, 99))
        assert rec["measured_itl_max_ms"] == pytest.approx(gap.max())
        assert rec["measured_ttft_p50_ms"] == pytest.approx(pct([t["ttft_ms"] for t in ts], 50))
    # first order: each of the window's gaps less the time its whole-run partition gave
    # the cause (docs/whatif.md, "First order")
    firsts = [x for x in recs if x["model"] == "first" and x["kind"] == "cause" and x["itl_labels"]]
    assert firsts
    for rec in firsts:
        (cause,) = rec["itl_labels"]
        left = np.maximum(gap - np.array([g["parts"][cause] for g in gs]), 0.0)
        assert rec["gaps"] == len(gs)
        assert rec["itl_p99_ms"] == pytest.approx(pct(left, 99)), cause
        assert rec["removed_ms"] == pytest.approx(sum(g["parts"][cause] for g in gs)), cause
    # the removals are the causes with time in the window's gaps or TTFTs
    with_time = {c for g in gs for c, v in g["parts"].items() if v > 0}
    with_time |= {c for t in ts for c, v in t["parts"].items() if v > 0}
    causes = {x["removal"] for x in recs if x["kind"] == "cause"}
    assert causes <= with_time | {"prefill"}  # the ITL cause `prefill` is others' in a TTFT
    table = invoke("whatif", run, "--window", "1..3").stdout
    assert "window 1..3 s from engine start (--window 1..3)" in table.splitlines()[1]


def test_whatif_window_over_every_gap_is_the_whole_runs(runs):
    """Both models, second order included (the replay is the whole run's): a window that
    holds every gap and every first token predicts what the whole run does."""
    run = runs[0]
    whole = jsonl(invoke("whatif", run, "--format", "jsonl").stdout)
    got = jsonl(invoke("whatif", run, "--window", "-1..1000", "--format", "jsonl").stdout)
    assert [{k: v for k, v in g.items() if k != "window"} for g in got] == whole


# -- compare ---------------------------------------------------------------------------------


def _group(stdout):
    (rec,) = jsonl(stdout)  # both runs are rung baseline: one group
    return rec


def test_compare_window_is_each_runs_window(runs):
    rec = _group(invoke("compare", *runs, "--window", "1..3", "--format", "jsonl").stdout)
    assert rec["windows"] == [{"from_s": 1.0, "to_s": 3.0, "how": "--window 1..3"}] * 2
    p99 = [pct([g["gap_ms"] for g in in_window(whole_gaps(r), "t1_s", 1.0, 3.0)], 99) for r in runs]
    assert rec["itl_p99"]["median"] == pytest.approx(statistics.median(p99))
    assert (rec["itl_p99"]["min"], rec["itl_p99"]["max"]) == pytest.approx((min(p99), max(p99)))


def test_compare_wall_clock_window_is_each_runs_own(runs):
    start = float(load(runs[0]).meta["started_unix_s"])
    iso = lambda s: datetime.fromtimestamp(start + s, UTC).isoformat()  # noqa: E731
    r = invoke("compare", *runs, "--window", f"{iso(1.0)}..{iso(3.0)}", "--format", "jsonl")
    assert r.exit_code == 0
    rec = _group(r.stdout)
    w1, w2 = rec["windows"]
    # the second run started LATER_S later: the same wall-clock times are earlier in it
    assert (w1["from_s"], w1["to_s"]) == pytest.approx((1.0, 3.0), abs=1e-5)
    assert (w2["from_s"], w2["to_s"]) == pytest.approx((1.0 - LATER_S, 3.0 - LATER_S), abs=1e-5)
    p99 = [
        pct([g["gap_ms"] for g in in_window(whole_gaps(run), "t1_s", w["from_s"], w["to_s"])], 99)
        for run, w in zip(runs, (w1, w2), strict=True)
    ]
    assert rec["itl_p99"]["median"] == pytest.approx(statistics.median(p99))


def test_compare_around_worst_centres_on_each_runs_own_worst_gap(runs):
    rec = _group(invoke("compare", *runs, "--around", "worst", "--width", "1",
                        "--format", "jsonl").stdout)  # fmt: skip
    for run, w in zip(runs, rec["windows"], strict=True):
        worst = max(whole_gaps(run), key=lambda g: g["gap_ms"])
        assert (w["from_s"], w["to_s"]) == pytest.approx((worst["t1_s"] - 0.5, worst["t1_s"] + 0.5))
    table = invoke("compare", *runs, "--around", "worst").stdout
    assert table.count("--around worst: a ") == 2  # each run's window, said before the table


# -- report ----------------------------------------------------------------------------------


def test_report_window_shows_the_windows_gaps_and_says_so(runs, tmp_path):
    from tracekit.analysis import workers  # the report's per-run work, as the CLI maps it

    run = runs[0]
    gs = in_window(whole_gaps(run), "t1_s", 1.0, 3.0)
    page, wi = workers.report_path(run, 10, view=WindowOptions(window="1..3"))
    a = page["analysis"]
    assert a.gaps == len(gs) and a.window["how"] == "--window 1..3"
    assert a.itl_p99 == pytest.approx(pct([g["gap_ms"] for g in gs], 99))
    assert page["series"]["num_gaps"] == len(gs)
    assert all(1.0 <= t < 3.0 for t in page["series"]["t_s"])
    assert all(1.0 <= t < 3.0 for t in page["series"]["gc_t_s"] + page["series"]["evict_t_s"])
    assert page["worst_stalls"] and all(1.0 <= s["t1_s"] < 3.0 for s in page["worst_stalls"])
    assert sum(b.gaps for b in page["buckets"]) in (0, len(gs))  # none for a short span
    assert wi.num_gaps == len(gs)
    out = tmp_path / "page.html"
    r = invoke("report", run, "--window", "1..3", "-o", str(out))
    assert r.exit_code == 0
    html = out.read_text()
    assert "<h2>Window</h2>" in html and "1..3 s from engine start (--window 1..3)" in html
    assert "Of the whole run: requests" in html


# -- export and fleet ------------------------------------------------------------------------


def test_export_window_writes_the_windows_rows(runs, tmp_path):
    import pandas as pd  # pandas reads the dataset back

    run = runs[0]
    gs = in_window(whole_gaps(run), "t1_s", 1.0, 3.0)
    ds = tmp_path / "ds"
    assert invoke("export", run, "--window", "1..3", "-o", str(ds)).exit_code == 0
    df = pd.read_parquet(ds / "gaps").sort_values(["request", "t1_s"])
    want = sorted(gs, key=lambda g: (g["request"], g["t1_s"]))
    assert df["t1_s"].tolist() == pytest.approx([g["t1_s"] for g in want])
    assert df["gap_ms"].tolist() == pytest.approx([g["gap_ms"] for g in want])
    assert df["request"].tolist() == [g["request"] for g in want]
    assert df["part_preempt_ms"].tolist() == pytest.approx([g["parts"]["preempt"] for g in want])
    (row,) = pd.read_parquet(ds / "runs").to_dict("records")
    whole = jsonl(invoke("analyze", run, "--format", "jsonl").stdout)[0]
    assert row["gaps"] == len(gs) and row["requests"] == whole["requests"]  # per run: whole
    where = (row["window_from_s"], row["window_to_s"], row["window_how"])
    assert where == (1.0, 3.0, "--window 1..3")
    meta = json.loads((ds / "_tracekit_dataset.json").read_text())
    assert meta["gaps"] == len(gs) and meta["window"]["window"] == "1..3"
    # an open end is a null
    ds2 = tmp_path / "ds2"
    assert invoke("export", run, "--window", "..3", "-o", str(ds2)).exit_code == 0
    (row2,) = pd.read_parquet(ds2 / "runs").to_dict("records")
    assert pd.isna(row2["window_from_s"]) and row2["window_to_s"] == 3.0
    assert row2["gaps"] == len(in_window(whole_gaps(run), "t1_s", None, 3.0))


def test_fleet_window_pools_the_windows_gaps(runs, tmp_path):
    r = invoke("fleet", *runs, "--by", "rung", "--window", "1..3", "--format", "jsonl")
    assert r.exit_code == 0
    gs = [in_window(whole_gaps(run), "t1_s", 1.0, 3.0) for run in runs]
    (rec,) = jsonl(r.stdout)
    assert rec["gaps"] == sum(len(g) for g in gs)
    pooled = [g["gap_ms"] for run_gaps in gs for g in run_gaps]
    assert rec["pooled"]["method"] == "exact"
    assert rec["pooled"]["itl_p99"]["ms"] == pytest.approx(pct(pooled, 99))
    per_run = [pct([g["gap_ms"] for g in run_gaps], 99) for run_gaps in gs]
    assert rec["figures"]["itl_p99"]["median"] == pytest.approx(statistics.median(per_run))
    assert "window_from_s" not in rec["figures"]  # where the window lies is not a figure
    assert rec["window"] == {"window": "1..3", "around": None, "width_s": 2.0}
    table = invoke("fleet", *runs, "--by", "rung", "--window", "1..3").stdout
    assert table.startswith("each run's window (--window 1..3)")
    # a dataset holds what export wrote: its window is export's
    ds = tmp_path / "ds"
    assert invoke("export", *runs, "-o", str(ds)).exit_code == 0
    bad = CliRunner().invoke(main, ["fleet", str(ds), "--by", "rung", "--window", "1..3"])
    assert bad.exit_code == 2 and "export --window" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


# -- bad windows, and where a window makes no sense ------------------------------------------


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--window", "5..3"], "FROM must be before TO"),
        (["--window", "soon..later"], "neither seconds"),
        (["--window", "100..200"], "outside the run"),
        (["--window", "1..2", "--around", "worst"], "both given"),
        (["--around", "p200"], "--around"),
        (["--width", "1"], "--width 1 without --around"),
    ],
)
@pytest.mark.parametrize("cmd", ["report", "compare", "whatif", "export", "fleet"])
def test_bad_windows_are_one_line_exit_2(runs, tmp_path, cmd, args, says):
    extra = {"report": ["-o", str(tmp_path / "r.html")], "export": ["-o", str(tmp_path / "ds")],
             "fleet": ["--by", "rung"]}.get(cmd, [])  # fmt: skip
    r = CliRunner().invoke(main, [cmd, *runs, *extra, *args])
    assert r.exit_code == 2, (cmd, r.output)
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("tracekit: error:") and says in err
    assert not (tmp_path / "ds").exists() and not (tmp_path / "r.html").exists()


def test_a_wall_clock_window_on_a_run_without_a_wall_clock_start_is_refused(runs, tmp_path):
    log = load(runs[1])
    del log.meta["started_unix_s"]
    bare = str(tmp_path / "bare.npz")
    log.save(bare)
    start = float(load(runs[0]).meta["started_unix_s"])
    iso = lambda s: datetime.fromtimestamp(start + s, UTC).isoformat()  # noqa: E731
    # the first run takes the window; the second cannot place it
    r = CliRunner().invoke(main, ["compare", runs[0], bare, "--window", f"{iso(1)}..{iso(2)}"])
    assert r.exit_code == 2 and "records no wall-clock start" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args", [["--window", "1..2"], ["--around", "worst"], ["--width", "1"]])
def test_check_refuses_a_window_saying_why(runs, args):
    r = CliRunner().invoke(main, ["check", runs[0], *args])
    assert r.exit_code == 2
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "check validates whole logs and reads no gaps" in err
    assert r.stdout == ""  # refused before any log is read


@pytest.mark.parametrize(
    ("cmd", "says"),
    [("recover", "writes a whole log from its parts"), ("merge", "joins whole logs")],
)
def test_log_writing_commands_refuse_a_window_saying_why(tmp_path, cmd, says):
    args = [str(tmp_path), "-o", str(tmp_path / "out.npz"), "--window", "1..2"]
    r = CliRunner().invoke(main, [cmd, *args])
    assert r.exit_code == 2
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and f"--window: {cmd} {says}" in err
    assert not (tmp_path / "out.npz").exists()


def test_width_without_around_is_refused_everywhere(runs):
    for cmd in ("analyze", "gaps", "ttft"):
        r = CliRunner().invoke(main, [cmd, runs[0], "--width", "3"])
        assert r.exit_code == 2 and "--width 3 without --around" in r.stderr, cmd


def test_windows_travel_to_worker_processes(runs, tmp_path):
    """Each run's window is resolved where the run is read: in a worker process too."""
    for cmd in ("whatif", "compare"):
        args = [cmd, *runs, "--around", "worst", "--format", "jsonl"]
        assert invoke(*args, "-j", "2").stdout == invoke(*args).stdout, cmd
    import pandas as pd  # pandas reads the datasets back

    one, two = tmp_path / "one", tmp_path / "two"
    assert invoke("export", *runs, "--window", "1..3", "-o", str(one)).exit_code == 0
    assert invoke("export", *runs, "--window", "1..3", "-o", str(two), "-j", "2").exit_code == 0
    a, b = (pd.read_parquet(d / "gaps").sort_values(["run", "request", "t1_s"]) for d in (one, two))
    assert a.reset_index(drop=True).equals(b.reset_index(drop=True))
