"""tracekit's vLLM plugin entry point without vLLM: inert without TRACEKIT_VLLM_DIR, and a
setting it cannot use fails at startup with what to do (never on a request)."""

from __future__ import annotations

import pytest

from engine_adapters import vllm_serve


def test_inert_without_the_variable(monkeypatch):
    monkeypatch.delenv("TRACEKIT_VLLM_DIR", raising=False)
    vllm_serve.register()  # returns before importing vLLM or touching anything
    assert vllm_serve._registered == [False]
    assert vllm_serve.installed_hooks() == 0


def test_an_unwritable_directory_fails_at_startup_saying_what_to_do(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TRACEKIT_VLLM_DIR", str(blocker / "logs"))  # under a file
    with pytest.raises(RuntimeError, match="writable directory, or unset it"):
        vllm_serve.register()
    assert vllm_serve._registered == [False] and vllm_serve.installed_hooks() == 0


@pytest.mark.parametrize("value", ["5", "1.5"])
def test_a_flush_interval_over_the_serve_bound_fails_at_startup(monkeypatch, tmp_path, value):
    """Under serve the flush interval bounds what a SIGKILL loses: at most 1 s."""
    monkeypatch.setenv("TRACEKIT_VLLM_DIR", str(tmp_path))
    monkeypatch.setenv("TRACEKIT_VLLM_FLUSH_S", value)
    with pytest.raises(RuntimeError, match=r"TRACEKIT_VLLM_FLUSH_S=.*seconds in \[0.01, 1.0\]"):
        vllm_serve.register()
    assert vllm_serve._registered == [False]


@pytest.mark.parametrize("value", ["0", "-1", "soon"])
def test_a_bad_flush_interval_fails_at_startup(monkeypatch, tmp_path, value):
    monkeypatch.setenv("TRACEKIT_VLLM_DIR", str(tmp_path))
    monkeypatch.setenv("TRACEKIT_VLLM_FLUSH_S", value)
    with pytest.raises(RuntimeError, match="positive number of seconds"):
        vllm_serve.register()
    assert vllm_serve._registered == [False]


@pytest.mark.parametrize("value", ["0", "-5", "soon", "nan"])
def test_a_bad_retention_fails_at_startup(monkeypatch, tmp_path, value):
    monkeypatch.setenv("TRACEKIT_VLLM_DIR", str(tmp_path))
    monkeypatch.setenv("TRACEKIT_VLLM_RETAIN_S", value)
    with pytest.raises(RuntimeError, match=r"TRACEKIT_VLLM_RETAIN_S=.*expected seconds"):
        vllm_serve.register()
    assert vllm_serve._registered == [False]


CHAINED = r"""
import signal, sys, time
import tracekit
from engine_adapters.vllm_serve import flush_on_sigterm

if sys.argv[2] == "ignored":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
rec = tracekit.Recorder(sys.argv[1], gc=False, handle_signals=False, flush_interval_s=60)
rec.start()
try:
    flush_on_sigterm(rec)
    print("started", flush=True)
    for i in range(400):  # 2 s or more: the SIGTERM comes 0.2 s in
        with rec.step():
            time.sleep(0.005)
            rec.emit(["a"])
    print("ran to the end", flush=True)
finally:
    rec.stop()
"""


@pytest.mark.parametrize("before", ["default", "ignored"])
def test_the_sigterm_handler_keeps_what_sigterm_did_before_it(tmp_path, before):
    """The plugin chains its flush in front of the process's SIGTERM handler. Where there
    was none (the default ends the process), SIGTERM still ends it, with 128 + 15 and a
    whole log (the recorder stopped on the way out), never swallowed; where SIGTERM was
    ignored, it stays ignored and the run goes on."""
    import signal
    import time

    from procs import python

    import tracekit

    out = tmp_path / "run.npz"
    proc = python(CHAINED, str(out), before)
    try:
        assert proc.stdout.readline().strip() == "started", proc.stderr.read()[-2000:]
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        rest = proc.stdout.read()
        rc = proc.wait(timeout=30)
    finally:
        proc.kill()
    log = tracekit.load(out)  # whole: the recorder stopped, not recovered from parts
    if before == "default":
        assert rc == 143 and "ran to the end" not in rest
        assert 0 < len(log.steps) < 400
    else:
        assert rc == 0 and "ran to the end" in rest
        assert len(log.steps) == 400
    assert log.coverage.is_clean_stop.tolist() == [1]
