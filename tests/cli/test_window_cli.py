"""`--window`, `--around` and `analyze --by` on the command line (docs/reports.md,
"Windows" and "The tail over time"), through click's runner."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tracekit.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from synthlog import synthetic_log  # noqa: E402

START_UNIX_S = 1764892800.0  # 2025-12-05T00:00:00 UTC


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    log = synthetic_log(seed=2, duration_s=4.0, rate_per_s=15.0)
    log.meta["started_unix_s"] = START_UNIX_S
    path = tmp_path_factory.mktemp("win") / "run.npz"
    log.save(str(path))
    return str(path)


def invoke(*args):
    return CliRunner().invoke(main, [*args], catch_exceptions=False)


def jsonl(text):
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def test_gaps_window_are_the_whole_runs_gaps_ending_in_it(run):
    whole = jsonl(invoke("gaps", run, "--format", "jsonl").stdout)
    r = invoke("gaps", run, "--format", "jsonl", "--window", "1..2.5")
    assert r.exit_code == 0
    assert jsonl(r.stdout) == [g for g in whole if 1.0 <= g["t1_s"] < 2.5]
    assert "window 1..2.5 s from engine start" in r.stderr
    # the same window as wall-clock times (UTC)
    r2 = invoke("gaps", run, "--format", "jsonl", "--window",
                "2025-12-05T00:00:01..2025-12-05T00:00:02.5")  # fmt: skip
    assert jsonl(r2.stdout) == jsonl(r.stdout)
    # open ends
    r3 = invoke("gaps", run, "--format", "jsonl", "--window", "..1")
    assert jsonl(r3.stdout) == [g for g in whole if g["t1_s"] < 1.0]


def test_ttft_window_keeps_the_first_tokens_in_it(run):
    whole = jsonl(invoke("ttft", run, "--format", "jsonl").stdout)
    r = invoke("ttft", run, "--format", "jsonl", "--window", "2..")
    assert r.exit_code == 0
    assert jsonl(r.stdout) == [t for t in whole if t["first_token"] >= 2.0]


def test_analyze_window_says_which_and_keeps_per_run_figures(run):
    whole = jsonl(invoke("analyze", run, "--format", "jsonl").stdout)[0]
    r = invoke("analyze", run, "--format", "jsonl", "--window", "1..2")
    a = jsonl(r.stdout)[0]
    gaps = jsonl(invoke("gaps", run, "--format", "jsonl", "--window", "1..2").stdout)
    assert a["gaps"] == len(gaps)
    assert a["window"] == {"from_s": 1.0, "to_s": 2.0, "how": "--window 1..2"}
    assert (a["requests"], a["steps"], a["gc_counts"]) == (
        whole["requests"], whole["steps"], whole["gc_counts"])  # fmt: skip
    table = invoke("analyze", run, "--window", "1..2").stdout
    assert table.startswith("run.npz: window 1..2 s from engine start (--window 1..2)")


def test_around_worst_holds_the_worst_gap(run):
    whole = jsonl(invoke("gaps", run, "--format", "jsonl").stdout)
    worst = max(whole, key=lambda g: g["gap_ms"])
    r = invoke("gaps", run, "--format", "jsonl", "--around", "worst", "--width", "0.5")
    got = jsonl(r.stdout)
    assert worst in got
    t = worst["t1_s"]
    assert got == [g for g in whole if t - 0.25 <= g["t1_s"] < t + 0.25]
    assert "--around worst" in r.stderr


def test_trace_window_is_smaller_and_holds_the_gaps_ending_in_it(run, tmp_path):
    full, cut = tmp_path / "full.json.gz", tmp_path / "cut.json.gz"
    assert invoke("trace", run, "-o", str(full)).exit_code == 0
    assert invoke("trace", run, "-o", str(cut), "--window", "1..1.5").exit_code == 0
    ev_full = json.loads(gzip.decompress(full.read_bytes()))["traceEvents"]
    ev_cut = json.loads(gzip.decompress(cut.read_bytes()))["traceEvents"]
    assert len(ev_cut) < len(ev_full) / 3
    gaps = jsonl(invoke("gaps", run, "--format", "jsonl", "--window", "1..1.5").stdout)
    # every gap ending in the window is in the trace, by its gap_ms
    traced = {round(e["args"]["gap_ms"], 6) for e in ev_cut if "gap_ms" in e.get("args", {})}
    assert {round(g["gap_ms"], 6) for g in gaps} <= traced


def test_by_buckets_in_every_format(run, tmp_path):
    rows = jsonl(invoke("analyze", run, "--by", "1s", "--format", "jsonl").stdout)
    whole = jsonl(invoke("gaps", run, "--format", "jsonl").stdout)
    assert [r["bucket_start_s"] for r in rows] == [0.0, 1.0, 2.0, 3.0, 4.0][: len(rows)]
    for r in rows:
        assert r["gaps"] == sum(r["bucket_start_s"] <= g["t1_s"] < r["bucket_end_s"] for g in whole)
    assert sum(r["gaps"] for r in rows) == len(whole)
    table = invoke("analyze", run, "--by", "1s").stdout
    assert table.splitlines()[0].split()[:4] == ["run", "from", "s", "to"]
    out = tmp_path / "by.parquet"
    assert (
        invoke("analyze", run, "--by", "1s", "--format", "parquet", "-o", str(out)).exit_code == 0
    )
    import pandas as pd  # pandas only for this format

    df = pd.read_parquet(out)
    assert df["gaps"].tolist() == [r["gaps"] for r in rows]
    assert "tail_share.gc" in df.columns


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--window", "5..3"], "FROM must be before TO"),
        (["--window", "soon..later"], "neither seconds"),
        (["--window", "100..200"], "outside the run"),
        (["--window", "1..2", "--around", "worst"], "both given"),
        (["--around", "p200"], "--around"),
    ],
)
def test_bad_windows_are_one_line_exit_2(run, args, says):
    for cmd in ("analyze", "gaps", "ttft"):
        r = CliRunner().invoke(main, [cmd, run, *args])
        assert r.exit_code == 2, (cmd, r.output)
        err = r.stderr.strip()
        assert len(err.splitlines()) == 1 and err.startswith("tracekit: error:") and says in err


def test_bad_by_is_exit_2(run):
    r = CliRunner().invoke(main, ["analyze", run, "--by", "1w"])
    assert r.exit_code == 2 and "--by '1w'" in r.stderr


@pytest.mark.parametrize("extra", [(), ("--window", "1..3")])
def test_a_by_finer_than_the_bucket_limit_is_refused_in_one_line(run, extra):
    """More than 100,000 buckets (docs/reports.md): 1 us over this 4 s run would be ~4 M
    (over the 2 s window, ~2 M) rows; refused, naming the run and the narrowest width."""
    r = CliRunner().invoke(main, ["analyze", run, "--by", "1e-6", *extra])
    err = r.stderr.strip()
    assert r.exit_code == 2 and r.stdout == "" and len(err.splitlines()) == 1, r.output
    assert run in err and "--by 1e-06 s" in err and "at most 100,000" in err


def test_window_and_by_travel_to_worker_processes(run):
    one = invoke("analyze", run, run, "--window", "1..2", "--format", "jsonl").stdout
    two = invoke("analyze", run, run, "--window", "1..2", "--format", "jsonl", "-j", "2").stdout
    assert one == two and len(jsonl(two)) == 2
    by1 = invoke("analyze", run, run, "--by", "1s", "--format", "jsonl").stdout
    assert invoke("analyze", run, run, "--by", "1s", "--format", "jsonl", "-j", "2").stdout == by1
