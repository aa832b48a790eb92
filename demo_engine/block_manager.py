"""The block KV pool's bookkeeping: which 16-token blocks each request holds.

The KV data itself lives in the model runner (`ModelRunner.kv`); this class only hands
out and takes back block ids, like a real engine's block manager. A request's KV for
token position `p` lives at slot `block_table[p // block_size] * block_size + p % block_size`.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import numpy as np


class HoldsBlocks(Protocol):
    block_table: list[int]


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("BlockManager needs num_blocks >= 1 and block_size >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._offsets = np.arange(block_size, dtype=np.int64)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return num_blocks_for(num_tokens, self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, req: HoldsBlocks, num_tokens: int) -> None:
        """Grow `req`'s block table to hold `num_tokens` tokens (never shrinks it)."""
        need = self.blocks_for(num_tokens) - len(req.block_table)
        if need > len(self._free):
            raise RuntimeError(f"KV pool exhausted: need {need} blocks, {len(self._free)} free")
        for _ in range(need):
            req.block_table.append(self._free.popleft())

    def can_append(self, req: HoldsBlocks, num_tokens: int) -> bool:
        """Can `req` grow to `num_tokens` tokens (one more than now, in a decode step)?"""
        need = self.blocks_for(num_tokens) - len(req.block_table)
        return need <= len(self._free)

    def free(self, req: HoldsBlocks) -> None:
        self._free.extend(req.block_table)
        req.block_table.clear()

    def slots(self, req: HoldsBlocks, num_tokens: int) -> np.ndarray:
        """KV slot indices of positions 0..num_tokens-1 of `req`."""
        bt = np.asarray(req.block_table, dtype=np.int64)
        flat = (bt[:, None] * self.block_size + self._offsets).ravel()
        if num_tokens > flat.size:
            raise ValueError(f"{num_tokens} tokens do not fit in {bt.size} blocks")
        return flat[:num_tokens]
