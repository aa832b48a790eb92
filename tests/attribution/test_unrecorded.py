"""Unrecorded windows: time of a client gap where a process it depends on recorded nothing
is `unrecorded:<role>`, never another process's cause (docs/partition.md, "Unrecorded
windows"). Hand cases derived from the written rule, both implementations, and a property
test of the fast partition against the reference."""

from __future__ import annotations

import html
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from logbuilder import LogBuilder
from test_frontend import _hand_log, _random_serve_log, _row, serve_log
from test_merge import record_pair

import tracekit
from tracekit.analysis.run import merge_run as merge_dir
from tracekit.analysis.unrecorded import unrecorded_report
from tracekit.attribution.client import FRONTEND_LABELS, client_gaps, client_partition
from tracekit.attribution.reference import client_partition_reference
from tracekit.log.parts import merge_parts
from tracekit.log.rawlog import Coverage


def with_coverage(log, spans_ms):
    """`log` with one coverage row per (process, start ms, end ms, clean)."""
    s = 1e-3
    return replace(
        log,
        coverage=Coverage.from_columns(
            process=[c[0] for c in spans_ms],
            t_start_s=[c[1] * s for c in spans_ms],
            t_end_s=[c[2] * s for c in spans_ms],
            is_clean_stop=[c[3] for c in spans_ms],
        ),
    )


def both(log):
    fast, ref = client_partition(log), client_partition_reference(log)
    assert fast.labels == ref.labels
    assert np.allclose(fast.parts_ms, ref.parts_ms, atol=1e-9)
    return fast, ref


def _killed_core_log():
    """The engine core recorded three decode steps of requests 0 and 1 and was killed:
    its rows are complete to 30.5 ms; the API server kept streaming until 47 ms."""
    b = LogBuilder()
    for k, (t0, t1) in enumerate([(0, 10), (10, 20), (20, 30)]):
        b.step(t0, t1)
        b.seg(k, "decode", t0, t1)
        b.emit(0, t1, k)
        if k < 2:
            b.emit(1, t1, k)
    chunks = [(0, 11, 1), (0, 25, 1), (0, 33, 1), (0, 38, 1), (0, 47, 1),
              (1, 12, 1), (1, 29, 1), (1, 34, 1)]  # fmt: skip
    windows = [(1, "output", 36.0, 37.0), (1, "sse_write", 37.5, 38.0), (1, "gc", 45.0, 46.0)]
    deliveries = [(0, 10, 10.4), (1, 20, 21.0), (2, 30, 30.3)]
    log = serve_log(b, chunks, windows, deliveries)
    return with_coverage(log, [(0, 0.0, 30.5, 0), (1, 5.0, 60.0, 1)])


def test_a_killed_engine_core_leaves_its_window_unrecorded():
    fast, _ = both(_killed_core_log())
    # gaps sorted by request then time: request 0 [11,25] [25,33] [33,38] [38,47],
    # request 1 [12,29] [29,34]
    assert np.allclose(fast.gap_ms, [14, 8, 5, 9, 17, 5])
    # [11, 25]: token emitted at 20 (recorded): engine [11, 20] decode = forward 9;
    #   frontend [20, 25]: hop [20, recv 21] 1, the rest frontend_other 4
    assert _row(fast, 0) == {"forward": 9.0, "hop": 1.0, "frontend_other": 4.0}
    # [25, 33]: token at 30: forward 5; hop [30, 30.3] 0.3, other 2.7
    assert _row(fast, 1) == {"forward": 5.0, "hop": 0.3, "frontend_other": 2.7}
    # [33, 38]: the 4th token was never recorded and the core's span ended at 30.5 < 38:
    #   x = clip(30.5, 33, 38) = 33, all of [33, 38] unrecorded; the output and write
    #   windows inside it are not charged
    assert _row(fast, 2) == {"unrecorded:engine_core": 5.0}
    # [38, 47]: likewise 9 ms; the frontend GC pause [45, 46] is not charged
    assert _row(fast, 3) == {"unrecorded:engine_core": 9.0}
    # request 1 [12, 29]: token at 20: forward 8; hop [20, 21] 1, other 8
    assert _row(fast, 4) == {"forward": 8.0, "hop": 1.0, "frontend_other": 8.0}
    # [29, 34]: 3rd token unknown, span ends at 30.5 inside the gap: x = 30.5; the engine
    #   part [29, 30.5] is an engine gap (decode [20, 30] covers 1 ms, nothing after:
    #   residual 0.5); [30.5, 34] unrecorded 3.5
    assert _row(fast, 5) == {"forward": 1.0, "residual": 0.5, "unrecorded:engine_core": 3.5}
    assert np.allclose(fast.engine_s * 1e3, [20, 30, 33, 38, 20, 30.5])
    assert np.allclose(fast.unrecorded_ms(), [0, 0, 5, 9, 0, 3.5])
    assert np.allclose(fast.engine_ms() + fast.frontend_ms() + fast.unrecorded_ms(), fast.gap_ms)


