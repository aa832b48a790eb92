"""Rows a slice of a long run needs from parts outside the ones its gaps reach back to
(docs/reports.md, "Reading a long run in slices"), read one part a slice: each slice must
still partition its gaps as the whole run does.

A segment of another thread open at a flush (`tracekit.log.carried`): its row, and its
closing OS sample, lie in a later part than the gaps it overlaps, and its opening sample
in an earlier one than a slice may read.

The hand run: 8 steps of 10 ms, step k over [10k, 10k + 10] ms, one `decode` segment each,
its token ("a") at its end; a part a step (flushed after the step, nothing else flushes).
A second thread holds one segment over [15, 45] ms: opened in step 1 (part 1), closed in
step 4 (its row in part 4). Read one part a slice (`TRACEKIT_SLICE_EMISSIONS=1`): the gaps
ending at 20, 30 and 40 ms are owned by slices that end before part 4.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from test_sliced import REPO, FakeClock, _recorder, _traced, _wait_for_parts
from test_sliced_whatif import _Kernel

from tracekit.capture import osstats

MS = 1_000_000
WHOLE, ONE_PART = "100000000", "1"


def _side_run(out: Path, label: str, clock: FakeClock, os_evidence: bool | None = None) -> None:
    rec = _recorder(out, clock, os_evidence)
    opened, close = threading.Event(), threading.Event()

    def side() -> None:
        with rec.segment(label):
            opened.set()
            close.wait()

    t0 = clock.t
    side_thread = threading.Thread(target=side)
    with rec:
        rec.request("a")
        for k in range(8):
            with rec.step():
                with rec.segment("decode"):
                    if k == 1:
                        clock.t = t0 + 15 * MS
                        side_thread.start()
                        opened.wait()
                    if k == 4:
                        clock.t = t0 + 45 * MS
                        close.set()
                        side_thread.join()
                    clock.t = t0 + (k + 1) * 10 * MS
                rec.emit(["a"])
            rec.flush_soon()
            _wait_for_parts(out, k + 1)


def _jsonl(budget: str, *args: str) -> list[dict]:
    env = {**os.environ, "TRACEKIT_SLICE_EMISSIONS": budget}
    r = subprocess.run([sys.executable, "-m", "tracekit", *args, "--format", "jsonl"],
                       capture_output=True, text=True, cwd=REPO, env=env,
                       timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines() if line.strip()]


def _parts(rows: list[dict], labels: tuple[str, ...]) -> list[tuple]:
    """Per gap: its end (ms) and its parts (ms) of `labels`, to 1e-9 ms."""
    return [(round(r["t1_s"] * 1e3, 6), *(round(r["parts"][lb], 9) for lb in labels))
            for r in rows]  # fmt: skip


def test_another_threads_segment_open_across_flushes_is_in_every_slice_it_overlaps(tmp_path):
    """The second thread's segment is `tokenize`, an extra cause: it owns its overlap with
    `decode` (docs/design.md, partition rule 6; `tracekit.labels.precedence` orders
    every other cause before `decode`), the rest of each step is `forward` (every step
    decodes one request, so no graph excess: rule 4). Gaps of "a", by hand:
    10 -> 20 ms: tokenize 5 (15..20), forward 5; 20 -> 30 and 30 -> 40: tokenize 10;
    40 -> 50: tokenize 5 (40..45), forward 5; then forward 10 each. Every gap record has
    every label of the run, `tokenize` 0 where a slice holds none of it. `analyze`: 30 of
    the 70 ms is tokenize. The trace of 31..35 ms draws the segment whole, 15 -> 45 ms."""
    out = tmp_path / "run.npz"
    _side_run(out, "tokenize", FakeClock())
    want = [(20.0, 5.0, 5.0), (30.0, 10.0, 0.0), (40.0, 10.0, 0.0), (50.0, 5.0, 5.0),
            (60.0, 0.0, 10.0), (70.0, 0.0, 10.0), (80.0, 0.0, 10.0)]  # fmt: skip
    for budget in (WHOLE, ONE_PART):
        rows = _jsonl(budget, "gaps", str(out))
        assert _parts(rows, ("tokenize", "forward")) == want, budget
        assert {tuple(r["parts"]) for r in rows} == {tuple(rows[0]["parts"])}  # same keys
        (fig,) = _jsonl(budget, "analyze", str(out))
        assert fig["all_share"]["tokenize"] == pytest.approx(30 / 70, abs=1e-12), budget
        events = _traced(out, "0.031..0.035", budget)
        drawn = [(e["ts"], e["dur"]) for e in events if e["ph"] == "X" and e["name"] == "tokenize"
                 and e["pid"] == 1]  # fmt: skip
        assert (15000.0, 30000.0) in drawn, budget


def test_the_reports_worst_stalls_in_slices_are_the_whole_runs_records(tmp_path, monkeypatch):
    """The report of the same run read one part a slice: its worst stalls are the whole
    run's records, key for key (the steps last, as the whole run adds them) and with every
    label of the run, `tokenize` where a slice's own segments hold none of it."""
    from tracekit.analysis import workers  # the module whose setting this test changes

    out = tmp_path / "run.npz"
    _side_run(out, "tokenize", FakeClock())
    pages = []
    for budget in (WHOLE, ONE_PART):
        monkeypatch.setenv("TRACEKIT_SLICE_EMISSIONS", budget)
        pages.append(workers.report_path(str(out), 10)[0]["worst_stalls"])
    whole, sliced = pages
    assert len(whole) == len(sliced) > 0
    for a, b in zip(whole, sliced, strict=True):
        assert list(a) == list(b) and list(a["parts"]) == list(b["parts"])
        assert "tokenize" in b["parts"] and a["parts"] == pytest.approx(b["parts"], abs=1e-9)


