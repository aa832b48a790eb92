"""The live sink on a real engine: transformers' continuous batching (CPU, tiny random
Llama) recorded through its adapter, whose `Recorder` feeds a `LiveMetrics` sink. After
the run, the sink's totals equal the offline partition of the saved log.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
from adapters_common import one_torch_thread

import tracekit

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported (engines.md)

pytestmark = pytest.mark.adapters

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[adapters]')"
)
pytest.importorskip(
    "transformers.generation.continuous_batching.continuous_api",
    reason="this transformers has no continuous batching (the adapter reads 5.19)",
)
pytest.importorskip("prometheus_client")
from engine_adapters.tiny_model import build_tiny_llama, tiny_prompts  # noqa: E402
from engine_adapters.transformers_cb import instrument_transformers  # noqa: E402
from tracekit.attribution.itl import partition  # noqa: E402
from tracekit.attribution.ttft import ttft_partition  # noqa: E402
from tracekit.live import LiveMetrics, attach  # noqa: E402


def _tiny_cb(tmp_path, seed: int):
    """The tiny random Llama, 6 prompts, and a CB config whose small KV pool makes the
    engine soft-reset requests (evictions); eos -1: random weights must not stop early."""
    import torch

    path = build_tiny_llama(tmp_path / "tiny-llama")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa"
    )
    inputs = [tok(p).input_ids for p in tiny_prompts(6, seed=seed)]
    cb = transformers.ContinuousBatchingConfig(
        page_size=16, num_blocks=8, use_async_batching=False, use_cuda_graph=False
    )
    gen = transformers.GenerationConfig(max_new_tokens=32, do_sample=False, eos_token_id=-1)
    return model, inputs, cb, gen


def test_transformers_cb_run_live_totals_equal_the_offline_partition(tmp_path):
    model, inputs, cb, gen = _tiny_cb(tmp_path, seed=2)
    out = tmp_path / "cb.npz"
    rec = tracekit.Recorder(out, flush_interval_s=0.05)  # many flushes in a short run
    live = attach(rec, LiveMetrics(hold_s=0.5))
    with one_torch_thread(), rec, instrument_transformers(rec):
        model.generate_batch(inputs, gen, continuous_batching_config=cb)
    log = tracekit.load(out)
    p = partition(log)
    s = live.snapshot()
    assert s["final"] and s["errors"] == 0 and s["late_rows"] == 0
    assert len(log.evictions) > 0  # the pool forced preemption: `preempt` is exercised
    assert s["gaps"] == len(p) == 6 * 31
    for j, lb in enumerate(p.labels):
        off = float(p.parts_ms[:, j].sum())
        assert s["cause_ms"].get(lb, 0.0) == pytest.approx(off, rel=1e-9, abs=1e-9), lb
    # TTFT by cause: the offline partition's, every label (decode_other and graph as their
    # sum: the graph baseline is the whole run's offline)
    t = ttft_partition(log)
    assert s["ttft_n"] == len(t) > 0
    got = dict(s["ttft_cause_ms"])
    got["decode"] = got.pop("decode_other", 0.0) + got.pop("graph", 0.0)
    want = {lb: float(t.parts_ms[:, j].sum()) for j, lb in enumerate(t.labels)}
    want["decode"] = want.pop("decode_other") + want.pop("graph")
    for lb, v in want.items():
        assert got.get(lb, 0.0) == pytest.approx(v, rel=1e-9, abs=1e-9), lb


def test_a_real_prometheus_scraping_a_transformers_cb_run_sees_the_offline_partition(
    prometheus, tmp_path
):
    """A real Prometheus server (1 s scrapes) scrapes the live sink of a transformers CB run
    recorded through its adapter: `increase()` over the run of every cause counter, and of
    the TTFT cause counters, equals the offline partition of the saved log within 1%
    (docs/live.md; Prometheus' rule: `increase()` of a counter first scraped at 0 that never
    decreases is its last value), and no series ever decreased."""
    from promserver import wait_for

    prom, port = prometheus
    model, inputs, cb, gen = _tiny_cb(tmp_path, seed=3)
    out = tmp_path / "cb.npz"
    rec = tracekit.Recorder(out, flush_interval_s=0.05)
    live = attach(rec, LiveMetrics(hold_s=0.5, const_labels={"run": "cb"}))
    live.serve(port)
    sel = '{job="tracekit",run="cb"}'
    try:
        with one_torch_thread(), rec, instrument_transformers(rec):
            # a lead: Prometheus scrapes every series at 0 (the OS causes' too, which the
            # sink adds when the recorder starts) before the engine runs
            cause = "os_blocked" if sys.platform.startswith("linux") else "gc"
            wait_for(prom, f'tracekit_gap_cause_seconds_total{{run="cb",cause="{cause}"}}')
            model.generate_batch(inputs, gen, continuous_batching_config=cb)
        # the final values, scraped at least once
        wait_for(prom, f"tracekit_live_final{sel} == 1")
        time.sleep(1.5)
    finally:
        live.shutdown()
    log = tracekit.load(out)
    p = partition(log)
    t = ttft_partition(log)
    now = time.time()
    last = prom.one(f"max(max_over_time(timestamp(tracekit_live_final{sel})[5m:1s]))", now)
    first = prom.one(f"min(min_over_time(timestamp(tracekit_gaps_total{sel})[5m:1s]))", last)
    span = f"[{int(last - first) + 5}s]"

    def increase(metric: str, **labels: str) -> float:
        lab = ",".join([sel[1:-1], *(f'{k}="{v}"' for k, v in labels.items())])
        return prom.one(f"increase({metric}{{{lab}}}{span})", last)

    assert increase("tracekit_gaps_total") == pytest.approx(len(p), rel=0.01)
    assert len(p) == 6 * 31
    for j, lb in enumerate(p.labels):
        off = float(p.parts_ms[:, j].sum()) / 1e3
        if lb in ("graph", "forward"):  # their split is a gauge, final at close
            got = prom.one(f'tracekit_gap_decode_split_seconds{{{sel[1:-1]},cause="{lb}"}}', last)
        else:
            got = increase("tracekit_gap_cause_seconds_total", cause=lb)
        assert got == pytest.approx(off, rel=0.01, abs=1e-6), lb
    want = {lb: float(t.parts_ms[:, j].sum()) / 1e3 for j, lb in enumerate(t.labels)}
    want["decode"] = want.pop("decode_other") + want.pop("graph")
    for lb, v in want.items():
        got = increase("tracekit_ttft_cause_seconds_total", cause=lb)
        assert got == pytest.approx(v, rel=0.01, abs=1e-6), lb
    # no counter or bucket ever went down over the run
    for m in ("tracekit_gap_cause_seconds_total", "tracekit_ttft_cause_seconds_total",
              "tracekit_gap_seconds_bucket", "tracekit_gaps_total"):  # fmt: skip
        res = prom.query(f"resets({m}{sel}{span})", last)
        assert res and all(float(r["value"][1]) == 0 for r in res), (m, res)
