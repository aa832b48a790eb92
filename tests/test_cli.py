"""The CLI through click's runner and one real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

from click.testing import CliRunner
from test_rawlog import sample_log

from tracekit.cli import main

KEYS = """rung seed requests tokens gaps tok_per_s itl_p50 itl_p90 itl_p99 itl_p999 itl_max
ttft_p50 ttft_p99 tail_share all_share tail_count fwd_share_clean_median fwd_share_tail_median
evicted_context_ms reconcile_max_err_ms skipped_steps_without_eviction preemptions
eager_steps gc_counts gen2_serving_ms gen2_startup_ms hist""".split()
LABELS = {"preempt", "gc", "tok", "prefill", "graph", "forward", "residual"}


def test_analyze_jsonl_has_every_figure(tmp_path):
    p1 = sample_log().save(tmp_path / "a.npz")
    p2 = sample_log().save(tmp_path / "b.npz")
    r = CliRunner().invoke(main, ["analyze", p1, p2, "--format", "jsonl", "--jobs", "2"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert set(KEYS) <= set(row)
        assert LABELS <= set(row["tail_share"]) and LABELS <= set(row["all_share"])
        assert row["rung"] == "baseline" and row["seed"] == 1
        assert row["hist"][-1]["hi_ms"] is None  # inf as JSON null


def test_analyze_table_and_parquet(tmp_path):
    p = sample_log().save(tmp_path / "a.npz")
    r = CliRunner().invoke(main, ["analyze", p])
    assert r.exit_code == 0 and "Where tail time went" in r.stdout and "ITL histogram" in r.stdout
    out = tmp_path / "a.parquet"
    r = CliRunner().invoke(main, ["analyze", p, "--format", "parquet", "-o", str(out)])
    assert r.exit_code == 0
    import pandas as pd

    df = pd.read_parquet(out)
    assert df.loc[0, "itl_p99"] > 0 and "tail_share.preempt" in df.columns


def test_gaps_filters_and_formats(tmp_path):
    p = sample_log().save(tmp_path / "a.npz")
    r = CliRunner().invoke(main, ["gaps", p, "--min-ms", "14", "--request", "r1"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    assert rows and all(x["request"] == "r1" and x["gap_ms"] >= 14 for x in rows)
    for x in rows:
        assert abs(sum(x["parts"].values()) - x["gap_ms"]) < 1e-9
        assert x["t1"] > x["t0"]
    r = CliRunner().invoke(main, ["gaps", p, "--format", "csv"])
    assert r.stdout.splitlines()[0].startswith("request,t0,t1,gap_ms")
    r = CliRunner().invoke(main, ["gaps", p, "--request", "nope"])
    assert r.exit_code == 2 and "no request with id 'nope'" in r.stderr


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_text("not a log")
    proc = subprocess.run(
        [sys.executable, "-m", "tracekit", "analyze", str(bad)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and str(bad) in proc.stderr
    assert "Traceback" not in proc.stderr
    r = CliRunner().invoke(main, ["check", str(bad), sample_log().save(tmp_path / "ok.npz")])
    assert r.exit_code == 2 and "BAD" in r.stdout and "ok " in r.stdout


def test_help_explains():
    r = CliRunner().invoke(main, ["analyze", "--help"])
    assert r.exit_code == 0 and "tail time" in r.stdout


def test_histogram_glyphs_are_distinct_for_engine_labels():
    from tracekit.labels import glyphs

    g = glyphs(["clean", "preempt", "prefill", "sample", "schedule", "sync", "s", "update"])
    assert len(set(g.values())) == len(g)
    assert g["preempt"] == "S" and g["prefill"] == "P" and g["s"] == "s" and g["sample"] == "a"


def test_a_bad_file_among_parallel_jobs_is_still_one_line(tmp_path):
    good = sample_log().save(tmp_path / "ok.npz")
    proc = subprocess.run(
        [sys.executable, "-m", "tracekit", "analyze", good, str(tmp_path / "missing.npz"),
         "--jobs", "2"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert (
        proc.stderr.strip() == f"tracekit: error: {tmp_path / 'missing.npz'}: file: does not exist"
    )
