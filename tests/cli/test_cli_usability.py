"""No silent no-ops in the CLI: each case that used to do nothing (or something else than
asked) without a word now says what happened, or is a one-line error with exit code 2."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys

from click.testing import CliRunner
from logbuilder import LogBuilder
from procs import env, run_cli, tracekit_cmd

from tracekit.cli import main

CONFIG = {"rung": "baseline", "rung_index": 0, "seed": 1, "engine": {"block_size": 16}}


def tiny_log(tmp_path, name="run.npz"):
    """One request, emissions at 10, 22 and 50 ms: gaps of 12 and 28 ms, so the run's
    longest gap is 28.0 ms and the run spans 0-50 ms (its steps)."""
    b = LogBuilder()
    for t0, t1 in ((0, 10), (10, 22), (22, 50)):
        s = b.step(t0, t1)
        b.seg(s, "decode", t0, t1)
        b.emit(0, t1, s)
    path = tmp_path / name
    b.build(config=CONFIG).save(path)
    return str(path)


def test_gaps_min_ms_with_nothing_above_says_so_with_the_runs_max(tmp_path):
    p = tiny_log(tmp_path)
    r = CliRunner().invoke(main, ["gaps", p, "--min-ms", "100", "--format", "jsonl"])
    assert r.exit_code == 0 and r.stdout == ""
    assert "no gap at least 100 ms long" in r.stderr
    assert "the run's longest gap: 28.0 ms" in r.stderr  # 50 - 22, by construction
    r = CliRunner().invoke(main, ["gaps", p, "--min-ms", "20", "--format", "jsonl"])
    assert [round(json.loads(x)["gap_ms"], 6) for x in r.stdout.splitlines()] == [28.0]
    assert r.stderr == ""


def test_unknown_order_by_and_by_keys_are_errors_listing_the_keys(tmp_path):
    p = tiny_log(tmp_path)
    report = ["report", p, "--order-by", "rung_idx", "-o", str(tmp_path / "r.html")]
    for cmd in (["compare", p, "--order-by", "rung_idx"], ["compare", p, "--by", "nope"], report):
        r = CliRunner().invoke(main, cmd)
        assert r.exit_code == 2, (cmd, r.output)
        line = r.stderr.strip()
        assert "\n" not in line and "no run's config has this key" in line
        # the keys this run has, nested ones as name.KEY
        assert "keys: engine.KEY, rung, rung_index, seed" in line
    assert not (tmp_path / "r.html").exists()
    assert "rung_index" in CliRunner().invoke(main, ["compare", "--help"]).stdout
    assert "rung_index" in CliRunner().invoke(main, ["report", "--help"]).stdout
    ok = CliRunner().invoke(main, ["compare", p, "--order-by", "engine.block_size"])
    assert ok.exit_code == 0, ok.output


def test_trace_window_outside_the_run_names_the_runs_span(tmp_path):
    p = tiny_log(tmp_path)
    out = tmp_path / "t.json"
    r = CliRunner().invoke(main, ["trace", p, "-o", str(out), "--window", "5:6"])
    assert r.exit_code == 2 and not out.exists()
    assert "outside the run, which spans 0.000-0.050 s" in r.stderr
    r = CliRunner().invoke(main, ["trace", p, "-o", str(out), "--window", "0.02:"])
    assert r.exit_code == 0 and out.exists()


def test_report_into_a_missing_directory_is_one_line_naming_it(tmp_path):
    p = tiny_log(tmp_path)
    target = tmp_path / "no" / "such" / "r.html"
    r = CliRunner().invoke(main, ["report", p, "-o", str(target)])
    assert r.exit_code == 2
    assert r.stderr.count("\n") == 1 and str(target.parent) in r.stderr


def test_gaps_prints_a_table_on_a_terminal(tmp_path):
    p = tiny_log(tmp_path)
    master, slave = pty.openpty()
    proc = subprocess.Popen([*tracekit_cmd(), "gaps", p], stdout=slave, stderr=subprocess.PIPE,
                            env=env())  # fmt: skip
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    assert proc.wait(timeout=60) == 0, proc.stderr.read() if proc.stderr else ""
    os.close(master)
    text = out.decode()
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["gap", "ms", "request", "t0"]
    # longest first: 28.0 then 12.0, not JSON
    assert lines[2].split()[0] == "28.0" and lines[3].split()[0] == "12.0"
    assert "{" not in text
    # not a terminal: JSON lines, as before
    r = run_cli("gaps", p)
    assert [round(json.loads(x)["gap_ms"], 6) for x in r.stdout.splitlines()] == [12.0, 28.0]


def _report_open(tmp_path, browser: str) -> subprocess.CompletedProcess:
    p = tiny_log(tmp_path)
    out = tmp_path / "r.html"
    e = env()
    e["BROWSER"] = browser
    return subprocess.run([*tracekit_cmd(), "report", p, "-o", str(out), "--open"],
                          capture_output=True, text=True, env=e, timeout=120)  # fmt: skip


def test_report_open_opens_a_browser_on_the_file(tmp_path):
    seen = tmp_path / "seen.txt"
    fake = tmp_path / "fake-browser"
    fake.write_text(
        f"#!{sys.executable}\nimport sys\nopen({str(seen)!r}, 'w').write(sys.argv[1])\n"
    )
    fake.chmod(0o755)
    r = _report_open(tmp_path, str(fake))
    assert r.returncode == 0, r.stderr
    url = (tmp_path / "r.html").as_uri()
    assert seen.read_text() == url and f"opened {url}" in r.stderr


def test_report_open_without_a_browser_prints_the_url(tmp_path):
    r = _report_open(tmp_path, str(tmp_path / "no-such-browser"))
    assert r.returncode == 0, r.stderr
    assert f"no browser available here; open {(tmp_path / 'r.html').as_uri()}" in r.stderr
