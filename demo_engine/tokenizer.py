"""A real BPE tokenizer (HuggingFace `tokenizers`), trained in-process at startup.

`train_tokenizer` trains it on the workload's lexicon. `OffLoopTokenizer` runs it in a
worker process (the `+tokenize off-loop` rung): the engine submits text on arrival and
polls for token ids, so the loop never waits on the tokenizer (it may still compete with
it for a core).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
from array import array
from typing import Any

from .config import WorkloadConfig
from .workload import training_corpus


def train_tokenizer(vocab_size: int, cfg: WorkloadConfig) -> Any:
    """A BPE tokenizer with a whitespace pre-tokenizer, trained on the synthetic corpus."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one core for the loop
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["[UNK]"], show_progress=False
    )
    tok.train_from_iterator(training_corpus(cfg), trainer=trainer)
    return tok


def _worker(tokenizer_json: str, max_tokens: int, inbox: Any, outbox: Any) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    while True:
        item = inbox.get()
        if item is None:
            return
        key, text = item
        ids = tok.encode(text).ids[:max_tokens]
        outbox.put((key, array("i", ids).tobytes()))


class OffLoopTokenizer:
    """Tokenises in a spawned worker process; `submit` and `poll` never block the loop."""

    def __init__(self, tokenizer: Any, max_tokens: int) -> None:
        ctx = mp.get_context("spawn")  # no fork of a process holding tokenizers' thread pool
        self._inbox: Any = ctx.Queue()
        self._outbox: Any = ctx.Queue()
        self._proc = ctx.Process(
            target=_worker,
            args=(tokenizer.to_str(), max_tokens, self._inbox, self._outbox),
            daemon=True,
        )
        self._proc.start()
        self.num_pending = 0

    def warm_up(self, timeout_s: float = 60.0) -> None:
        """Wait until the worker has started and answered once (startup, not serving)."""
        self._inbox.put((-1, "warm up"))
        self._outbox.get(timeout=timeout_s)

    def submit(self, key: int, text: str) -> None:
        self._inbox.put((key, text))
        self.num_pending += 1

    def poll(self) -> list[tuple[int, list[int]]]:
        """Every result that is ready now, as (key, token ids)."""
        out = []
        while self.num_pending:
            try:
                key, raw = self._outbox.get_nowait()
            except queue.Empty:
                break
            self.num_pending -= 1
            out.append((key, array("i", raw).tolist()))
        return out

    def wait_all(self, timeout_s: float = 60.0) -> list[tuple[int, list[int]]]:
        """Every pending result, waiting for each as long as it takes (up to `timeout_s`)."""
        out = []
        while self.num_pending:
            key, raw = self._outbox.get(timeout=timeout_s)
            self.num_pending -= 1
            out.append((key, array("i", raw).tolist()))
        return out

    def close(self) -> None:
        if self._proc.is_alive():
            self._inbox.put(None)
            self._proc.join(timeout=5)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(timeout=5)
        self._inbox.close()
        self._outbox.close()
