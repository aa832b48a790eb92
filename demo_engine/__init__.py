"""A CPU continuous-batching engine that makes every decode-step stall cause real.

Built from the prose of `shared/reference/decode-step-stalls.md` and instrumented only
through tracekit's public recording API (`tracekit.Recorder`). The boundaries are a real
engine's (nano-vllm style):

    Request          one prompt and its generated tokens (`scheduler.py`)
    Scheduler        decode-first, then prefill chunks within a token budget (`scheduler.py`)
    BlockManager     the 16-token block KV pool: which blocks each request holds
    ModelRunner      the model and the KV pool itself (`model.py`; numpy here)
    Engine.step()    the one place that coordinates them, and where the tags are

`workload.py` makes the arrival trace, `tokenizer.py` the BPE tokenizer (on the loop or in
a worker process), `history.py` the per-token history and the startup heap that give GC
its work, `config.py` the settings and the fix ladder's rungs, `cli.py` the `demo` group.
"""

from .config import RUNGS, EngineConfig, WorkloadConfig, rung_config, rung_slug

__all__ = ["RUNGS", "EngineConfig", "WorkloadConfig", "rung_config", "rung_slug"]
