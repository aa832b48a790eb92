"""Live mode where an engine idles (a server between bursts), and the `vllm serve`
plugin's live options as it reads them from the environment (no vLLM needed: the real
server runs in tests/adapters/test_adapters_vllm_serve_live.py).
"""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("prometheus_client")
pytest.importorskip("opentelemetry.sdk")

import tracekit  # noqa: E402
from engine_adapters import vllm_serve  # noqa: E402
from tracekit.live import LiveMetrics, attach  # noqa: E402


def test_an_idle_engines_last_gaps_settle_without_a_stop(tmp_path):
    # one request emits 6 tokens 20 ms apart, then the engine idles: the recorder hands
    # the live sink clock-only flushes, so every gap (5) settles once the last emission is
    # hold_s old, while the recorder still runs; the parts on disk get no empty part
    out = tmp_path / "run.npz"
    rec = tracekit.Recorder(out, flush_interval_s=0.05, handle_signals=False)
    live = attach(rec, LiveMetrics(hold_s=0.2))
    with rec:
        rec.request("a", max_new_tokens=6)
        for _ in range(6):
            with rec.step():
                time.sleep(0.02)
                rec.emit(["a"])
        parts = str(out) + ".parts"
        end = time.monotonic() + 20  # a bound on the wait, not a timing assertion
        while time.monotonic() < end and live.snapshot()["gaps"] < 5:
            time.sleep(0.02)
        settled = live.snapshot()
        time.sleep(0.3)  # several more idle intervals
        written = sorted(os.listdir(parts))
        written_later = sorted(os.listdir(parts))
    assert settled["gaps"] == 5 and not settled["final"]
    assert settled["late_rows"] == 0
    # idle flushes with no rows reach only the live sink: no part is written while idle
    assert written == written_later
    assert live.snapshot()["gaps"] == 5


def test_without_a_live_sink_an_idle_recorder_hands_over_nothing(tmp_path):
    got: list = []

    class Counting:
        def open(self, meta):
            pass

        def write(self, rows):
            got.append(rows)

        def close(self, final):
            pass

    rec = tracekit.Recorder(None, flush_interval_s=0.02, handle_signals=False, sinks=[Counting()])
    with rec:
        rec.request("a")
        with rec.step():
            rec.emit(["a"])
        time.sleep(0.1)  # let the rows go, then idle
        n = len(got)
        time.sleep(0.2)
        assert len(got) == n  # nothing new recorded: nothing handed over