def test_device_windows_resolved_after_a_flush_are_in_their_steps_slice(tmp_path):
    """A device window is written when it resolves (`tracekit.capture.device`): here each
    step's at the next step's end, so in the next part. 20 steps of 10 ms, a part each:
    each launches a 2 ms host `decode` segment whose device work runs 6 ms, then the host
    works 8 ms outside any segment; "a" emits at every step's end. docs/design.md rule 6
    (`tracekit.attribution.itl`): the loop thread waited for the device, so the gap is
    device-bound and the step's 6 ms device window owns its time, `forward` (every step
    alike: no graph excess); the host launch alone would be 2 ms. Read one part a slice,
    each slice's own steps' windows lie in the part after it, and every gap is still the
    whole run's. `analyze`: 20 device windows, and the graph baseline (docs/gpu.md: a
    step's device decode time where it has one) is fitted on 20 steps of 6 ms, as the
    index pass reads each part's steps with the part after it, in one process or two
    (its index pass spread, `-j 2`)."""
    from tracekit.capture.device import FakeDeviceTimer  # the module this test drives

    out = tmp_path / "run.npz"
    clock = FakeClock()
    timer = FakeDeviceTimer(clock, lag_ms=0.05, exec_ms=6.0, resolve_delay_ms=5.0)
    rec = _recorder(out, clock, device_timer=timer)
    with rec:
        rec.request("a")
        for k in range(20):
            with rec.step():
                with rec.segment("decode", device=True):
                    clock.t += 2 * MS
                clock.t += 8 * MS
                rec.emit(["a"])
            rec.flush_soon()
            _wait_for_parts(out, k + 1)
    whole, sliced = _jsonl(WHOLE, "gaps", str(out)), _jsonl(ONE_PART, "gaps", str(out))
    assert len(whole) == len(sliced) == 19
    for a, b in zip(whole, sliced, strict=True):
        assert b["parts"]["forward"] >= 6.0 - 1e-9
        assert b["parts"] == pytest.approx(a["parts"], abs=1e-9)
    for budget, spread in ((WHOLE, ()), (ONE_PART, ()), (ONE_PART, ("-j", "2"))):
        (fig,) = _jsonl(budget, "analyze", str(out), *spread)
        assert fig["device_windows"] == 20, (budget, spread)
        base = fig["graph_baseline"]
        assert base["num_fit_steps"] == 20 and base["intercept_ms"] == pytest.approx(6.0)


