"""Strings from a log (labels, request ids, config values) cannot break tracekit's JSON
output, and nothing in a log is ever executed or unpickled.

(HTML escaping is the report renderer's, tested there.)
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner
from malformed import base_log
from procs import run_cli

import tracekit
from tracekit.cli import main

HOSTILE = [
    'quote " and \\ backslash',
    "new\nline and \r\n and \t tab",
    "</script><script>alert('x')</script>",
    "<!-- --> ]]> & &amp;",
    "unicode: \u00e9 \u4e2d\u6587 \U0001f600 \u2028 \u2029 \u200b \ufeff",
    "nul \x00 inside and \x1b[31m escape",
    '{"json": "in a string"}',
]
#: what a lone surrogate (no terminal or file can encode it) comes out as
SURROGATE, REPLACED = "half \ud800 pair", "half \ufffd pair"


def hostile_log(path: Path) -> Path:
    log = base_log()
    ids = (HOSTILE[0], HOSTILE[1] + HOSTILE[2], SURROGATE)
    labels = (*log.labels[:4], HOSTILE[2] + HOSTILE[1])  # the engine-defined label
    config = {
        "rung": HOSTILE[2],
        "seed": HOSTILE[4],
        "notes": HOSTILE,
        "half": SURROGATE,
        # what other serialisers would turn into code; here they stay strings
        "py/object": "os.system",
        "__reduce__": ["os.system", ["touch /tmp/tracekit-pwned"]],
        "!!python/object/apply:os.system": "touch /tmp/tracekit-pwned",
        "eval": "__import__('os').system('touch /tmp/tracekit-pwned')",
    }
    replace(log, request_ids=ids, labels=labels, config=config).save(path)
    return path


@pytest.fixture
def run(tmp_path):
    Path("/tmp/tracekit-pwned").unlink(missing_ok=True)
    yield hostile_log(tmp_path / "hostile.npz")
    assert not Path("/tmp/tracekit-pwned").exists(), "a log executed code"


def test_analyze_jsonl_keeps_every_hostile_string_inside_its_json_string(run):
    r = CliRunner().invoke(main, ["analyze", str(run), str(run), "--format", "jsonl"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert len(lines) == 2  # one line per run, whatever the strings hold
    a = json.loads(lines[0])
    assert a["rung"] == HOSTILE[2]
    assert a["config"]["notes"] == HOSTILE
    assert a["config"]["half"] == REPLACED
    label = HOSTILE[2] + HOSTILE[1]
    assert label in a["labels"] and label in a["all_share"]
    assert a["reconcile_max_err_ms"] < 1e-6
    assert r.stdout.isascii()  # \u escapes: safe for any terminal or file encoding


def test_gaps_jsonl_and_csv_keep_hostile_request_ids_intact(run):
    r = CliRunner().invoke(main, ["gaps", str(run)])
    assert r.exit_code == 0, r.output
    records = [json.loads(line) for line in r.stdout.splitlines()]
    assert {g["request"] for g in records} == {HOSTILE[0], HOSTILE[1] + HOSTILE[2], REPLACED}
    assert all(abs(sum(g["parts"].values()) - g["gap_ms"]) < 1e-6 for g in records)

    one = CliRunner().invoke(main, ["gaps", str(run), "--request", HOSTILE[1] + HOSTILE[2]])
    assert one.exit_code == 0, one.output
    assert {json.loads(x)["request"] for x in one.stdout.splitlines()} == {HOSTILE[1] + HOSTILE[2]}

    c = CliRunner().invoke(main, ["gaps", str(run), "--format", "csv"])
    assert c.exit_code == 0, c.output
    # (click's runner turns \r\n into \n in .stdout; the bytes are what was written)
    rows = list(csv.DictReader(io.StringIO(c.stdout_bytes.decode(), newline="")))
    assert len(rows) == len(records)
    assert [row["request"] for row in rows] == [g["request"] for g in records]


def test_the_real_command_writes_parseable_ascii_json(run):
    """Through a real process and pipe (no click test runner in between)."""
    r = run_cli("analyze", str(run), "--format", "jsonl")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 1
    assert json.loads(r.stdout)["config"]["notes"] == HOSTILE
    r = run_cli("gaps", str(run), "--min-ms", "0")
    assert r.returncode == 0, r.stderr
    assert all(json.loads(line)["request"] for line in r.stdout.splitlines())


def test_a_malicious_config_is_data(run):
    log = tracekit.load(run)
    assert log.config["eval"].startswith("__import__")
    assert log.config["__reduce__"] == ["os.system", ["touch /tmp/tracekit-pwned"]]
    assert all(isinstance(v, (str, list)) for v in log.config.values())


def test_warnings_and_errors_about_hostile_files_stay_one_line(tmp_path):
    """A file whose name holds a newline: the error is still one line."""
    bad = tmp_path / "evil\nTraceback (most recent call last):.npz"
    bad.write_text("not a log")
    r = run_cli("analyze", str(bad))
    assert r.returncode == 2
    assert len(r.stderr.splitlines()) == 1, r.stderr
    assert "\\n" in r.stderr