def test_spans_that_end_and_start_inside_gaps():
    # the hand log of test_frontend, with the engine core's span starting at 12 ms and the
    # API server's ending at 24.8 ms (the rule at both edges)
    log = with_coverage(_hand_log(), [(0, 12.0, 60.0, 1), (1, 0.0, 24.8, 0)])
    fast, _ = both(log)
    # [11, 25], token at 20: engine part [11, 20]: [11, 12] before the core's span is
    #   unrecorded:engine_core 1; [12, 20] as an engine gap: decode minus the GC [12, 14]:
    #   gc 2, forward 6. Frontend part [20, 25]: [24.8, 25] after the API server's span is
    #   unrecorded:api_server 0.2; in [20, 24.8]: output 1, frontend GC 0.5, writes
    #   [23.5, 24] + [24.5, 24.8] 0.8, hop [20, 21] 1, other 4.8 - 3.3 = 1.5
    assert _row(fast, 0) == {
        "gc": 2.0, "forward": 6.0, "output": 1.0, "frontend_gc": 0.5, "sse_write": 0.8,
        "hop": 1.0, "frontend_other": 1.5, "unrecorded:engine_core": 1.0,
        "unrecorded:api_server": 0.2,
    }  # fmt: skip
    # [25, 41], token at 40: engine [25, 40] forward 15; frontend [40, 41] after 24.8: 1
    assert _row(fast, 1) == {"forward": 15.0, "unrecorded:api_server": 1.0}
    # [41, 43]: token at 40.9 < 41: the frontend part is all of it, after 24.8: 2
    assert _row(fast, 2) == {"unrecorded:api_server": 2.0}


def test_full_or_unknown_coverage_changes_nothing():
    base = client_partition(_hand_log())  # no coverage: unknown, never assumed partial
    full = client_partition(with_coverage(_hand_log(), [(0, 0.0, 43.0, 1), (1, 0.0, 43.0, 1)]))
    assert full.labels == base.labels
    assert not any(lb.startswith("unrecorded") for lb in base.labels)
    np.testing.assert_array_equal(full.parts_ms, base.parts_ms)
    np.testing.assert_array_equal(full.engine_s, base.engine_s)


@st.composite
def _covered_serve_log(draw):
    """A random serve log, some requests streaming chunks the engine core never recorded,
    with random spans for the engine core and the API server (or none)."""
    log = draw(_random_serve_log())
    ce = log.client_emissions
    t_end = float(max(ce.t_s.max(initial=0.0), log.steps.t_end_s.max(initial=0.0))) * 1e3
    extra = []
    for r in np.unique(ce.request).tolist():
        last = float(ce.t_s[ce.request == r].max()) * 1e3
        for _ in range(draw(st.integers(0, 3))):  # tokens the core's log does not have
            last += draw(st.floats(0.01, 5))
            extra.append((r, last))
    if extra:
        s = 1e-3
        ce = type(ce).from_columns(
            request=np.concatenate([ce.request, [e[0] for e in extra]]),
            t_s=np.concatenate([ce.t_s, [e[1] * s for e in extra]]),
            t_ready_s=np.concatenate([ce.t_ready_s, [e[1] * s for e in extra]]),
            num_tokens=np.concatenate([ce.num_tokens, np.ones(len(extra), dtype=np.int64)]),
            process=np.concatenate([ce.process, np.ones(len(extra), dtype=np.int64)]),
        )
        log = replace(log, client_emissions=ce)
    spans = []
    for proc in (0, 1):
        if draw(st.booleans()):
            a = draw(st.floats(-5, t_end + 5))
            spans.append(
                (proc, a, a + draw(st.floats(0, t_end + 10)), draw(st.sampled_from([0, 1])))
            )
    return with_coverage(log, spans) if spans else log