class _TwoThreads(_Kernel):
    """`_Kernel`'s counters for the thread that made it (the loop: a run queue 20% of every
    instant since the run began, running the rest); any other thread waited 60% and ran
    40%."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.loop = threading.get_ident()

    def _waited_fifths(self) -> int:
        return 1 if threading.get_ident() == self.loop else 3

    def cpu_ns(self) -> int:
        return (self.clock.t - self.t0) * (5 - self._waited_fifths()) // 5

    def pread(self, _fd: int, _n: int, _offset: int) -> bytes:
        return b"0 %d 0\n" % ((self.clock.t - self.t0) * self._waited_fifths() // 5)


@pytest.mark.skipif(osstats.unavailable_reason() is not None
                    or not os.path.exists(osstats.SCHEDSTAT_PATH),
                    reason="OS evidence needs Linux with schedstat")  # fmt: skip
def test_another_threads_os_interval_across_slices(tmp_path, monkeypatch):
    """With OS evidence (docs/partition.md, "OS evidence"): the loop thread's interval is
    each step (R = 20% of it, no off-CPU time); the second thread's, a `tok` segment, is
    [15, 45] ms (R = 60%). Rule 7: at an instant the `tok` segment owns (the loop has no
    `tok` segment) the second thread's interval gives the shares, 0.6 `os_runqueue`;
    elsewhere the loop's, 0.2. Gaps of "a", by hand (tok, forward, os_runqueue):
    10 -> 20 ms: 10..15 decode (forward 4, runqueue 1), 15..20 tok (2, runqueue 3):
    2, 4, 4; 20 -> 30 and 30 -> 40: 4, 0, 6; 40 -> 50: 2, 4, 4; then 0, 8, 2 each. The
    slices owning the gaps ending at 30 and 40 ms hold neither the segment's row (part 4)
    nor its opening sample (part 1): they are carried to them."""
    clock = FakeClock()
    kernel = _TwoThreads(clock)
    for name in ("thread_cpu_ns", "pread", "getrusage"):
        monkeypatch.setattr(osstats, name, getattr(kernel, name.replace("thread_", "")))
    out = tmp_path / "run.npz"
    _side_run(out, "tok", clock, os_evidence=True)
    want = [(20.0, 2.0, 4.0, 4.0), (30.0, 4.0, 0.0, 6.0), (40.0, 4.0, 0.0, 6.0),
            (50.0, 2.0, 4.0, 4.0), (60.0, 0.0, 8.0, 2.0), (70.0, 0.0, 8.0, 2.0),
            (80.0, 0.0, 8.0, 2.0)]  # fmt: skip
    for budget in (WHOLE, ONE_PART):
        rows = _jsonl(budget, "gaps", str(out))
        assert _parts(rows, ("tok", "forward", "os_runqueue")) == want, budget


def _swap_run(out: Path) -> None:
    """10 steps of 10 ms, a part each; "a" emits at every step's end. Steps 1 and 4 start
    with a 2 ms `swap` segment, the rest of every step is `decode`. "v" emits at step 0's
    end, is evicted (swap) 1 ms into step 1 (11 ms), readmitted 1 ms into step 4 (41 ms)
    and emits next at step 6's end (70 ms); "w" emits at steps 0..3, is evicted 1 ms into
    step 4 (41 ms), readmitted at step 8's start (80 ms), emits at step 8's end."""
    clock = FakeClock()
    rec = _recorder(out, clock)
    with rec:
        for r in ("a", "v", "w"):
            rec.request(r)
        for k in range(10):
            with rec.step():
                if k in (1, 4):
                    with rec.segment("swap"):
                        clock.t += MS
                        if k == 1:
                            rec.evict("v", mode="swap")
                        else:
                            rec.readmit("v")
                            rec.evict("w", mode="swap")
                        clock.t += MS
                if k == 8:
                    rec.readmit("w")
                with rec.segment("decode"):
                    clock.t += (8 if k in (1, 4) else 10) * MS
                emitting = {"a": True, "v": k in (0, 6), "w": k <= 3 or k == 8}
                rec.emit([r for r, yes in emitting.items() if yes])
            rec.flush_soon()
            _wait_for_parts(out, k + 1)


def test_a_step_swapping_a_victim_in_names_it_in_a_slice_after_its_eviction(tmp_path):
    """docs/partition.md, "Naming the parts", 3: "a"'s gap 40 -> 50 ms holds step 4's
    `swap` segment, 2 ms of `preempt` (swap -> preempt), named after the victims evicted
    or readmitted in that step, equally: "v" (readmitted at 41 ms, evicted at 11 ms) and
    "w" (evicted at 41 ms), 1 ms each. The slice owning that gap (part 4) starts at part
    3 by its own gaps; "v"'s eviction row is in part 1, so the slice reaches back to it.
    Before that, read in slices, "w" took both ms."""
    out = tmp_path / "run.npz"
    _swap_run(out)
    for budget in (WHOLE, ONE_PART):
        rows = [r for r in _jsonl(budget, "gaps", str(out)) if r["request"] == "a"]
        (gap,) = [r for r in rows if round(r["t1_s"], 6) == 0.05]
        assert gap["parts"]["preempt"] == pytest.approx(2.0, abs=1e-9), budget
        named = sorted((p["victim"], round(p["evicted_at_s"], 6), round(p["ms"], 9), p["kind"])
                       for p in gap["preempt_causes"])  # fmt: skip
        assert named == [("v", 0.011, 1.0, "swap"), ("w", 0.041, 1.0, "swap")], budget
