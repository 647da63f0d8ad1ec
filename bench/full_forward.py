"""The benchmark's `full_fast` method: the engine's fastest forward over whole prompts, with no prefix cache, i.e. what
a good server that recomputes the prompt for every state costs (vLLM and SGLang cannot reuse a short prefix on hybrid
Gated DeltaNet models). Its results equal the oracle's up to kernel rounding. It reads the options' probabilities
alone (no label mass: compare it with `cached_*_no_label_mass` for the same work)."""
from __future__ import annotations

from typing import Sequence

import torch

from engine.graphs import GraphManager, StepShape
from engine.model import CausalContext
from engine.prompt import DEFAULT_MAX_CTX_TOKENS, MAX_OPTIONS, ChatTemplate, parse_questions, resolve_temperatures
from engine.readout import PROBABILITIES, fill_ids, option_mask, read_rows
from engine.reference import build_full_prompts

FULL_PROMPT_STEP = 8
"""Whole prompts pad to a multiple of this, up to 4096 tokens: the suffixes' granularity, so that the comparison does
not charge the recomputing server more padding than the cache."""
FULL_PROMPT_LENGTHS = tuple(range(FULL_PROMPT_STEP, 4096 + 1, FULL_PROMPT_STEP))


class FullPromptScorer:
    """Scores whole prompts in one right-padded batch through the engine's own layer loop; on CUDA as graphs
    per (batch bucket, length bucket), like a server would."""

    def __init__(self, eng, use_graphs: bool = True):
        self.e, self.fwd = eng, eng.forward
        self.graphs = GraphManager(enabled=use_graphs and eng.use_graphs, token_lengths=FULL_PROMPT_LENGTHS)

    def prompts(self, questions: Sequence[dict], states: Sequence[str], independent: bool = False,
                chat: ChatTemplate | None = None, max_ctx_tokens: int = DEFAULT_MAX_CTX_TOKENS):
        """CPU part: -> (questions, prompts, slots) for `score_prompts`."""
        qs = parse_questions(questions)
        return (qs, *build_full_prompts(self.e.tok, qs, states, independent, chat, max_ctx_tokens))

    @torch.no_grad()
    def score_prompts(self, qs, prompts: list[list[int]], slots: list[tuple[int, int]], temperature=None) -> torch.Tensor:
        """-> [n_states, n_questions, MAX_OPTIONS] float32 on the device."""
        dev, n = self.e.dev, len(prompts)
        shape = self.graphs.shape(n, max(map(len, prompts)))
        B, T = shape.R, shape.T
        n_states = len(slots) // len(qs)
        S = len(slots) * B // n                                                  # slots of B prompts
        flat = torch.zeros(S, dtype=torch.long)
        flat[:len(slots)] = torch.tensor([i * T + p for i, p in slots])
        inv_t = (1.0 / torch.tensor(resolve_temperatures(qs, temperature))).repeat(S // len(qs))[:, None]
        mask = option_mask([len(q.options) for q in qs]).repeat(S // len(qs), 1)
        ids = fill_ids(prompts, B, T, self.e.tok.pad_token_id)
        inputs = tuple(x.to(dev, non_blocking=True) for x in (ids, flat, inv_t, mask))
        probs = self.graphs.run(("full",), shape, inputs, self._step_fn, out_rows=len(slots))
        return probs.view(n_states, len(qs), MAX_OPTIONS)

    def _step_fn(self, shape: StepShape):
        return self._step, None

    def _step(self, ids, flat, inv_t, mask):
        pos = torch.arange(ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)      # [B, T]
        hidden = self.fwd.layers(ids, pos, CausalContext(), rows=flat)                      # [S, H]
        bias = torch.zeros(mask.shape, device=mask.device)                                  # no calibration
        return read_rows(hidden, self.fwd.final_norm, self.e.W, inv_t, bias, mask)[:, PROBABILITIES]