@pytest.fixture
def env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("TRACEKIT_VLLM_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("TRACEKIT_VLLM_DIR", "/tmp/serve-run")
    return monkeypatch


def test_live_options_from_the_environment(env):
    assert vllm_serve.live_options() is None  # no metrics port: live mode off
    env.setenv("TRACEKIT_VLLM_METRICS_PORT", "9400")
    o = vllm_serve.live_options()
    assert (o.port, o.addr, o.slo_ms, o.otlp_endpoint, o.hold_s, o.linger_s, o.run) == (
        9400, "127.0.0.1", None, None, 2.0, 0.0, "serve-run")  # fmt: skip
    env.setenv("TRACEKIT_VLLM_SLO_MS", "150")
    env.setenv("TRACEKIT_VLLM_OTLP_ENDPOINT", "http://127.0.0.1:4318/v1/traces")
    env.setenv("TRACEKIT_VLLM_HOLD_S", "1.5")
    env.setenv("TRACEKIT_VLLM_LINGER_S", "10")
    env.setenv("TRACEKIT_VLLM_METRICS_ADDR", "0.0.0.0")
    env.setenv("TRACEKIT_VLLM_RUN", "prod-a")
    o = vllm_serve.live_options()
    assert (o.port, o.addr, o.slo_ms, o.otlp_endpoint, o.hold_s, o.linger_s, o.run) == (
        9400, "0.0.0.0", 150.0, "http://127.0.0.1:4318/v1/traces", 1.5, 10.0, "prod-a")  # fmt: skip


@pytest.mark.parametrize(
    "setting,message",
    [
        ({"TRACEKIT_VLLM_SLO_MS": "100"}, "without TRACEKIT_VLLM_METRICS_PORT"),
        ({"TRACEKIT_VLLM_METRICS_PORT": "94o0"}, "TRACEKIT_VLLM_METRICS_PORT='94o0'"),
        ({"TRACEKIT_VLLM_METRICS_PORT": "70000"}, "port number 0-65535"),
        ({"TRACEKIT_VLLM_METRICS_PORT": "-1"}, "port number"),
        ({"TRACEKIT_VLLM_METRICS_PORT": "0", "TRACEKIT_VLLM_SLO_MS": "0"}, "> 0"),
        ({"TRACEKIT_VLLM_METRICS_PORT": "0", "TRACEKIT_VLLM_SLO_MS": "nan"}, "SLO_MS='nan'"),
        ({"TRACEKIT_VLLM_METRICS_PORT": "0", "TRACEKIT_VLLM_HOLD_S": "-2"}, "HOLD_S"),
        ({"TRACEKIT_VLLM_METRICS_PORT": "0", "TRACEKIT_VLLM_LINGER_S": "inf"}, "LINGER_S"),
        ({"TRACEKIT_VLLM_METRICS_PORT": "0",
          "TRACEKIT_VLLM_OTLP_ENDPOINT": "http://h:4318/v1/traces"}, "set both"),
        ({"TRACEKIT_VLLM_METRICS_PORT": "0", "TRACEKIT_VLLM_SLO_MS": "5",
          "TRACEKIT_VLLM_OTLP_ENDPOINT": "collector:4318"}, "OTLP/HTTP URL"),
    ],
)  # fmt: skip
def test_a_bad_live_option_is_one_line_naming_the_variable(env, setting, message):
    for k, v in setting.items():
        env.setenv(k, v)
    with pytest.raises(RuntimeError, match="TRACEKIT_VLLM_") as e:
        vllm_serve.live_options()
    assert message in str(e.value) and "\n" not in str(e.value)


def _free_port_pair() -> int:
    """A port P with P + 1 free too (data-parallel rank 1 serves on P + 1)."""
    import socket

    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", p + 1))
                except OSError:
                    continue
                return p
    pytest.skip("no two consecutive free ports on loopback")


def test_each_data_parallel_engine_core_serves_on_port_plus_its_rank(env, capfd):
    from types import SimpleNamespace
    from urllib.request import urlopen

    port = _free_port_pair()
    env.setenv("TRACEKIT_VLLM_METRICS_PORT", str(port))
    env.setenv("TRACEKIT_VLLM_RUN", "dp-run")
    core = SimpleNamespace(vllm_config=SimpleNamespace(
        model_config=SimpleNamespace(served_model_name="tiny", model="/models/tiny")))  # fmt: skip
    sinks = [vllm_serve.live_sink_for_core(core, rank) for rank in (0, 1)]
    try:
        assert [s.port for s in sinks] == [port, port + 1]
        err = capfd.readouterr().err
        for rank in (0, 1):  # always printed, whatever the log level
            assert f"(dp_rank {rank}, pid {os.getpid()}) live metrics at " \
                   f"http://127.0.0.1:{port + rank}/metrics" in err  # fmt: skip
        for rank, s in enumerate(sinks):
            s.open({"t0_tick": 0, "seconds_per_tick": 1e-9})
            with urlopen(f"http://127.0.0.1:{s.port}/metrics", timeout=5) as r:
                body = r.read().decode()
            want = (f'tracekit_gaps_total{{dp_rank="{rank}",engine="vllm",model="tiny",'
                    f'process="engine_core-{os.getpid()}",run="dp-run"}} 0.0')  # fmt: skip
            assert want in body
            s.close({})
        # a port taken: the engine core says which, and how to choose
        with pytest.raises(RuntimeError, match=rf"cannot listen on 127.0.0.1:{port}"):
            vllm_serve.live_sink_for_core(core, 0)
    finally:
        for s in sinks:
            s.shutdown()


def test_float_rounding_never_makes_a_counter_go_down():
    # a TTFT partition whose second settlement sums a label to -1e-15 ms (what rounding
    # leaves of a label that is 0 in every request): the counter stays where it was, since
    # a counter that went down by a hair reads as a reset to Prometheus (increase() doubles)
    calls: list[int] = []

    def partition(window, requests):
        import numpy as np

        calls.append(len(requests))
        v = 0.5 if len(calls) == 1 else -1e-15
        return ("x",), np.full((len(requests), 1), v / len(requests))

    class Clock:
        now = 0

        def __call__(self):
            return self.now

    clk = Clock()
    rec = tracekit.Recorder(None, clock=clk, seconds_per_tick=1e-3, flush_interval_s=1.0,
                            gc=False, handle_signals=False)  # fmt: skip
    live = attach(rec, LiveMetrics(hold_s=0.1, ttft_partitioner=partition))
    seen = []
    with rec:
        rec.request("a", max_new_tokens=3, arrival_tick=0)
        rec.request("b", max_new_tokens=3, arrival_tick=0)
        for k in range(30):  # step k at 100k ms; "b" gets its first token 2 s after "a"
            clk.now = 100 * k
            with rec.step():
                clk.now = 100 * k + 10
                rec.emit(["a"] if k < 3 else (["b"] if 20 <= k < 23 else []))
            if k == 12:  # flushed at step 10's end: let the sink settle "a" by itself
                end = time.monotonic() + 20
                while time.monotonic() < end and live.snapshot()["ttft_n"] < 1:
                    time.sleep(0.01)
            seen.append(live.snapshot()["ttft_cause_ms"].get("x", 0.0))
        clk.now = 3100
    seen.append(live.snapshot()["ttft_cause_ms"]["x"])
    assert calls == [1, 1]  # two settlements, one request each
    assert seen[-1] == 0.5
    assert all(a <= b for a, b in zip(seen, seen[1:], strict=False))


def test_the_api_servers_port_option(env, monkeypatch):
    import multiprocessing

    assert vllm_serve.api_metrics_port() is None  # unset: no API server serves
    env.setenv("TRACEKIT_VLLM_API_METRICS_PORT", "9500")
    assert vllm_serve.api_metrics_port() == 9500
    # its address comes from TRACEKIT_VLLM_METRICS_ADDR, allowed without the engine port
    env.setenv("TRACEKIT_VLLM_METRICS_ADDR", "0.0.0.0")
    assert vllm_serve.live_options() is None
    env.setenv("TRACEKIT_VLLM_API_METRICS_PORT", "95oo")
    with pytest.raises(RuntimeError, match=r"TRACEKIT_VLLM_API_METRICS_PORT='95oo'.*0-65535"):
        vllm_serve.api_metrics_port()
    # API server K (vLLM names its process ApiServer_K) serves on port + K; one API server
    # runs in the launching process: 0
    assert vllm_serve.api_server_index() == 0
    monkeypatch.setattr(multiprocessing.current_process(), "name", "ApiServer_3")
    assert vllm_serve.api_server_index() == 3
