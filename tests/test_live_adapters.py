"""The live sink on a real engine: transformers' continuous batching (CPU, tiny random
Llama) recorded through its adapter, whose `Recorder` feeds a `LiveMetrics` sink. After
the run, the sink's totals equal the offline partition of the saved log.
"""

from __future__ import annotations

import os

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


def test_transformers_cb_run_live_totals_equal_the_offline_partition(tmp_path):
    import torch

    path = build_tiny_llama(tmp_path / "tiny-llama")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa"
    )
    inputs = [tok(p).input_ids for p in tiny_prompts(6, seed=2)]
    # a small KV pool (the engine soft-resets requests: evictions) and eos -1 (random
    # weights must not stop early)
    cb = transformers.ContinuousBatchingConfig(
        page_size=16, num_blocks=8, use_async_batching=False, use_cuda_graph=False
    )
    gen = transformers.GenerationConfig(max_new_tokens=32, do_sample=False, eos_token_id=-1)
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
