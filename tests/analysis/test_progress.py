"""A long run read in slices says how far it is on a terminal (`tracekit.analysis.progress`):
one line, overwritten, only while the CLI opened it for one run."""

from __future__ import annotations

import io

from tracekit.analysis import progress, workers
from tracekit.analysis.progress import progress_on, reporter


def test_a_run_read_in_slices_says_where_it_is_and_clears_the_line(demo_run, monkeypatch):
    monkeypatch.setenv(workers.SLICE_ENV, "500")  # the demo run (7,921 tokens): many slices
    monkeypatch.setattr(progress, "EVERY_S", 0.0)  # every line, whatever the machine's speed
    out = io.StringIO()
    with progress_on(out):
        workers.analyze_path(demo_run)
    text = out.getvalue()
    lines = text.split("\r\x1b[K")
    assert lines[0] == "" and lines[-1] == ""  # each line overwrites the last; cleared at the end
    said = lines[1:-1]
    assert said and all(s.startswith(f"tracekit: {demo_run}: ") for s in said)
    assert any(": index: part 1 of " in s for s in said)
    assert any(": slice 1 of " in s for s in said)
    assert "\n" not in text


def test_nothing_is_said_where_no_terminal_asked_for_it(demo_run, monkeypatch, capsys):
    monkeypatch.setenv(workers.SLICE_ENV, "500")
    assert reporter("run") is None
    workers.analyze_path(demo_run)
    assert capsys.readouterr().err == ""
    with progress_on(None):
        assert reporter("run") is None


def test_lines_come_at_most_every_half_second(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    out = io.StringIO()
    with progress_on(out):
        say = reporter("r.npz")
        assert say is not None
        for k, t in enumerate((100.0, 100.2, 100.49, 100.5, 100.6, 101.5)):
            now[0] = t
            say(f"slice {k + 1} of 6")
    # said at 100.0, then 100.5 (0.5 s on), then 101.5: slices 1, 4 and 6
    line = "\r\x1b[Ktracekit: r.npz: slice {} of 6"
    assert out.getvalue() == line.format(1) + line.format(4) + line.format(6) + "\r\x1b[K"
