"""The CLI through click's runner and one real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
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
        assert x["t1_s"] > x["t0_s"]
    r = CliRunner().invoke(main, ["gaps", p, "--format", "csv"])
    assert r.stdout.splitlines()[0].startswith("request,t0_s,t1_s,gap_ms")
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


# -- labels, hostile strings, one-line errors, exit codes --------------------------------


def _many_labels_log(n_labels: int):
    """One request, a gap per label: in gap i a segment of label `lab{i:02d}` covers 6 of
    its 8 ms, so (no other segment, eager step) that label is the gap's primary cause."""
    from logbuilder import LogBuilder

    b = LogBuilder()
    s = b.step(0, 8)
    b.emit(0, 8, s)
    for i in range(n_labels):
        t = 10 * (i + 1)
        s = b.step(t, t + 8)
        b.seg(s, f"lab{i:02d}", t + 1, t + 7)
        b.emit(0, t + 8, s)
    return b.build(config={"rung": "many"})


def test_analyze_a_run_with_40_engine_labels(tmp_path):
    """The histogram needs one glyph per primary cause; 40 engine labels whose letters are
    all taken (l, a, b, digits) ran out of the spare characters (StopIteration)."""
    p = _many_labels_log(40).save(tmp_path / "many.npz")
    r = CliRunner().invoke(main, ["analyze", p])
    assert r.exit_code == 0, r.output
    hist = r.stdout.split("ITL histogram", 1)[1].splitlines()
    legend = next(line for line in hist if line.startswith("  ("))
    pairs = [x.strip().split(" ", 1) for x in legend.strip(" ()").split(", ")]
    glyph_of = {name: g for g, name in pairs}
    assert {f"lab{i:02d}" for i in range(40)} <= set(glyph_of)
    assert len(set(glyph_of.values())) == len(glyph_of)  # distinct, one character each
    assert all(len(g) == 1 for g in glyph_of.values())


def test_glyphs_stay_distinct_for_hundreds_of_labels():
    from tracekit.labels import glyphs

    g = glyphs([f"x{i}" for i in range(200)])
    assert len(set(g.values())) == 200 and all(len(c) == 1 and c.isprintable() for c in g.values())


#: A config value that would set the terminal's title (OSC 0), inject HTML into a rendered
#: markdown page, link to script, and break a table row.
HOSTILE_RUNG = "\x1b]0;pwned\x07<script>alert(1)</script> [x](javascript:alert(1)) **b** a|c"


def test_compare_and_analyze_tables_show_config_strings_inert(tmp_path):
    from test_compare import steady_log

    paths = []
    for i, rung in enumerate(["plain", HOSTILE_RUNG]):
        p = tmp_path / f"r{i}.npz"
        steady_log(10, 10.0, config={"rung": rung, "seed": 1}).save(p)
        paths.append(str(p))
    for cmd in (["compare", *paths], ["analyze", *paths]):
        r = CliRunner().invoke(main, cmd)
        assert r.exit_code == 0, r.output
        assert "\x1b" not in r.stdout and "\x07" not in r.stdout
        assert "\\x1b]0;pwned\\x07<script>" in r.stdout  # shown, escaped
    r = CliRunner().invoke(main, ["compare", *paths, "--format", "markdown"])
    assert r.exit_code == 0, r.output
    md = r.stdout
    assert "\x1b" not in md and "<script>" not in md and "](javascript" not in md
    row = next(line for line in md.splitlines() if "pwned" in line)
    # the escaped key, by the rules of text.md_text: \x1b -> \\x1b (one_line, then the
    # backslash escaped), < > as entities, markdown specials ( [ ] ( ) * | ) backslashed
    assert row.startswith(
        "| \\\\x1b\\]0;pwned\\\\x07&lt;script&gt;alert\\(1\\)&lt;/script&gt; "
        "\\[x\\]\\(javascript:alert\\(1\\)\\) \\*\\*b\\*\\* a\\|c | 1 | "
    ), row
    assert row.count(" | ") == md.splitlines()[2].count(" | ")  # no cell split off


