"""The engine's fastest forward over whole prompts, with no prefix cache: what a good server that recomputes the
prompt for every state costs (vLLM and SGLang cannot reuse a short prefix on hybrid Gated DeltaNet models).
The benchmark's `full_fast` method; its results equal the oracle's up to kernel rounding."""
from __future__ import annotations

from typing import Sequence

import torch

from engine.graphs import B_BUCKETS, FULL_PROMPT_STEP, GraphCache, bucket
from engine.model import CausalContext
from engine.prompt import DEFAULT_MAX_CTX_TOKENS, MAX_OPTIONS, ChatTemplate, parse_questions, resolve_temperatures
from engine.readout import fill_ids, option_mask, read_slots
from engine.reference import build_full_prompts


class FullPromptScorer:
    """Scores whole prompts in one right-padded batch through the engine's own layer loop; on CUDA as graphs
    per (batch bucket, length bucket), like a server would."""

    def __init__(self, eng, use_graphs: bool = True):
        self.e, self.fwd = eng, eng.forward
        self.graphs = GraphCache() if (use_graphs and eng.use_graphs) else None

    def prompts(self, questions: Sequence[dict], states: Sequence[str], independent: bool = False,
                chat: ChatTemplate | None = None, max_ctx_tokens: int = DEFAULT_MAX_CTX_TOKENS):
        """CPU part: -> (questions, prompts, slots) for `score_prompts`."""
        qs = parse_questions(questions)
        return (qs, *build_full_prompts(self.e.tok, qs, states, independent, chat, max_ctx_tokens))

    @torch.no_grad()
    def score_prompts(self, qs, prompts: list[list[int]], slots: list[tuple[int, int]], temperature=None) -> torch.Tensor:
        """-> [n_states, n_questions, MAX_OPTIONS] float32 on the device."""
        dev, n, tmax = self.e.dev, len(prompts), max(map(len, prompts))
        T_bucket = -(-tmax // FULL_PROMPT_STEP) * FULL_PROMPT_STEP if tmax <= 4096 else None
        graphed = self.graphs is not None and T_bucket is not None and n <= B_BUCKETS[-1]
        B, T = (bucket(n, B_BUCKETS), T_bucket) if graphed else (n, tmax)
        n_states = len(slots) // len(qs)
        S = len(slots) * B // n
        flat = torch.zeros(S, dtype=torch.long)
        flat[:len(slots)] = torch.tensor([i * T + p for i, p in slots])
        inv_t = (1.0 / torch.tensor(resolve_temperatures(qs, temperature))).repeat(S // len(qs))[:, None]
        mask = option_mask([len(q.options) for q in qs]).repeat(S // len(qs), 1)
        ids = fill_ids(prompts, B, T, self.e.tok.pad_token_id)
        inputs = tuple(x.to(dev, non_blocking=True) for x in (ids, flat, inv_t, mask))
        if graphed:
            probs = self.graphs.run(("full", B, T), inputs, lambda: (self._step, None))
        else:
            probs = self._step(*inputs)
        return probs[:len(slots)].view(n_states, len(qs), MAX_OPTIONS)

    def _step(self, ids, flat, inv_t, mask):
        pos = torch.arange(ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)
        hidden = self.fwd.layers(ids, pos, CausalContext())
        return read_slots(hidden, flat, self.fwd.final_norm, self.e.W, inv_t, mask)
