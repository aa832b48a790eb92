"""The model runner: a random-weight numpy transformer that owns the KV pool.

`ModelRunner` is the interface the engine uses, so another backend (torch) can stand in:
prefill a chunk, decode a batch on a captured size or eagerly, copy KV blocks out to host
arrays and back. `NumpyModelRunner` implements it on the CPU.

Emulated "CUDA graphs": a decode batch of n rows is padded to the smallest captured size
>= n and each layer's dense projections run as one batched numpy call over the padded
rows; above the largest captured size the batch runs eagerly: unpadded, with each layer's
attention output projection called once per sequence (the small per-sequence calls stand
in for the kernel launches a graph replay saves), and the rest batched, as on the
captured path. So an eager step costs somewhat more than
a captured step of its size (the per-sequence calls outweigh the padding they save):
graph misses are small and frequent, as in the reference post. What differs is batched
vs per-sequence numpy, not graph replay vs kernel launches. Attention is ragged (each
sequence has its own context) and runs per sequence on both paths, reading its KV from
the paged pool through its block table, like paged attention.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .config import EngineConfig


@dataclass(slots=True)
class Samples:
    """The model's choice for each row: greedy token, its logprob, and the top-k."""

    token_ids: np.ndarray  # (n,) int64
    logprobs: np.ndarray  # (n,) float32: logprob of the chosen token
    topk_ids: np.ndarray  # (n, k) int64
    topk_logprobs: np.ndarray  # (n, k) float32


@dataclass(slots=True)
class DecodeRow:
    """One decode row: feed `token_id` at `position`; `slots` are KV slots 0..position."""

    token_id: int
    position: int
    slots: np.ndarray


def prev_token_ref(row_index: int) -> int:
    """The token id that stands for row `row_index` of the last launched step's samples,
    still on the device (the async-scheduling engine's placeholder, always negative)."""
    return -1 - row_index


class ModelRunner(Protocol):
    """What the engine needs from a model backend."""

    captured_graph_sizes: tuple[int, ...]

    def graph_size_for(self, num_rows: int) -> int:
        """-1 no rows, 0 eager (above the largest captured size), else the padded size."""
        ...

    def prefill(
        self, token_ids: Sequence[int], start_pos: int, slots: np.ndarray, *, is_last: bool
    ) -> Samples | None:
        """Compute KV for tokens at positions start_pos.. (slots cover 0..end); sample
        the next token if the chunk completes the sequence (`is_last`)."""
        ...

    def decode(self, rows: Sequence[DecodeRow], graph_size: int) -> Samples:
        """One decode forward pass over `rows`, padded to `graph_size` (0: eager)."""
        ...

    def swap_out(self, slots: np.ndarray) -> np.ndarray:
        """Copy the KV at `slots` to a host array (the caller frees the blocks)."""
        ...

    def swap_in(self, host_kv: np.ndarray, slots: np.ndarray) -> None:
        """Copy a host array from `swap_out` back into the pool at `slots`."""
        ...


def _layernorm(x: np.ndarray, g: np.ndarray) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    xc = x - mu
    var = (xc * xc).mean(-1, keepdims=True)
    return xc / np.sqrt(var + 1e-5) * g


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))


@dataclass(slots=True)
class _Layer:
    ln1: np.ndarray
    w_qkv: np.ndarray
    w_o: np.ndarray
    ln2: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray


