"""A tiny Llama with random weights and a locally trained tokenizer, saved as a HF folder.

No model hub: tests, examples and the overhead bench build the model they run. The folder
loads in both engines: `transformers.AutoModelForCausalLM.from_pretrained(path)` and
`vllm.LLM(model=path)`.

    path = build_tiny_llama("/tmp/tiny-llama")    # about 5 s; reused when already there
    prompts = tiny_prompts(8, seed=0)            # strings the tokenizer knows

Shapes (see /work/shared/engines.md): byte-level BPE, vocab 1024, special tokens
``<unk> <s> </s> <pad>``; hidden 128, intermediate 256, 2 layers, 4 heads, 2 KV heads,
head_dim 32 (vLLM's CPU attention accepts 32), float32.
"""

from __future__ import annotations

import json
import os
import random

VOCAB_SIZE = 1024
SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")
#: Written last: a folder without it is an interrupted build and is rebuilt.
_DONE = "tracekit-tiny-llama.json"

_WORDS = (
    "token step batch cache block queue engine request decode prefill schedule sample "
    "model layer head kernel graph memory page swap evict latency tail gap forward pass "
    "the a of to and in is on for with as by at from that this it be are was were will"
).split()


def _corpus(num_lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        n = rng.randint(6, 24)
        lines.append(" ".join(rng.choice(_WORDS) for _ in range(n)) + f" {rng.randint(0, 9999)}.")
    return lines


def tiny_prompts(num: int, *, seed: int = 0, min_words: int = 8, max_words: int = 24) -> list[str]:
    """`num` prompts drawn from the tokenizer's training vocabulary."""
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words)))
        for _ in range(num)
    ]


def build_tiny_llama(
    path: str | os.PathLike[str], *, seed: int = 0, max_position: int = 512
) -> str:
    """Build (or reuse) the tiny model folder at `path` and return it as a string."""
    path = os.fspath(path)
    if os.path.exists(os.path.join(path, _DONE)):
        return path
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(4000, seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=max_position,
    )
    fast.save_pretrained(path)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=max_position,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(path)
    with open(os.path.join(path, _DONE), "w") as fh:
        json.dump({"seed": seed, "vocab_size": VOCAB_SIZE}, fh)
    return path


__all__ = ["build_tiny_llama", "tiny_prompts", "VOCAB_SIZE"]
