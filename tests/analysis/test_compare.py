"""Cross-run comparison: grouping, medians across runs (never pooled gaps), rendering, CLI."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner
from logbuilder import LogBuilder

from tracekit.analysis.compare import MISSING, Spread, compare, config_value, group_key
from tracekit.analysis.figures import analyze
from tracekit.cli import main
from tracekit.render import text


def steady_log(n_gaps: int, gap_ms: float, *, config: dict) -> LogBuilder:
    """One request emitting every `gap_ms`, one decode step per token."""
    b = LogBuilder()
    for i in range(n_gaps + 1):
        t0, t1 = i * gap_ms, (i + 1) * gap_ms
        s = b.step(t0, t1)
        b.seg(s, "decode", t0, t1 - 0.5)
        b.emit(0, t1 - 0.5, s)
    return b.build(config=config)


@pytest.fixture(scope="module")
def base():
    return analyze(steady_log(20, 10.0, config={"rung": "baseline", "seed": 1}))


def with_figures(base, **kw):
    return replace(base, **kw)


def test_spread_is_median_min_max_of_finite_values():
    s = Spread.of([3.0, 1.0, math.nan, 10.0])
    assert (s.median, s.lo, s.hi, s.num_runs) == (3.0, 1.0, 10.0, 3)
    assert Spread.of([math.nan]).num_runs == 0
    assert text.spread_cell(Spread.of([10.5, 13.7, 16.0])) == "13.7 [10.5-16.0]"
    assert text.spread_cell(Spread.of([149, 950, 7395]), 0) == "950 [149-7395]"
    assert text.spread_cell(Spread.of([])) == "-"


def test_groups_in_order_of_first_appearance(base):
    runs = [
        with_figures(base, config={"rung": r, "seed": s}, rung=r, path=f"{r}-{s}")
        for r, s in [("b", 1), ("a", 1), ("b", 2), ("c", 1), ("a", 2)]
    ]
    cmp = compare(runs)
    assert [g.key for g in cmp.groups] == ["b", "a", "c"]
    assert [g.paths for g in cmp.groups] == [("b-1", "b-2"), ("a-1", "a-2"), ("c-1",)]
    by_seed = compare(runs, by="seed")
    assert [g.key for g in by_seed.groups] == ["1", "2"]
    assert [g.num_runs for g in by_seed.groups] == [3, 2]


def test_order_by_a_config_key(base):
    runs = [
        with_figures(base, config={"rung": r, "rung_index": i}, rung=r, path=f"{r}-{k}")
        for k, (r, i) in enumerate([("c", 2), ("a", 0), ("b", 1), ("a", 0), ("x", None)])
    ]
    assert [g.key for g in compare(runs).groups] == ["c", "a", "b", "x"]
    by_index = compare(runs, order_by="rung_index")
    assert [g.key for g in by_index.groups] == ["a", "b", "c", "x"]  # missing key last
    assert by_index.groups[0].paths == ("a-1", "a-3")


def test_dotted_and_missing_keys(base):
    cfg = {"rung": "x", "engine": {"block_size": 16, "graphs": [1, 2]}, "a.b": "verbatim"}
    assert config_value(cfg, "engine.block_size") == 16
    assert config_value(cfg, "a.b") == "verbatim"
    assert config_value(cfg, "engine.nope") is None
    run = with_figures(base, config=cfg)
    assert group_key(run, "engine.block_size") == "16"
    assert group_key(run, "engine.graphs") == "[1,2]"
    assert group_key(run, "nope") == MISSING


def test_median_across_runs_not_pooled_gaps():
    """Two runs of one rung: 400 gaps of 10 ms and 40 gaps of 100 ms. Pooled, p99 would be
    100 ms and p50 10 ms; across runs the median is the middle of the two runs' figures."""
    cfg = {"rung": "r"}
    a = analyze(steady_log(400, 10.0, config=cfg))
    b = analyze(steady_log(40, 100.0, config=cfg))
    g = compare([a, b]).groups[0]
    assert g.figures["itl_p99"].median == pytest.approx((a.itl_p99 + b.itl_p99) / 2)
    assert g.figures["itl_p50"].median == pytest.approx(55.0)
    assert (g.figures["itl_p50"].lo, g.figures["itl_p50"].hi) == pytest.approx((10.0, 100.0))
    pooled = np.percentile(np.r_[np.full(400, 10.0), np.full(40, 100.0)], 50)
    assert pooled == pytest.approx(10.0) and g.figures["itl_p50"].median != pytest.approx(pooled)


def test_tail_share_is_the_median_per_label(base):
    labels = base.labels
    shares = [{lb: 0.0 for lb in labels} for _ in range(3)]
    for s, v in zip(shares, [0.2, 0.6, 0.9], strict=True):
        s["preempt"], s["forward"] = v, 1 - v
    runs = [with_figures(base, tail_share=s) for s in shares]
    g = compare(runs).groups[0]
    assert g.tail_share["preempt"] == pytest.approx(0.6)
    assert g.tail_share["forward"] == pytest.approx(0.4)


def test_table_and_markdown_render_like_the_fix_ladder(base):
    runs = [
        with_figures(base, config={"rung": "baseline"}, itl_p50=v, itl_p999=w)
        for v, w in [(10.5, 149.0), (13.7, 950.0), (16.0, 7395.0)]
    ] + [with_figures(base, config={"rung": "+a|b"}, itl_p50=12.0, itl_p999=50.0)]
    cmp = compare(runs)
    out = text.comparison(cmp)
    assert out.startswith("FIX LADDER")
    assert "13.7 [10.5-16.0]" in out
    assert "950 [149-7395]" in out  # the p99.9 column reaches 100: whole numbers throughout
    assert "50 [50-50]" in out
    md = text.comparison_markdown(cmp)
    assert "| baseline | 3 | 13.7 [10.5-16.0] |" in md
    assert "+a\\|b" in md  # a pipe in a config value cannot break the table
    rec = cmp.to_records()[0]
    assert rec["group"] == "baseline" and rec["runs"] == 3
    assert rec["itl_p50"] == {"median": 13.7, "min": 10.5, "max": 16.0, "runs": 3}
    json.dumps(cmp.to_records())


def test_cli_compare(tmp_path):
    paths = []
    for rung, seed, gap in [("base", 1, 10.0), ("fix", 1, 8.0), ("base", 2, 12.0)]:
        p = tmp_path / f"{rung}-{seed}.npz"
        steady_log(30, gap, config={"rung": rung, "seed": seed}).save(p)
        paths.append(str(p))
    runner = CliRunner()
    res = runner.invoke(main, ["compare", *paths])
    assert res.exit_code == 0, res.output
    assert "FIX LADDER" in res.output and "MEDIAN TAIL-TIME SHARE PER RUNG" in res.output
    lines = res.stdout.splitlines()
    assert lines[0].startswith("FIX LADDER") and lines[1].startswith("rung")
    assert lines[3].startswith("base") and lines[4].startswith("fix")
    res = runner.invoke(main, ["compare", *paths, "--by", "seed", "--format", "jsonl"])
    assert res.exit_code == 0, res.output
    recs = [json.loads(line) for line in res.stdout.splitlines()]
    assert [(r["group"], r["runs"]) for r in recs] == [("1", 2), ("2", 1)]
    res = runner.invoke(main, ["compare", *paths, "--format", "markdown"])
    assert res.exit_code == 0 and "|:---|" in res.output
    res = runner.invoke(main, ["compare", str(tmp_path / "missing.npz")])
    assert res.exit_code == 2 and "does not exist" in res.output
