"""The demo engine on torch: the same model as numpy, and async scheduling that emits the
very same tokens one iteration later. Skipped without torch; the CUDA test needs a GPU."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_demo_engine import SMALL, _burst  # noqa: E402

import tracekit  # noqa: E402
from demo_engine.config import WorkloadConfig  # noqa: E402
from demo_engine.engine import Engine  # noqa: E402
from demo_engine.history import ObjectHistory  # noqa: E402
from demo_engine.model import DecodeRow, NumpyModelRunner, prev_token_ref  # noqa: E402
from demo_engine.tokenizer import train_tokenizer  # noqa: E402
from demo_engine.torch_runner import TorchModelRunner  # noqa: E402
from tracekit.attribution.itl import partition  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(512, WorkloadConfig())


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class KeptHistory(ObjectHistory):
    """Keeps each finished request's tokens instead of dropping them."""

    def __init__(self) -> None:
        super().__init__()
        self.done: dict[int, list[int]] = {}

    def close(self, rid: int) -> None:
        self.done[rid] = [r.token_id for r in self._by_rid.get(rid, [])]
        super().close(rid)


def test_torch_runner_is_the_numpy_model():
    cfg = SMALL
    a, b = NumpyModelRunner(cfg, 512), TorchModelRunner(cfg, 512)
    slots = [np.arange(i * 100, i * 100 + 100) for i in range(3)]
    for r in (a, b):
        r.prefill(list(range(5, 20)), 0, slots[1], is_last=False)  # a chunk, then the rest
    got = []
    for r in (a, b):
        s0 = r.prefill(list(range(1, 30)), 0, slots[0], is_last=True)
        s1 = r.prefill(list(range(20, 40)), 15, slots[1], is_last=True)
        s2 = r.prefill([7, 8, 9], 0, slots[2], is_last=True)
        firsts = [s0, s1, s2]
        pos = (29, 35, 3)
        rows = [
            DecodeRow(int(s.token_ids[0]), p, sl[: p + 1])
            for s, p, sl in zip(firsts, pos, slots, strict=True)
        ]
        d = r.decode(rows, 4)  # padded to a captured size
        rows = [
            DecodeRow(int(t), p + 1, sl[: p + 2])
            for t, p, sl in zip(d.token_ids, pos, slots, strict=True)
        ]
        e = r.decode(rows, 0)  # eager, one sequence at a time
        got.append((*firsts, d, e))
    for x, y in zip(*got, strict=True):
        np.testing.assert_array_equal(x.token_ids, y.token_ids)
        np.testing.assert_array_equal(x.topk_ids, y.topk_ids)
        np.testing.assert_allclose(x.topk_logprobs, y.topk_logprobs, atol=1e-4)
    np.testing.assert_allclose(a.swap_out(slots[0]), b.swap_out(slots[0]), atol=1e-4)


def test_placeholder_tokens_are_read_on_the_device():
    r = TorchModelRunner(SMALL, 512)
    sl = np.arange(64)
    s0 = r.prefill(list(range(1, 30)), 0, sl, is_last=True)
    p = r.decode_launch([DecodeRow(int(s0.token_ids[0]), 29, sl[:30])], 1)
    r.set_step_outputs([p])
    q = r.decode_launch([DecodeRow(prev_token_ref(0), 30, sl[:31])], 1)  # not read yet
    ref = TorchModelRunner(SMALL, 512)
    s0 = ref.prefill(list(range(1, 30)), 0, sl, is_last=True)
    p2 = ref.decode([DecodeRow(int(s0.token_ids[0]), 29, sl[:30])], 1)
    q2 = ref.decode([DecodeRow(int(p2.token_ids[0]), 30, sl[:31])], 1)
    assert q.result().token_ids.tolist() == q2.token_ids.tolist()


def _serve(cfg, tokenizer, runner, path=None):
    rec = tracekit.Recorder(path, gc=False, config={"rung": "test", "engine": cfg.to_dict()})
    with rec:
        eng = Engine(cfg, rec, tokenizer, runner=runner)
        eng.history = KeptHistory()
        try:
            stats = eng.serve(_burst(10), 60.0, is_drain=True)
        finally:
            eng.close()
    return eng.history.done, stats, rec.log()


def test_async_scheduling_emits_the_same_tokens_one_iteration_later(tokenizer):
    # a pool small enough to preempt: placeholders must survive swap out and in
    cfg = SMALL.replace(num_kv_blocks=24)
    v = tokenizer.get_vocab_size()
    ref, ref_stats, _ = _serve(cfg, tokenizer, None)  # numpy, synchronous
    sync, _, sync_log = _serve(cfg, tokenizer, TorchModelRunner(cfg, v))
    acfg = cfg.replace(is_async_scheduling=True)
    got, stats, log = _serve(acfg, tokenizer, TorchModelRunner(acfg, v))
    assert ref_stats.num_preemptions > 0
    assert len(ref) == 10 and got == sync == ref
    assert stats.num_tokens == ref_stats.num_tokens == len(log.emissions)
    # each step's tokens are emitted by the next iteration: one more step, no emission in
    # the first, and every emission's step follows a step that launched work
    assert len(log.steps) == len(sync_log.steps) + 1
    assert log.emissions.step.min() == 1
    assert partition(log).reconcile_max_err_ms < 1e-6


def test_async_scheduling_needs_a_runner_that_launches(tokenizer):
    rec = tracekit.Recorder(None, enabled=False)
    with pytest.raises(ValueError, match="launches without waiting"):
        Engine(SMALL.replace(is_async_scheduling=True), rec, tokenizer)


def test_cli_runs_the_torch_backend_with_async_scheduling(tmp_path):
    from click.testing import CliRunner

    from demo_engine.cli import demo

    args = ["run", "--duration", "1", "--rate", "4", "--out", str(tmp_path), "--quiet"]
    res = CliRunner().invoke(demo, [*args, "--backend", "torch", "--async-scheduling"])
    assert res.exit_code == 0, res.output
    log = tracekit.load(tmp_path / "baseline__s1.npz")
    assert log.config["backend"] == "torch" and log.config["engine"]["is_async_scheduling"]
    assert len(log.emissions) > 0
    bad = CliRunner().invoke(demo, [*args, "--async-scheduling"])
    assert bad.exit_code == 2 and "need --backend torch" in bad.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_on_cuda_records_device_windows_for_every_launch(tokenizer):
    from tracekit.capture.device import CudaEventTimer

    for is_async in (False, True):
        cfg = SMALL.replace(num_kv_blocks=24, is_async_scheduling=is_async)
        runner = TorchModelRunner(cfg, tokenizer.get_vocab_size(), device="cuda")
        rec = tracekit.Recorder(None, gc=False, device_timer=CudaEventTimer())
        with rec:
            eng = Engine(cfg, rec, tokenizer, runner=runner)
            eng.serve(_burst(10), 60.0, is_drain=True)
            eng.close()
        log = rec.log()
        sg = log.segments
        dev, host = sg.is_device == 1, sg.is_device == 0
        model = np.isin(
            sg.label, [log.labels.index(x) for x in ("decode", "prefill") if x in log.labels]
        )
        assert (dev & model).sum() == (host & model).sum() > 0  # one device window per launch
        assert partition(log).reconcile_max_err_ms < 1e-6
        assert abs(log.meta["device_clock_drift_ppm"]) < 1000