@settings(max_examples=80, deadline=None)
@given(_covered_serve_log())
def test_fast_equals_reference_with_unrecorded_windows(log):
    fast = client_partition(log)  # check=True: raises if a gap's parts miss its length
    ref = client_partition_reference(log)
    assert fast.labels == ref.labels
    assert np.allclose(fast.parts_ms, ref.parts_ms, atol=1e-6)
    assert np.all(fast.parts_ms >= -1e-9)
    assert np.allclose(ref.parts_ms.sum(axis=1), ref.gap_ms, atol=1e-6)
    # a gap whose token the core never recorded and that reaches past the core's span:
    # nothing after the span's end goes to an API-server cause
    cov = log.coverage
    if 0 in cov.process.tolist() and len(fast):
        core_end = float(cov.t_end_s[cov.process.tolist().index(0)])
        g = client_gaps(log)
        cut = np.isnan(g.e) & (g.b > core_end)
        n0 = fast.labels.index(FRONTEND_LABELS[0])
        front = fast.parts_ms[:, n0 : n0 + len(FRONTEND_LABELS)].sum(axis=1)
        assert np.all(front[cut] <= 1e-9)
        late = np.clip(g.b - np.maximum(g.a, core_end), 0, None) * 1e3
        assert np.all(fast.unrecorded_ms()[cut] >= late[cut] - 1e-6)


# -- merged directories: a killed engine core, a missing or late API server, old logs -----

CLI = [sys.executable, "-m", "tracekit"]


def _dir(tmp_path):
    (tmp_path / "run").mkdir()
    return tmp_path / "run"


def _run(*args):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)


def test_a_killed_engine_core_in_a_merged_run(tmp_path):
    d, writes, _ = record_pair(_dir(tmp_path), n=20, kill_core_at=12)
    kill_s = record_pair.kill_s
    log = merge_dir(d)
    cov = log.coverage
    assert cov.process.tolist() == [0, 1] and cov.is_clean_stop.tolist() == [0, 1]
    # both recorders started at true time 0; the core's last flush was taken at kill_s
    assert cov.t_start_s.tolist() == pytest.approx([0.0, 0.0], abs=1e-9)
    assert cov.t_end_s[0] == pytest.approx(kill_s, abs=1e-9)
    cp = client_partition(log)
    # one gap per request, between its two chunks; requests 12.. were served after the
    # core's last flush: their tokens were never recorded and each gap lies after the
    # core's span, so by the rule all of it is unrecorded:engine_core
    w = writes.reshape(20, 2)
    want = np.where(np.arange(20) >= 12, (w[:, 1] - w[:, 0]) * 1e3, 0.0)
    order = np.argsort(cp.t0_s)
    assert np.allclose(cp.unrecorded_ms()[order], want, atol=1e-6)
    assert np.all(cp.frontend_ms()[order][12:] == 0)  # no API-server cause after the kill
    ref = client_partition_reference(log)
    assert ref.labels == cp.labels and np.allclose(ref.parts_ms, cp.parts_ms, atol=1e-9)
    (u,) = unrecorded_report(log, cp)
    assert u["line"] == (
        f"engine_core pid 1: no rows after {kill_s:.3f} s (killed? recovered from parts), "
        f"{want.sum() / 1e3:.3f} s of client gap time unrecorded (8 gaps)"
    )
    r = _run("merge", d, "-o", str(tmp_path / "m.npz"))
    assert r.returncode == 0, r.stderr
    assert f"unrecorded: {u['line']}" in r.stdout
    r = _run("analyze", str(tmp_path / "m.npz"))
    assert r.returncode == 0 and u["line"] in r.stdout and u["line"] in r.stderr
    r = _run("report", str(tmp_path / "m.npz"), "-o", str(tmp_path / "r.html"))
    assert r.returncode == 0, r.stderr
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert "unrecorded:ROLE" in page and html.escape(u["line"]) in page


def test_a_directory_without_the_api_server_says_it_is_missing(tmp_path):
    d, _, _ = record_pair(_dir(tmp_path), n=5)
    os.unlink(os.path.join(d, "api_server-2.npz"))  # its pointer and its parts: no log
    shutil.rmtree(os.path.join(d, "api_server-2.npz.parts"))
    log = merge_dir(d)
    (m,) = log.meta["missing_processes"]
    assert m["role"] == "api_server" and m["named_by"] == "engine_core-1"
    assert "added 5 request(s)" in m["why"]
    assert not len(log.client_emissions)
    line = "api_server missing, not assumed idle"
    assert any(w.startswith(line) for w in log.warnings)
    r = _run("merge", d, "-o", str(tmp_path / "m.npz"))
    assert r.returncode == 0 and f"unrecorded: {line}" in r.stdout
    r = _run("analyze", d)
    assert r.returncode == 0 and line in r.stderr