class NumpyModelRunner:
    """Random-weight decoder-only transformer in float32 numpy, with a paged KV pool."""

    def __init__(self, config: EngineConfig, vocab_size: int) -> None:
        c = config
        self.config = c
        self.vocab_size = vocab_size
        self.captured_graph_sizes = tuple(c.captured_graph_sizes)
        self.num_heads = c.num_heads
        self.head_dim = c.d_model // c.num_heads
        self.num_topk = c.num_topk_logprobs
        d = c.d_model
        rng = np.random.default_rng(c.model_seed)

        def w(*shape: int, scale: float) -> np.ndarray:
            return (rng.standard_normal(shape) * scale).astype(np.float32)

        max_pos = c.max_prompt_tokens + c.max_new_tokens + 1
        self.embed = w(vocab_size, d, scale=0.02)
        self.pos = w(max_pos, d, scale=0.02)
        self.layers = [
            _Layer(
                ln1=np.ones(d, np.float32),
                w_qkv=w(d, 3 * d, scale=d**-0.5),
                w_o=w(d, d, scale=d**-0.5),
                ln2=np.ones(d, np.float32),
                w_up=w(d, 4 * d, scale=d**-0.5),
                w_down=w(4 * d, d, scale=(4 * d) ** -0.5),
            )
            for _ in range(c.num_layers)
        ]
        self.ln_f = np.ones(d, np.float32)
        self.unembed = np.ascontiguousarray(w(d, vocab_size, scale=d**-0.5))
        # the KV pool ("device memory"): [layer, k/v, slot, d_model], slot = block*bs + offset
        self.kv = np.zeros((c.num_layers, 2, c.num_kv_blocks * c.block_size, d), np.float32)
        self._scale = np.float32(self.head_dim**-0.5)

    # -- graph sizes -------------------------------------------------------------------
    def graph_size_for(self, num_rows: int) -> int:
        if num_rows <= 0:
            return -1
        sizes = self.captured_graph_sizes
        i = bisect.bisect_left(sizes, num_rows)
        return sizes[i] if i < len(sizes) else 0

    # -- forward -----------------------------------------------------------------------
    def _attend_one(self, layer: int, q: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Single-query attention of q (d,) over the KV at `slots` -> (d,)."""
        h, dh = self.num_heads, self.head_dim
        k = self.kv[layer, 0][slots].reshape(-1, h, dh)  # (n, h, dh), gathered from the pool
        v = self.kv[layer, 1][slots].reshape(-1, h, dh)
        s = np.einsum("nhd,hd->hn", k, q.reshape(h, dh)) * self._scale
        s -= s.max(-1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(-1, keepdims=True)
        return np.einsum("hn,nhd->hd", p, v).reshape(-1)

    def _decode_rows(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        rows: Sequence[DecodeRow],
        num_padded: int,
        *,
        is_eager: bool = False,
    ) -> np.ndarray:
        """Forward `len(rows)` rows padded to `num_padded` rows; returns logits (n, vocab).
        `is_eager`: the attention output projection runs once per row, not once per batch."""
        n = len(rows)
        d = self.config.d_model
        x = np.zeros((num_padded, d), np.float32)
        x[:n] = self.embed[tokens] + self.pos[positions]
        new_slots = np.fromiter((r.slots[r.position] for r in rows), np.int64, n)
        attn = np.zeros((num_padded, d), np.float32)

        def dense(fn: Any, a: np.ndarray) -> np.ndarray:
            if not is_eager:
                return fn(a)  # one call over the (padded) batch
            return np.concatenate([fn(a[i : i + 1]) for i in range(len(a))])

        for li, L in enumerate(self.layers):
            qkv = _layernorm(x, L.ln1) @ L.w_qkv  # (P, 3d)
            self.kv[li, 0][new_slots] = qkv[:n, d : 2 * d]
            self.kv[li, 1][new_slots] = qkv[:n, 2 * d :]
            for i, r in enumerate(rows):  # ragged attention, each sequence its own context
                attn[i] = self._attend_one(li, qkv[i, :d], r.slots)
            x = x + dense(lambda a, L=L: a @ L.w_o, attn)
            x = x + _gelu(_layernorm(x, L.ln2) @ L.w_up) @ L.w_down
        logits = _layernorm(x, self.ln_f) @ self.unembed  # (P, vocab), batched on both paths
        return logits[:n]

    def decode(self, rows: Sequence[DecodeRow], graph_size: int) -> Samples:
        n = len(rows)
        tokens = np.fromiter((r.token_id for r in rows), np.int64, n)
        positions = np.fromiter((r.position for r in rows), np.int64, n)
        if graph_size > 0:  # "replay": one batched call over the padded size
            if graph_size < n:
                raise ValueError(f"graph size {graph_size} < {n} rows")
            logits = self._decode_rows(tokens, positions, rows, graph_size)
        else:  # eager: unpadded, the attention output projection once per sequence
            logits = self._decode_rows(tokens, positions, rows, n, is_eager=True)
        return self._sample(logits)

    def prefill(
        self, token_ids: Sequence[int], start_pos: int, slots: np.ndarray, *, is_last: bool
    ) -> Samples | None:
        c = self.config
        d, h, dh = c.d_model, self.num_heads, self.head_dim
        m = len(token_ids)
        end = start_pos + m
        if slots.size < end:
            raise ValueError(f"prefill to position {end} with only {slots.size} slots")
        toks = np.asarray(token_ids, np.int64)
        x = self.embed[toks] + self.pos[start_pos:end]
        # causal mask for queries start_pos..end-1 over keys 0..end-1
        bias = np.where(
            np.arange(end)[None, :] > np.arange(start_pos, end)[:, None],
            np.float32(-1e9),
            np.float32(0),
        )
        ctx = slots[:end]
        for li, L in enumerate(self.layers):
            qkv = _layernorm(x, L.ln1) @ L.w_qkv
            self.kv[li, 0][slots[start_pos:end]] = qkv[:, d : 2 * d]
            self.kv[li, 1][slots[start_pos:end]] = qkv[:, 2 * d :]
            q = qkv[:, :d].reshape(m, h, dh).transpose(1, 0, 2)  # (h, m, dh)
            k = self.kv[li, 0][ctx].reshape(end, h, dh).transpose(1, 2, 0)  # (h, dh, end)
            v = self.kv[li, 1][ctx].reshape(end, h, dh).transpose(1, 0, 2)  # (h, end, dh)
            s = q @ k  # (h, m, end)
            s *= self._scale
            s += bias
            s -= s.max(-1, keepdims=True)
            np.exp(s, out=s)
            s /= s.sum(-1, keepdims=True)
            o = (s @ v).transpose(1, 0, 2).reshape(m, d)
            x = x + o @ L.w_o
            x = x + _gelu(_layernorm(x, L.ln2) @ L.w_up) @ L.w_down
        if not is_last:
            return None
        logits = _layernorm(x[-1:], self.ln_f) @ self.unembed
        return self._sample(logits)

    def _sample(self, logits: np.ndarray) -> Samples:
        """Greedy token plus the top-k logprobs (what a history store keeps per token)."""
        k = self.num_topk
        mx = logits.max(-1, keepdims=True)
        lse = mx + np.log(np.exp(logits - mx).sum(-1, keepdims=True))
        top = np.argpartition(logits, -k, axis=-1)[:, -k:]
        top_lp = np.take_along_axis(logits, top, -1) - lse
        order = np.argsort(-top_lp, axis=-1)
        top = np.take_along_axis(top, order, -1)
        top_lp = np.take_along_axis(top_lp, order, -1)
        return Samples(top[:, 0].copy(), top_lp[:, 0].copy(), top, top_lp)

    # -- swapping ------------------------------------------------------------------------
    def swap_out(self, slots: np.ndarray) -> np.ndarray:
        return self.kv[:, :, slots, :]  # fancy indexing: a real copy to a host array

    def swap_in(self, host_kv: np.ndarray, slots: np.ndarray) -> None:
        self.kv[:, :, slots, :] = host_kv


class SlowedRunner:
    """`inner` with its compute stretched `factor` times: every prefill, decode and swap
    is followed by `factor - 1` times its own CPU time of busy work (CPU, not a sleep, so
    it shows on a CPU clock as it would on a slower machine). A stand-in for a slower
    machine, to check that the workload's regime does not depend on the machine's speed
    (synchronous calls only; everything else is `inner`'s)."""

    def __init__(self, inner: ModelRunner, factor: float) -> None:
        if not factor >= 1.0:
            raise ValueError(f"a compute slowdown must be >= 1, got {factor}")
        self._inner = inner
        self._extra = factor - 1.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _stretch(self, t0: float) -> None:
        t1 = time.process_time()
        until = t1 + self._extra * (t1 - t0)
        while time.process_time() < until:
            pass

    def prefill(
        self, token_ids: Sequence[int], start_pos: int, slots: np.ndarray, *, is_last: bool
    ) -> Samples | None:
        t0 = time.process_time()
        out = self._inner.prefill(token_ids, start_pos, slots, is_last=is_last)
        self._stretch(t0)
        return out

    def decode(self, rows: Sequence[DecodeRow], graph_size: int) -> Samples:
        t0 = time.process_time()
        out = self._inner.decode(rows, graph_size)
        self._stretch(t0)
        return out

    def swap_out(self, slots: np.ndarray) -> np.ndarray:
        t0 = time.process_time()
        out = self._inner.swap_out(slots)
        self._stretch(t0)
        return out

    def swap_in(self, host_kv: np.ndarray, slots: np.ndarray) -> None:
        t0 = time.process_time()
        self._inner.swap_in(host_kv, slots)
        self._stretch(t0)
