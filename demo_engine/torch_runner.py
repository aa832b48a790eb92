"""The numpy runner's model in torch, on the CPU or a CUDA device (`--backend torch`).

Same config, same random weights (drawn by `NumpyModelRunner` and copied over), same KV
pool layout and the same `ModelRunner` interface, so the engine and the scheduler do not
know which backend runs. The emulated "CUDA graphs" keep their meaning: a decode batch on
a captured size runs as one batched pass over the padded rows (dense layers, and attention
over every row's context at once, padded and masked); above the largest captured size each
sequence runs on its own, which on a GPU is a stream of small kernel launches.

On CUDA, work is asynchronous: `decode_launch` queues the forward pass and the sampling and
starts a non-blocking copy of the samples to pinned host memory, and returns at once;
`PendingSamples.result()` waits for that copy. `decode` is the two in a row (the
synchronous engine). The async-scheduling engine launches step N+1 before it reads step
N's samples; the input token of a row whose previous token is still on the device is taken
from there (`DecodeRow.token_id < 0`, see `prev_token_ref`).

torch is imported by this module only; `import demo_engine` never imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .config import EngineConfig
from .model import DecodeRow, NumpyModelRunner, Samples


class PendingSamples:
    """Samples on their way to the host: device tensors, a copy into pinned host memory
    started without blocking, and the event that marks its end."""

    __slots__ = ("_host", "_event", "_done", "_samples", "_dev_tokens")

    def __init__(self, dev: tuple[torch.Tensor, ...], is_cuda: bool) -> None:
        self._dev_tokens = dev[0]
        if is_cuda:
            self._host = tuple(torch.empty_like(t, device="cpu").pin_memory() for t in dev)
            for h, d in zip(self._host, dev, strict=True):
                h.copy_(d, non_blocking=True)
            self._event: Any = torch.cuda.Event()
            self._event.record()
        else:
            self._host, self._event = dev, None
        self._done = False
        self._samples: Samples | None = None

    @property
    def device_tokens(self) -> torch.Tensor:
        """The sampled token ids, still where they were computed (no wait)."""
        return self._dev_tokens

    def result(self) -> Samples:
        """Wait for the copy (the engine's read of the step's results) and hand back numpy."""
        if self._samples is None:
            if self._event is not None:
                self._event.synchronize()
            ids, lp, top, top_lp = (t.numpy() for t in self._host)
            self._samples = Samples(ids.copy(), lp.copy(), top.copy(), top_lp.copy())
        return self._samples


class TorchModelRunner:
    """Random-weight decoder-only transformer in float32 torch, with a paged KV pool."""

    def __init__(self, config: EngineConfig, vocab_size: int, *, device: str = "cpu") -> None:
        ref = NumpyModelRunner(config, vocab_size)  # the weights, drawn exactly as numpy does
        self.config = config
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.captured_graph_sizes = ref.captured_graph_sizes
        self.num_heads = ref.num_heads
        self.head_dim = ref.head_dim
        self.num_topk = ref.num_topk
        self._scale = float(ref._scale)

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

        self.embed, self.pos = t(ref.embed), t(ref.pos)
        self.layers = [
            {k: t(getattr(L, k)) for k in ("ln1", "w_qkv", "w_o", "ln2", "w_up", "w_down")}
            for L in ref.layers
        ]
        self.ln_f, self.unembed = t(ref.ln_f), t(ref.unembed)
        self.kv = torch.zeros(ref.kv.shape, dtype=torch.float32, device=self.device)
        del ref
        self._prev_tokens: torch.Tensor | None = None  # last launched step's samples

    # -- graph sizes -------------------------------------------------------------------
    def graph_size_for(self, num_rows: int) -> int:
        return NumpyModelRunner.graph_size_for(self, num_rows)  # type: ignore[arg-type]

    # -- forward -----------------------------------------------------------------------
    def _ln(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), eps=1e-5) * g

    @staticmethod
    def _gelu(x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")

    def _tokens(self, rows: Sequence[DecodeRow]) -> torch.Tensor:
        """Input token ids; a negative id is a row of the previous step's samples, read on
        the device (no host round trip)."""
        ids = torch.tensor([r.token_id for r in rows], dtype=torch.int64)
        if (ids >= 0).all():
            return ids.to(self.device, non_blocking=True)
        if self._prev_tokens is None:
            raise ValueError("a row refers to the previous step's samples, but none was launched")
        ids = ids.to(self.device, non_blocking=True)
        prev = self._prev_tokens[(-1 - ids).clamp(min=0)]
        return torch.where(ids >= 0, ids, prev)

    def _decode_rows(self, rows: Sequence[DecodeRow], num_padded: int) -> torch.Tensor:
        """Forward `len(rows)` rows padded to `num_padded`, attention batched over the
        padded rows with a mask over each row's own context; returns logits (n, vocab)."""
        n, dev = len(rows), self.device
        d, h, dh = self.config.d_model, self.num_heads, self.head_dim
        positions = torch.tensor([r.position for r in rows], dtype=torch.int64).to(dev)
        new_slots = torch.tensor([int(r.slots[r.position]) for r in rows], dtype=torch.int64)
        new_slots = new_slots.to(dev)
        ctx = max(r.position + 1 for r in rows)
        slot_mat = np.zeros((num_padded, ctx), np.int64)
        for i, r in enumerate(rows):
            slot_mat[i, : r.position + 1] = r.slots[: r.position + 1]
        slots = torch.from_numpy(slot_mat).to(dev)
        lens = torch.zeros(num_padded, dtype=torch.int64)
        lens[:n] = torch.tensor([r.position + 1 for r in rows])
        mask = torch.arange(ctx)[None, :] >= lens.to(torch.int64)[:, None]  # True: no key
        mask = mask.to(dev)
        x = torch.zeros((num_padded, d), dtype=torch.float32, device=dev)
        x[:n] = self.embed[self._tokens(rows)] + self.pos[positions]
        for li, L in enumerate(self.layers):
            qkv = self._ln(x, L["ln1"]) @ L["w_qkv"]  # (P, 3d)
            self.kv[li, 0, new_slots] = qkv[:n, d : 2 * d]
            self.kv[li, 1, new_slots] = qkv[:n, 2 * d :]
            k = self.kv[li, 0][slots].view(num_padded, ctx, h, dh)  # gathered from the pool
            v = self.kv[li, 1][slots].view(num_padded, ctx, h, dh)
            q = qkv[:, :d].view(num_padded, h, dh)
            s = torch.einsum("pnhd,phd->phn", k, q) * self._scale
            s = s.masked_fill(mask[:, None, :], float("-inf"))
            s[n:] = 0.0  # padded rows: any finite scores, their output is dropped
            p = torch.softmax(s, dim=-1)
            attn = torch.einsum("phn,pnhd->phd", p, v).reshape(num_padded, d)
            x = x + attn @ L["w_o"]
            x = x + self._gelu(self._ln(x, L["ln2"]) @ L["w_up"]) @ L["w_down"]
        return (self._ln(x, self.ln_f) @ self.unembed)[:n]

    def decode_launch(self, rows: Sequence[DecodeRow], graph_size: int) -> PendingSamples:
        """Queue one decode forward pass and its sampling; returns without waiting."""
        n = len(rows)
        if graph_size > 0:  # "replay": one batched pass over the padded size
            if graph_size < n:
                raise ValueError(f"graph size {graph_size} < {n} rows")
            logits = self._decode_rows(rows, graph_size)
        else:  # eager: each sequence on its own, batch of one
            logits = torch.cat([self._decode_rows(rows[i : i + 1], 1) for i in range(n)])
        return self._sample(logits)

    def decode(self, rows: Sequence[DecodeRow], graph_size: int) -> Samples:
        return self.decode_launch(rows, graph_size).result()

    def prefill_launch(
        self, token_ids: Sequence[int], start_pos: int, slots: np.ndarray, *, is_last: bool
    ) -> PendingSamples | None:
        c, dev = self.config, self.device
        d, h, dh = c.d_model, self.num_heads, self.head_dim
        m = len(token_ids)
        end = start_pos + m
        if slots.size < end:
            raise ValueError(f"prefill to position {end} with only {slots.size} slots")
        toks = torch.tensor(list(token_ids), dtype=torch.int64).to(dev)
        x = self.embed[toks] + self.pos[start_pos:end]
        causal = (torch.arange(end)[None, :] > torch.arange(start_pos, end)[:, None]).to(dev)
        ctx = torch.from_numpy(np.ascontiguousarray(slots[:end], np.int64)).to(dev)
        new = ctx[start_pos:end]
        for li, L in enumerate(self.layers):
            qkv = self._ln(x, L["ln1"]) @ L["w_qkv"]
            self.kv[li, 0, new] = qkv[:, d : 2 * d]
            self.kv[li, 1, new] = qkv[:, 2 * d :]
            q = qkv[:, :d].view(m, h, dh).transpose(0, 1)  # (h, m, dh)
            k = self.kv[li, 0][ctx].view(end, h, dh).permute(1, 2, 0)  # (h, dh, end)
            v = self.kv[li, 1][ctx].view(end, h, dh).transpose(0, 1)  # (h, end, dh)
            s = (q @ k) * self._scale
            s = s.masked_fill(causal[None], float("-inf"))
            o = (torch.softmax(s, dim=-1) @ v).transpose(0, 1).reshape(m, d)
            x = x + o @ L["w_o"]
            x = x + self._gelu(self._ln(x, L["ln2"]) @ L["w_up"]) @ L["w_down"]
        if not is_last:
            return None
        return self._sample(self._ln(x[-1:], self.ln_f) @ self.unembed)

    def prefill(
        self, token_ids: Sequence[int], start_pos: int, slots: np.ndarray, *, is_last: bool
    ) -> Samples | None:
        p = self.prefill_launch(token_ids, start_pos, slots, is_last=is_last)
        return None if p is None else p.result()

    def _sample(self, logits: torch.Tensor) -> PendingSamples:
        """Greedy token plus the top-k logprobs, on the device."""
        lp = torch.log_softmax(logits, dim=-1)
        top_lp, top = torch.topk(lp, self.num_topk, dim=-1)  # sorted, largest first
        return PendingSamples((top[:, 0], top_lp[:, 0], top, top_lp), self.is_cuda)

    def set_step_outputs(self, pending: Sequence[PendingSamples]) -> None:
        """The samples of the step just launched, in row order: what placeholder token ids
        (`prev_token_ref`) of the next step refer to."""
        toks = [p.device_tokens for p in pending]
        self._prev_tokens = toks[0] if len(toks) == 1 else torch.cat(toks)

    # -- swapping ------------------------------------------------------------------------
    def swap_out(self, slots: np.ndarray) -> np.ndarray:
        idx = torch.from_numpy(np.asarray(slots, np.int64)).to(self.device)
        return self.kv[:, :, idx, :].cpu().numpy()  # waits: the KV must be on the host

    def swap_in(self, host_kv: np.ndarray, slots: np.ndarray) -> None:
        idx = torch.from_numpy(np.asarray(slots, np.int64)).to(self.device)
        self.kv[:, :, idx, :] = torch.from_numpy(host_kv).to(self.device)
