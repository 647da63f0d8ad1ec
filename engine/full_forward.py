"""The engine's fastest forward over whole prompts, with no prefix cache: what a good server that recomputes the
prompt for every state costs (vLLM and SGLang cannot reuse a short prefix on hybrid Gated DeltaNet models).
The benchmark's `full_fast` method; its results equal the oracle's up to kernel rounding."""
from __future__ import annotations

from typing import Sequence

import torch

from engine.model import CausalContext, HybridForward
from engine.prompt import DEFAULT_MAX_CTX_TOKENS, MAX_OPTIONS, ChatTemplate, parse_questions
from engine.readout import fill_ids, option_mask, read_slots
from engine.reference import _temperatures, build_full_prompts


class FullPromptScorer:
    """Scores prepared whole prompts in one padded batch through the engine's own layer loop."""

    def __init__(self, eng):
        self.e, self.fwd = eng, HybridForward(eng.model)

    def prompts(self, questions: Sequence[dict], states: Sequence[str], independent: bool = False,
                chat: ChatTemplate | None = None, max_ctx_tokens: int = DEFAULT_MAX_CTX_TOKENS):
        """CPU part: -> (questions, prompts, slots) for `score_prompts`."""
        qs = parse_questions(questions)
        return (qs, *build_full_prompts(self.e.tok, qs, states, independent, chat, max_ctx_tokens))

    @torch.no_grad()
    def score_prompts(self, qs, prompts: list[list[int]], slots: list[tuple[int, int]], temperature=None) -> torch.Tensor:
        """-> [n_states, n_questions, MAX_OPTIONS] float32 on the device."""
        dev = self.e.dev
        T = max(map(len, prompts))
        ids = fill_ids(prompts, len(prompts), T, self.e.tok.pad_token_id).to(dev, non_blocking=True)
        pos = torch.arange(T, device=dev)[None].expand(len(prompts), -1)
        hidden = self.fwd.layers(ids, pos, CausalContext())
        flat = torch.tensor([i * T + p for i, p in slots], device=dev)
        n_states = len(slots) // len(qs)
        inv_t = (1.0 / torch.tensor(_temperatures(qs, temperature))).repeat(n_states)[:, None].to(dev)
        mask = option_mask([len(q.options) for q in qs]).repeat(n_states, 1).to(dev)
        probs = read_slots(hidden, flat, self.e.core.norm, self.e.W, inv_t, mask)
        return probs.view(n_states, len(qs), MAX_OPTIONS)
