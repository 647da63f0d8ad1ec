"""The correctness oracle: the schema-first layout run as one plain transformers forward, no cache.

Every prompt is prefix + suffix ids concatenated (the same ids `SchemaEngine` runs), through
`Qwen3_5ForCausalLM.model` with its own masks and kernels; logits come from the full `lm_head` and are then indexed
at the label tokens.  It shares nothing with the cached path but the prompt layout and the temperature rule.  It is
also the baseline cost model of a server that recomputes the whole prompt for every state.
"""
from __future__ import annotations

from typing import Sequence

import torch

from engine.calibration import CONTENT_FREE_STATES, contextual_bias, option_biases
from engine.errors import InputError
from engine.prompt import (DEFAULT_MAX_CTX_TOKENS, MAX_OPTIONS, ChatTemplate, Question, parse_questions,
                           resolve_temperatures, schema_prefix_ids, schema_suffix_ids)
from engine.readout import option_mask
from engine.scores import Scores


@torch.no_grad()
def score_full(eng, questions: Sequence[dict], states: Sequence[str], independent: bool = False, temperature=None,
               chat: ChatTemplate | None = None, max_ctx_tokens: int = DEFAULT_MAX_CTX_TOKENS,
               batch_size: int = 16, calibration: str = "none") -> list[torch.Tensor]:
    """-> one [n_questions, MAX_OPTIONS] float32 CPU tensor per state, like `SchemaEngine.score` (with the questions'
    `option_bias` and the schema's `calibration`)."""
    return [s.probabilities for s in score_full_details(eng, questions, states, independent, temperature, chat,
                                                          max_ctx_tokens, batch_size, calibration)]


@torch.no_grad()
def score_full_details(eng, questions: Sequence[dict], states: Sequence[str], independent: bool = False,
                       temperature=None, chat: ChatTemplate | None = None,
                       max_ctx_tokens: int = DEFAULT_MAX_CTX_TOKENS, batch_size: int = 16,
                       calibration: str = "none") -> list[Scores]:
    """-> one `engine.scores.Scores` per state, like `SchemaEngine.score_details`: the calibrated and the raw
    probabilities, and the label mass from the full softmax over the vocabulary (every label mass is given)."""
    qs = parse_questions(questions)
    temps = resolve_temperatures(qs, temperature)
    prompts, slots = build_full_prompts(eng.tok, qs, states, independent, chat, max_ctx_tokens)
    hidden = _last_hidden_at(eng, prompts, slots, batch_size)                       # [S, H]
    full = eng.model.lm_head(hidden).float().cpu()                                  # [S, vocabulary]
    logits = full[:, eng.label_ids]                                                 # [S, MAX_OPTIONS]
    n_options = [len(q.options) for q in qs]
    mask = option_mask(n_options).repeat(len(states), 1)
    mass = torch.softmax(full, -1)[:, eng.label_ids].masked_fill(~mask, 0.0).sum(-1)            # [S]
    t = torch.tensor(temps, dtype=torch.float32).repeat(len(states))[:, None]
    bias = option_biases(qs)
    if calibration == "contextual":
        free = score_full_details(eng, [{**_as_dict(q), "option_bias": None} for q in qs], list(CONTENT_FREE_STATES),
                                  independent, 1.0, chat, max_ctx_tokens, batch_size)
        context = contextual_bias([s.probabilities.tolist() for s in free], n_options)
        bias = context if bias is None else bias + context
    b = torch.zeros(len(qs), MAX_OPTIONS) if bias is None else torch.tensor(bias, dtype=torch.float32)
    raw = torch.softmax((logits / t).masked_fill(~mask, float("-inf")), -1)
    probs = torch.softmax(((logits - b.repeat(len(states), 1)) / t).masked_fill(~mask, float("-inf")), -1)
    nq = len(qs)
    return [Scores(p, r, m) for p, r, m in zip(probs.view(-1, nq, MAX_OPTIONS), raw.view(-1, nq, MAX_OPTIONS),
                                               mass.view(-1, nq))]


def _as_dict(q: Question) -> dict:
    return {"question": q.text, "options": list(q.options), "temperature": q.temperature, "id": q.id}


def build_full_prompts(tok, qs: list[Question], states: Sequence[str], independent: bool, chat: ChatTemplate | None,
                       max_ctx_tokens: int) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Whole prompts (prefix + suffix ids), one per (state, prefix group), and every answer slot as
    (prompt index, position), in (state, question) order."""
    if isinstance(states, str) or not isinstance(states, Sequence) or not states:
        raise InputError("states: expected a non-empty list of strings")
    groups = [[q] for q in qs] if independent else [qs]
    prefixes = [schema_prefix_ids(tok, g, chat=chat) for g in groups]
    prompts, slots = [], []
    for s in states:
        if not isinstance(s, str):
            raise InputError(f"state must be a string, got {type(s).__name__}")
        for g, pre in zip(groups, prefixes):
            suf, pos, _ = schema_suffix_ids(tok, s, len(g), max_ctx_tokens, chat=chat)
            slots += [(len(prompts), len(pre) + p) for p in pos]
            prompts.append(pre + suf)
    return prompts, slots


def _last_hidden_at(eng, prompts: list[list[int]], slots: list[tuple[int, int]], batch_size: int) -> torch.Tensor:
    """Final-norm hidden states at each (prompt, position), running prompts in right-padded batches."""
    out = []
    pad = eng.tok.pad_token_id
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        T = max(map(len, batch))
        ids = torch.tensor([p + [pad] * (T - len(p)) for p in batch], device=eng.dev)
        # Right padding needs no mask: every layer is causal, so pad tokens after a prompt never reach its positions.
        hs = eng.core(input_ids=ids, use_cache=False).last_hidden_state
        want = [(i - start, pos) for i, pos in slots if start <= i < start + len(batch)]
        out.append(hs[[b for b, _ in want], [p for _, p in want]])
    return torch.cat(out)

