"""The HTML report of a long run: ITL percentiles and the tail's cause mix over time, and
the worst windows with the command that drills into each (docs/reports.md, "The tail over
time")."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tracekit.analysis.overtime import REPORT_MIN_BUCKETS, report_width_s
from tracekit.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from browser import chromium_path, open_page  # noqa: E402
from synthlog import synthetic_log  # noqa: E402


@pytest.fixture(scope="module")
def long_report(tmp_path_factory):
    d = tmp_path_factory.mktemp("long")
    paths = []
    for seed, rung in ((1, "baseline"), (2, "fix")):
        p = d / f"{rung}.npz"
        synthetic_log(seed=seed, rung=rung, duration_s=15.0, rate_per_s=10.0).save(str(p))
        paths.append(str(p))
    out = d / "report.html"
    r = CliRunner().invoke(main, ["report", *paths, "-o", str(out)], catch_exceptions=False)
    assert r.exit_code == 0
    return paths, out


def test_width_is_the_smallest_nice_one_with_at_most_60_buckets():
    assert report_width_s(synthetic_log(seed=1, duration_s=15.0)) == 1.0  # 16 buckets
    assert report_width_s(synthetic_log(seed=1, duration_s=70.0)) == 2.0  # 71 s / 1 > 60


def test_a_short_run_has_no_over_time_view(tmp_path):
    p = tmp_path / "short.npz"
    synthetic_log(seed=1, duration_s=REPORT_MIN_BUCKETS * 0.5).save(str(p))
    out = tmp_path / "r.html"
    CliRunner().invoke(main, ["report", str(p), "-o", str(out)], catch_exceptions=False)
    assert "tk-over-time" not in out.read_text()


def test_each_worst_window_command_runs_and_shows_that_buckets_gaps(long_report):
    paths, out = long_report
    page = out.read_text()
    cmds = re.findall(r"<code>(tracekit analyze [^<]*)</code>", page)
    assert len(cmds) == 10  # five per run
    for cmd in (cmds[0], cmds[5]):
        args = shlex.split(cmd.replace("&#x27;", "'"))[1:]
        r = CliRunner().invoke(main, [*args, "--format", "jsonl"], catch_exceptions=False)
        assert r.exit_code == 0
        a = json.loads(r.stdout)
        lo, hi = (float(x) for x in args[-1].split(".."))
        rows = json.loads(
            CliRunner()
            .invoke(
                main,
                [
                    "analyze",
                    args[1],
                    "--by",
                    f"{hi - lo:g}s",
                    "--format",
                    "jsonl",
                    "--window",
                    args[-1],
                ],
            )  # fmt: skip
            .stdout.splitlines()[0]
        )
        assert a["gaps"] == rows["gaps"] and a["itl_p999"] == pytest.approx(rows["itl_p999"])
    # the first listed window of a run is its bucket with the highest p99.9
    by = CliRunner().invoke(main, ["analyze", paths[0], "--by", "1s", "--format", "jsonl"])
    worst = max(json.loads(x)["itl_p999"] or 0 for x in by.stdout.splitlines())
    first = shlex.split(cmds[0])[-1]
    a = json.loads(
        CliRunner()
        .invoke(main, ["analyze", paths[0], "--window", first, "--format", "jsonl"])
        .stdout
    )
    assert a["itl_p999"] == pytest.approx(worst)


@pytest.mark.skipif(chromium_path() is None, reason="chromium is not installed")
def test_the_over_time_charts_draw_in_headless_chromium(long_report):
    _, out = long_report
    probe = """JSON.stringify(Array.from(document.querySelectorAll('.chart')).map(d => [
        d.id, d.querySelectorAll('.main-svg').length,
        d.querySelectorAll('.point, .bars path').length]))"""
    ready = "document.body && document.body.getAttribute('data-charts')"
    page = open_page(out.as_uri(), ready=ready, expression=probe, width=1000, timeout_s=25)
    assert page.console_errors == [] and page.exceptions == []
    drawn = {d[0]: d[1:] for d in json.loads(page.value)}
    # 16 one-second buckets of the first run: 3 percentiles each, and stacked tail bars
    assert drawn["tk-over-time"][0] >= 1 and drawn["tk-over-time"][1] >= 3 * 15
    assert drawn["tk-tail-mix"][0] >= 1 and drawn["tk-tail-mix"][1] >= 15