def test_a_newline_in_a_path_keeps_every_message_on_one_line(tmp_path):
    from tracekit.errors import one_line

    weird = tmp_path / "bad\nTraceback (most recent call last):"
    r = CliRunner().invoke(main, ["recover", str(weird)])
    assert r.exit_code == 2
    assert r.stderr.count("\n") == 1, r.stderr
    assert one_line(str(weird)) in r.stderr
    # a warning about a log whose path holds a newline
    p = tmp_path / "odd\nname.npz"
    log = _many_labels_log(2)
    from dataclasses import replace

    replace(log, meta={"warnings": ["noted at capture"]}).save(p)
    out = tmp_path / "out\nfile.jsonl"
    r = CliRunner().invoke(main, ["gaps", str(p), "-o", str(out)])
    assert r.exit_code == 0, r.output
    lines = r.stderr.splitlines()
    assert lines == [
        f"tracekit: warning: {one_line(str(p))}: noted at capture",
        f"wrote {one_line(str(out))}",
    ], lines


def test_a_reconcile_error_is_an_internal_error_with_exit_3(tmp_path, monkeypatch):
    """A partition that does not reconcile is a bug in tracekit: exit 3, and the message
    says so, where a bad input is exit 2."""
    import tracekit.analysis.workers
    from tracekit.errors import ReconcileError

    def broken(*args, **kw):
        raise ReconcileError("gap 0 of request 'r0': parts sum to 7.0 ms, the gap is 8.0 ms")

    p = _many_labels_log(2).save(tmp_path / "ok.npz")
    monkeypatch.setattr(tracekit.analysis.workers, "analyze", broken)  # analyze's worker
    r = CliRunner().invoke(main, ["analyze", p])
    assert r.exit_code == 3, r.output
    assert r.stderr.startswith("tracekit: error: internal error: gap 0 of request 'r0'")
    assert "a bug in tracekit, not in your input: please report it" in r.stderr
    assert r.stderr.count("\n") == 1
    r = CliRunner().invoke(main, ["--help"])
    assert "3  internal error" in r.stdout and "2  bad input" in r.stdout


def test_the_demo_command_is_registered_and_its_import_errors_are_not_hidden(monkeypatch):
    import sys as _sys

    r = CliRunner().invoke(main, ["demo", "--help"])
    assert r.exit_code == 0 and "ladder" in r.stdout and "run" in r.stdout
    # a broken demo_engine: reported as an internal error naming the module, not hidden
    monkeypatch.setitem(_sys.modules, "demo_engine.cli", None)  # import raises ImportError
    r = CliRunner().invoke(main, ["demo", "run", "--help"])
    assert r.exit_code == 3, r.output
    assert "internal error: ModuleNotFoundError" in r.stderr and "demo_engine.cli" in r.stderr


def test_a_missing_optional_package_says_what_to_install(monkeypatch):
    import sys as _sys

    import tracekit.cli as cli

    @cli.main.command("needs-torch")
    def needs_torch() -> None:
        import torch  # noqa: F401

    monkeypatch.setitem(_sys.modules, "torch", None)
    try:
        r = CliRunner().invoke(main, ["needs-torch"])
    finally:
        cli.main.commands.pop("needs-torch")
    assert r.exit_code == 2, r.output
    assert "pip install 'tracekit[gpu]'" in r.stderr


def test_gap_records_carry_units_in_their_keys():
    """Times are seconds from engine start (`_s`), durations milliseconds (`_ms`); steps
    and counts are plain integers (`step0`, `num_*`)."""
    from tracekit.analysis.gaps import worst_gaps

    log = _many_labels_log(3)
    (rec, *_) = worst_gaps(log, n=1)
    assert set(rec) == {"request", "t0_s", "t1_s", "gap_ms", "parts", "context", "primary",
                        "step0", "step1", "num_steps", "steps"}  # fmt: skip
    # the longest gap is one of the three 10 ms gaps between label steps: [t, t + 10] ms
    assert rec["t1_s"] - rec["t0_s"] == pytest.approx(0.010)
    assert set(rec["steps"][0]) == {"step", "t_start_s", "dur_ms", "num_decode",
                                    "num_prefill_tokens", "graph_size", "num_preempted",
                                    "num_swapped_in", "segments_ms"}  # fmt: skip


def test_every_command_that_loads_a_log_offers_the_reading_limits():
    for cmd in ("analyze", "gaps", "check", "compare", "report", "trace", "recover"):
        r = CliRunner().invoke(main, [cmd, "--help"])
        assert r.exit_code == 0, r.output
        assert "--max-inflate-mb" in r.stdout and "--max-label-chars" in r.stdout, cmd
