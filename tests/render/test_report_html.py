"""The HTML report: renders in a real headless Chromium with no console error and no
request beyond the file itself, every chart drawn (the ITL-over-time chart among them),
the verdict and the grouped worst stalls on the page; byte-identical twice; everything
that comes from a log escaped."""

from __future__ import annotations

from dataclasses import replace

import pytest
from browser import chromium_path, open_page
from click.testing import CliRunner
from synthlog import synthetic_log

from tracekit.analysis.compare import compare
from tracekit.analysis.figures import analyze
from tracekit.analysis.gaps import itl_series, worst_gaps, worst_stalls
from tracekit.analysis.verdict import verdict
from tracekit.attribution.itl import partition
from tracekit.cli import main
from tracekit.render.html import ReportRun, log_ticks, render_report, script_json

EVIL = "<script>alert(1)</script>"
EVIL_ID = '"><img src=x onerror=alert(2)>'


def evil_log(seed: int, rung: str):
    """A run whose label, config value and request id are all HTML."""
    log = synthetic_log(duration_s=2.0, seed=seed, rung=rung, extra_label=EVIL)
    ids = list(log.request_ids)
    ids[0] = EVIL_ID
    return replace(log, request_ids=tuple(ids), config={**log.config, "note": EVIL})


@pytest.fixture(scope="module")
def raw_runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("raw")
    paths = []
    for rung in ("baseline", f"+fix {EVIL}"):
        for seed in (1, 2):
            p = d / f"{'fix' if 'fix' in rung else 'base'}-{seed}.npz"
            evil_log(seed, rung).save(p)
            paths.append(str(p))
    return paths


@pytest.fixture(scope="module")
def report_path(raw_runs, tmp_path_factory):
    out = tmp_path_factory.mktemp("html") / "report.html"
    res = CliRunner().invoke(main, ["report", *raw_runs, "-o", str(out), "--worst", "5"])
    assert res.exit_code == 0, res.output
    return out


def stub_page(runs_paths) -> str:
    """The page with a stub instead of plotly.js, so it is all ours to inspect."""
    from tracekit.log.reader import load

    runs = []
    for p in runs_paths:
        log = load(p)
        part = partition(log)
        runs.append(
            ReportRun(analyze(log, part), worst_stalls(log, part, 5), itl_series(log, part))
        )
    cmp = compare([r.analysis for r in runs])
    return render_report(runs, cmp, verdict(cmp), plotly_js="/*plotly*/")


def test_same_input_gives_byte_identical_html(raw_runs, report_path, tmp_path):
    again = tmp_path / "again.html"
    res = CliRunner().invoke(main, ["report", *raw_runs, "-o", str(again), "--worst", "5"])
    assert res.exit_code == 0, res.output
    assert again.read_bytes() == report_path.read_bytes()


def test_everything_from_a_log_is_escaped(raw_runs):
    page = stub_page(raw_runs)
    # only our own four script elements: nothing from a log opens or closes one
    assert page.count("<script") == 4 and page.count("</script") == 4
    assert EVIL not in page and "<img" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page  # in tables, as text
    assert "onerror=alert(2)&gt;" in page  # the request id, in the worst-stalls table
    figures = page.split('id="tk-figures">')[1].split("</script>")[0]
    assert "<" not in figures and ">" not in figures and "&" not in figures
    assert "\\u0026lt;script\\u0026gt;" in figures  # chart text: HTML-, then JSON-escaped
    low = page.lower()
    assert "http://" not in low and "https://" not in low and "mathjax" not in low
    assert "<link" not in low and " src=" not in low.replace("src=x", "")


def test_script_json_cannot_close_a_script():
    s = script_json({"a": "</script><!--", "b": float("nan"), "c": "\u2028&"})
    assert "<" not in s and ">" not in s and "&" not in s and "\u2028" not in s
    assert '"b":null' in s


@pytest.mark.skipif(
    chromium_path() is None,
    reason="chromium is not installed (apt-get install -y chromium); the report is not opened",
)
def test_report_renders_in_headless_chromium(report_path):
    probe = """JSON.stringify({
      charts: Array.from(document.querySelectorAll('.chart')).map(d => [d.id,
        d.querySelectorAll('.main-svg').length,
        d.querySelectorAll('.point, .bars path, .trace').length]),
      verdict: Array.from(document.querySelectorAll('#tk-verdict ul.verdict li'))
        .map(li => li.textContent),
      whatifRows: document.querySelectorAll('#tk-whatif table tbody tr').length,
      timePoints: document.querySelectorAll('#tk-itl-time .scatterlayer .point').length,
      stallRows: Array.from(document.querySelectorAll('table.worst > tbody > tr'))
        .map(tr => tr.children[3].textContent),
      width: document.documentElement.scrollWidth})"""
    page = open_page(
        report_path.as_uri(),
        ready="document.body && document.body.getAttribute('data-charts')",
        expression=probe,
        width=1000,
        timeout_s=25,
    )
    assert page.console_errors == [] and page.exceptions == []
    assert page.requests == [report_path.as_uri()], "the report must load nothing else"
    import json

    got = json.loads(page.value)
    drawn = got["charts"]
    assert [d[0] for d in drawn] == [
        "tk-itl-time", "tk-hist", "tk-tail", "tk-ladder", "tk-fwd", "tk-ttft", "tk-ttft-causes"
    ]  # fmt: skip
    for div, svgs, marks in drawn:
        assert svgs >= 1 and marks >= 1, (div, svgs, marks)
    # the verdict: what to fix first (docs/whatif.md), the first group's diagnosis, then what
    # the second group changed; the what-if section's tables under it
    assert len(got["verdict"]) == 3
    assert got["verdict"][0].startswith("What to fix first in baseline: ")
    assert got["verdict"][1].startswith("baseline: ") and "of tail time" in got["verdict"][1]
    # (the two synthetic groups' p99.9 may print alike: "left median p99.9 at ...")
    assert got["verdict"][2].startswith("+fix ") and "median p99.9" in got["verdict"][2]
    assert got["whatifRows"] > 0
    assert got["timePoints"] > 100  # every gap of the first run is a point (a 2 s run)
    # worst stalls: one row per event; at least one event hit several requests at once
    hits = [int(t.split(":")[0]) for t in got["stallRows"]]
    assert hits and max(hits) > 1
    assert got["width"] <= 1000  # the layout fits a 1000 px window


