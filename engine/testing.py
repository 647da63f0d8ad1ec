"""A tiny random Qwen3.5-family model with an offline tokenizer, for tests, demos and `--quick` benchmarks.

Nothing here touches the network: the tokenizer is a byte-level BPE trained in-process on a small built-in corpus,
and the weights are drawn from a seeded generator.  The directory written is a complete Hugging Face model folder
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json) that `Engine.load` reads like any other.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from engine.prompt import CHAT_SPECIAL_TOKENS, option_label

# Weights drawn this wide make option distributions sharp and state-dependent; at the usual 0.02 they are near-uniform
# and a cache bug (say, a dropped conv state) moves probabilities by less than a 1e-4 parity test can see.
TINY_INITIALIZER_RANGE = 0.2

_CORPUS = """\
You will read a situation and answer multiple-choice questions about it.
Answer each question with the letter of one option.
Question 1: Is the customer angry? A. yes B. no
Question 2: What does the customer want? A. refund B. replacement C. information D. nothing
Context: The order arrived late and the box was damaged. I want my money back now.
Context: Disk usage on host db-7 crossed 95 percent at 03:12; the backup job failed twice.
Context: Card ending 4411 used in two countries within ten minutes for large amounts.
Answer 1: Answer 2: Answer 3: Answer: A B C D E F G H
The quick brown fox jumps over the lazy dog. Logs, alerts, payments, tickets, orders, users, errors, latency.
"""


def build_tokenizer():
    """A byte-level BPE trained on the built-in corpus: every byte is encodable, option labels are single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    labels = [" " + option_label(i) for i in range(26)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", *CHAT_SPECIAL_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    # Repeating the labels makes " A" .. " Z" merges, so each option label is one token as in the real vocabulary.
    tok.train_from_iterator([_CORPUS] * 4 + [" ".join(labels)] * 50, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def tiny_config(vocab_size: int, pad_token_id: int, **overrides):
    """A Qwen3.5 text config small enough for CPU tests: 4 layers, 3 Gated DeltaNet : 1 full attention."""
    from transformers import Qwen3_5TextConfig

    base = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                max_position_embeddings=4096, initializer_range=TINY_INITIALIZER_RANGE, tie_word_embeddings=True,
                pad_token_id=pad_token_id, eos_token_id=pad_token_id, bos_token_id=None)
    base.update(overrides)
    return Qwen3_5TextConfig(**base)


@contextlib.contextmanager
def _no_progress_bars():
    """transformers' progress bars off while inside (``transformers.utils.logging``), as they were after."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def write_tiny_model(path: str | Path, seed: int = 0, **config_overrides) -> Path:
    """Write a complete HF directory of a tiny random Qwen3.5-family model to `path` and return it.

    Deterministic for a given seed; no network.  `config_overrides` change the text config (layers, sizes).
    """
    from transformers import Qwen3_5ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    cfg = tiny_config(len(tok), tok.pad_token_id, **config_overrides)
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(cfg).eval()
    with _no_progress_bars():  # transformers' "Writing model shards" bar, for a file written in milliseconds
        model.save_pretrained(path)
    tok.save_pretrained(path)
    _stamp_provenance(path, seed)
    return path


def _stamp_provenance(path: Path, seed: int) -> None:
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["_decider_tiny_model_seed"] = seed
    cfg_file.write_text(json.dumps(cfg, indent=2))
