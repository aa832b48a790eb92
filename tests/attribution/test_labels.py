"""One rule for labels (tracekit/labels.py, `PRODUCED_LABELS`; docs/input-validation.md,
"Labels"): labels the partitions produce from evidence other than a window (the decode
split, uncovered time, the OS's counters, a request's stages and waits, the client
boundary's hop) are never an engine's. A window a log records under one is the engine's
own cause, `engine_<label>`, in every partition and every command."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from logbuilder import LogBuilder
from procs import env, tracekit_cmd

from tracekit.analysis import whatif as W
from tracekit.attribution.itl import partition
from tracekit.attribution.ttft import ttft_partition
from tracekit.labels import PRODUCED_LABELS, cause_of, is_produced
from tracekit.render.perfetto import chrome_trace_events, validate_trace

PRODUCED = sorted(PRODUCED_LABELS) + ["wait_kv_blocks", "unrecorded:engine_core"]


def log_with(label: str):
    # steps [0,10] and [10,40]; the second has the window [10,30] under `label` and decode
    # [30,40]; request 0 emits at 10 and 40 (one gap of 30: 20 of the window, 10 forward),
    # request 1 arrives at 5 and emits its first token at 40
    b = LogBuilder()
    s0 = b.step(0, 10, n_decode=1)
    b.seg(s0, "decode", 0, 10)
    s1 = b.step(10, 40, n_decode=1)
    b.seg(s1, label, 10, 30)
    b.seg(s1, "decode", 30, 40)
    b.emit(0, 10, s0)
    b.emit(0, 40, s1)
    b.emit(1, 40, s1)
    return b.build(arrivals_ms=[0, 5])


@pytest.mark.parametrize("label", PRODUCED)
def test_a_window_under_a_produced_label_is_the_engines_own_cause(label):
    assert is_produced(label) and cause_of(label, {}) == f"engine_{label}"
    log = log_with(label)
    p = partition(log)
    row = p.parts_ms[0]
    assert row[p.labels.index(f"engine_{label}")] == pytest.approx(20.0)
    assert row[p.labels.index("forward")] == pytest.approx(10.0)
    assert row.sum() == pytest.approx(30.0)
    t = ttft_partition(log)  # raised KeyError for the OS and pre-engine labels
    # request 1's TTFT [5,40]: the window [10,30] lies inside it, all 20 the engine's cause
    i = list(t.request).index(1)
    assert t.parts_ms[i, t.labels.index(f"engine_{label}")] == pytest.approx(20.0)
    W.whatif(log, p, t)
    assert validate_trace(chrome_trace_events(log, p, ttft=t)) == []


def test_labels_an_engine_records_keep_their_meaning():
    # the engine's own windows, `forward` among them (vLLM's workers record their forward
    # pass so), and a tensor-parallel rank's label in a merged run
    for label in ("forward", "decode", "prefill", "tok", "wait", "sync", "schedule",
                  "rank1:gc", "sse_write", "output"):  # fmt: skip
        assert not is_produced(label), label
        assert not cause_of(label, {}).startswith("engine_"), label
    assert cause_of("swap", {"swap": "preempt"}) == "preempt"


@pytest.mark.parametrize("label", ["frontend_os_runqueue", "http", "residual"])
def test_every_command_reads_such_a_log(label, tmp_path):
    path = str(tmp_path / "run.npz")
    log_with(label).save(path)
    for args in (["analyze", path], ["ttft", path], ["whatif", path], ["gaps", path],
                 ["trace", path, "-o", str(tmp_path / "t.json")],
                 ["report", path, "-o", str(tmp_path / "r.html")], ["compare", path, path]):  # fmt: skip
        r = subprocess.run([*tracekit_cmd(), *args], capture_output=True, text=True, env=env())
        assert r.returncode == 0, (args, r.stderr)
        assert "internal error" not in r.stderr
    out = subprocess.run([*tracekit_cmd(), "gaps", path, "--format", "jsonl"],
                         capture_output=True, text=True, env=env()).stdout  # fmt: skip
    assert f'"engine_{label}"' in out or f"engine_{label}" in out
    np.testing.assert_equal(len(out.strip().splitlines()), 1)