def test_an_api_server_whose_log_starts_late(tmp_path):
    d, _, _ = record_pair(_dir(tmp_path), n=10, fe_from=4)
    log = merge_dir(d)
    cov = log.coverage
    assert cov.t_start_s[1] == pytest.approx(record_pair.fe_start_s, abs=1e-9)
    (u,) = unrecorded_report(log)
    assert u["role"] == "api_server" and "4 request(s) the engine core added before" in u["line"]
    assert "unrecorded:api_server" not in client_partition(log).labels  # its gaps are its own


def test_old_logs_without_coverage_merge_as_before(tmp_path):
    """Process logs written before schema v4 (no coverage): spans unknown, nothing is
    unrecorded even though the core was killed; the run says it was recovered."""
    d, _, _ = record_pair(_dir(tmp_path), n=20, kill_core_at=12)
    for name in ("engine_core-1.npz.parts", "api_server-2.npz"):
        p = os.path.join(d, name)
        lg = tracekit.load(p) if name.endswith(".npz") else merge_parts(p)
        arrays = _arrays_of(replace(lg, coverage=Coverage.empty()))
        arrays = {k: v for k, v in arrays.items() if not k.startswith("coverage.")}
        arrays["schema_version"] = np.array(3, dtype=np.int64)
        out = p[: -len(".parts")] if name.endswith(".parts") else p
        np.savez(out, **arrays)
    log = merge_dir(d)
    assert not len(log.coverage)
    cp = client_partition(log)
    assert not any(lb.startswith("unrecorded") for lb in cp.labels)
    assert unrecorded_report(log, cp) == []


def _arrays_of(log):
    import tempfile

    with tempfile.TemporaryDirectory() as t:
        p = log.save(os.path.join(t, "x.npz"))
        with np.load(p, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}


def test_a_merged_run_whose_coverage_lies_is_one_line_exit_2(tmp_path):
    d, _, _ = record_pair(_dir(tmp_path), n=5)
    log = merge_dir(d)
    for change, field in (
        (dict(process=[0, 2]), "coverage.process"),  # two processes: 2 is out of range
        (dict(t_end_s=[-1.0, log.coverage.t_end_s[1]]), "coverage.t_end_s"),
    ):
        cols = {**log.coverage.columns(), **change}
        bad = replace(log, coverage=Coverage.from_columns(**cols))
        p = str(tmp_path / f"bad-{field}.npz")
        bad.save(p)
        r = _run("analyze", p)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and field in r.stderr, r.stderr


# -- flush_soon: a SIGTERM handler's flush before a SIGKILL lands -------------------------

#: An engine loop that never flushes by itself (interval 1e9 s) with a SIGTERM handler
#: like the vLLM plugin's engine core: it asks for a flush and keeps stepping (vLLM aborts
#: its requests and winds down) until the parent's SIGKILL lands.
SIGTERM_SCRIPT = r"""
import signal, sys, time
import tracekit

rec = tracekit.Recorder(sys.argv[1], handle_signals=False, flush_interval_s=1e9)
done = [0]

def on_term(signum, frame):
    print("term", done[0], flush=True)
    rec.flush_soon()

signal.signal(signal.SIGTERM, on_term)
rec.start()
print("started", flush=True)
while True:
    with rec.step():
        with rec.segment("decode"):
            time.sleep(0.002)
        rec.emit(["r%d" % (done[0] % 3)])
    done[0] += 1
"""


def test_flush_soon_on_sigterm_lands_before_the_sigkill(tmp_path):
    from procs import python

    out = tmp_path / "core.npz"
    parts = tmp_path / "core.npz.parts"
    proc = python(SIGTERM_SCRIPT, str(out))
    try:
        assert proc.stdout.readline().strip() == "started"
        time.sleep(0.3)
        assert not list(parts.glob("part-*"))  # nothing flushed by itself
        proc.send_signal(signal.SIGTERM)
        steps_at_term = int(proc.stdout.readline().split()[1])
        deadline = time.monotonic() + 20  # what the plugin's parent does: wait for the part
        while not list(parts.glob("part-*.tkp")) and time.monotonic() < deadline:
            time.sleep(0.002)
        landed = list(parts.glob("part-*.tkp"))
        proc.kill()
        proc.wait(timeout=10)
    finally:
        proc.kill()
    assert landed, "the SIGTERM's flush never wrote a part"
    log = merge_parts(str(parts))
    # every step completed before the SIGTERM is there (the one open then too: the flush
    # came at its end), and the coverage says up to when the rows are complete
    assert steps_at_term > 10 and len(log.steps) >= steps_at_term
    (row,) = log.coverage.columns()["t_end_s"]
    assert log.coverage.is_clean_stop.tolist() == [0]
    assert row >= log.steps.t_end_s.max()