def test_log_axis_ticks_are_full_numbers():
    # 1-2-5 steps between 3 and 1500, each labelled with its whole value
    t = log_ticks(3, 1500)
    assert t["tickvals"] == [5, 10, 20, 50, 100, 200, 500, 1000]
    assert t["ticktext"] == ["5", "10", "20", "50", "100", "200", "500", "1,000"]
    # over a wide range only the powers of ten stay
    assert log_ticks(1, 1e6)["tickvals"] == [1, 10, 100, 1000, 1e4, 1e5, 1e6]


def test_a_run_without_gaps_still_renders():
    from logbuilder import LogBuilder

    b = LogBuilder()
    b.step(0, 10, n_decode=0, graph=-1)
    log = b.build(config={"rung": "empty"})
    a = analyze(log)
    page = render_report([ReportRun(a, worst_gaps(log, None, 5))], compare([a]), plotly_js="")
    assert "no gaps" in page and 'id="tk-hist"' in page
    cmp = compare([a])
    page = render_report(
        [ReportRun(a, worst_stalls(log, None, 5), itl_series(log))], cmp, verdict(cmp),
        plotly_js="",
    )  # fmt: skip
    assert "no gaps" in page and 'id="tk-hist"' in page


def test_the_os_causes_show_like_any_other_cause():
    """A run whose loop thread waited on the run queue (OS samples at its step ends): the
    report's histogram, tail-share and TTFT-cause figures name os_runqueue, in its colour."""
    import json

    from logbuilder import LogBuilder

    from tracekit.labels import colour
    from tracekit.log.rawlog import OS_STEP_END, OS_STEP_START

    b = LogBuilder()
    cpu = runq = 0.0
    for s in range(6):  # steps [10 s, 10 s + 10]: half of each the thread waited for a CPU
        b.step(10 * s, 10 * s + 10)
        b.seg(s, "decode", 10 * s, 10 * s + 10)
        b.os_sample(10 * s, cpu, runq, kind=OS_STEP_START)
        cpu, runq = cpu + 5, runq + 5
        b.os_sample(10 * s + 10, cpu, runq, kind=OS_STEP_END)
        for r in range(2):
            b.emit(r, 10 * s + 10, s)
    for r in range(2):
        b.admit(r, 0)
    log = b.build(config={"rung": "busy"}, arrivals_ms=[0, 0])
    part = partition(log)
    a = analyze(log, part)
    assert a.tail_count.get("os_runqueue", 0) > 0  # half of every gap: its primary cause
    cmp = compare([a])
    page = render_report(
        [ReportRun(a, worst_stalls(log, part, 5), itl_series(log, part))], cmp, verdict(cmp),
        plotly_js="",
    )  # fmt: skip
    start = page.index('id="tk-figures">') + len('id="tk-figures">')
    figs = json.loads(page[start : page.index("</script>", start)])
    names = {
        t.get("name")
        for f in (figs.values() if isinstance(figs, dict) else figs)
        for t in (f.get("data", []) if isinstance(f, dict) else [])
        if isinstance(t, dict)
    }
    assert "os_runqueue" in names, sorted(n for n in names if n)
    assert colour("os_runqueue") in page


@pytest.mark.skipif(chromium_path() is None, reason="needs a headless Chromium")
def test_the_ladder_table_fits_the_page_at_1280_px(tmp_path):
    """A two-seed ladder with long rung names: the "Predicted against the ladder" table fits
    the page's width (its rung column wraps) instead of hiding its last columns."""
    paths = []
    rungs = [("baseline with a long name", None), ("+gc.freeze and its long name", "gc"),
             ("+tokenizer off the loop, long", "tok")]  # fmt: skip
    for i, (rung, fixes) in enumerate(rungs):
        for seed in (1, 2):
            log = synthetic_log(duration_s=1.0, seed=seed + 10 * i, rung=rung)
            cfg = {**log.config, "rung_index": i, "seed": seed}
            if fixes:
                cfg["fixes"] = fixes
            p = tmp_path / f"r{i}-{seed}.npz"
            replace(log, config=cfg).save(p)
            paths.append(str(p))
    out = tmp_path / "ladder.html"
    res = CliRunner().invoke(main, ["report", *paths, "--order-by", "rung_index", "-o", str(out)])
    assert res.exit_code == 0, res.output
    probe = """JSON.stringify(Array.from(document.querySelectorAll('#tk-whatif .tw'))
      .map(d => [d.querySelector('table').className, d.scrollWidth, d.clientWidth]))"""
    page = open_page(out.as_uri(), ready="document.body && document.body.getAttribute('data-charts')",
                     expression=probe, width=1280, timeout_s=25)  # fmt: skip
    import json

    boxes = json.loads(page.value)
    assert any(cls == "ladder" for cls, _, _ in boxes), boxes
    assert all(sw <= cw for _, sw, cw in boxes), boxes
