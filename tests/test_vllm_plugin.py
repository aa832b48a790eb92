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
