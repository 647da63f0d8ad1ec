"""Calibration: corrections of the option probabilities that live in the schema, so live scoring and replay apply
the same ones.

An option bias is a log-probability per option position, subtracted from the labels' logits before the softmax over
a question's options (and before its temperature divides them): softmax((z - bias) / T). It comes from the schema
(`option_bias`, which `decider calibrate --method order` fits by `fit_position_prior`) and, with the schema's
calibration "contextual" (Zhao et al., ICML 2021), from the model itself: at prepare the schema's content-free states
(`CONTENT_FREE_STATES`) are scored, and the log of their mean distribution is added to the bias, so that a state
carrying no information gets a uniform answer. Both are computed on the host in float64 from scores that are
batch-invariant in a deterministic table: the same model and schema give the same bias bits in every process.

`fit_position_prior` is PriDe (Zheng et al., ICLR 2024): score sample states under every cyclic permutation of each
question's options; a position's log prior is its mean log-probability over the permutations (each position sees
every option once, so the options' own merits cancel).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from engine.errors import InputError
from engine.prompt import MAX_OPTIONS, Question

CALIBRATIONS = ("none", "contextual")
"""A schema's `calibration`: "none", or "contextual" (the content-free states' log mean distribution as a bias)."""
CONTENT_FREE_STATES = ("", "N/A", "[MASK]")
"""States that carry no information (Zhao et al.): their mean distribution is the model's prior for a schema."""
MIN_PROBABILITY = 1e-12
"""Floor under a mean content-free probability before its log: an option the model never gives stays finite."""


def check_calibration(calibration: str) -> str:
    """`calibration` if it is one of `CALIBRATIONS`, else InputError."""
    if calibration not in CALIBRATIONS:
        raise InputError(f"calibration must be one of {', '.join(CALIBRATIONS)}, not {calibration!r}")
    return calibration


def option_biases(questions: Sequence[Question]) -> np.ndarray | None:
    """[n_questions, MAX_OPTIONS] float64 of the questions' `option_bias` (0 past a question's options and for a
    question without one), or None when no question has one."""
    if all(q.option_bias is None for q in questions):
        return None
    table = np.zeros((len(questions), MAX_OPTIONS))
    for i, q in enumerate(questions):
        if q.option_bias is not None:
            table[i, :len(q.option_bias)] = q.option_bias
    return table


def contextual_bias(raw: Sequence[Sequence[Sequence[float]]], n_options: Sequence[int]) -> np.ndarray:
    """raw: per content-free state, per question, its options' probabilities (temperature 1, no bias) ->
    [n_questions, MAX_OPTIONS] float64: the log of their mean distribution per question (0 past its options)."""
    table = np.zeros((len(n_options), MAX_OPTIONS))
    for q, n in enumerate(n_options):
        mean = np.mean([np.asarray(state[q][:n], dtype=np.float64) for state in raw], axis=0)
        table[q, :n] = np.log(np.maximum(mean, MIN_PROBABILITY))
    return table


def calibrated(probabilities: Sequence[float], bias: Sequence[float], temperature: float = 1.0) -> list[float]:
    """A distribution over options (at temperature 1) with a bias subtracted and a temperature applied, renormalised:
    softmax((log p - bias) / temperature), in float64 (what the engine computes on the labels' logits)."""
    logits = [(math.log(max(p, MIN_PROBABILITY)) - b) / temperature for p, b in zip(probabilities, bias)]
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    total = sum(weights)
    return [w / total for w in weights]


@dataclass(frozen=True)
class PositionPrior:
    """What `fit_position_prior` found for one question: the log prior per option position (centred: its mean over
    the positions is 0), and the permutation disagreement before and after subtracting it: how often the top option,
    as content, changes with the options' order (over sample states and pairs of shifts, the share of pairs whose top
    options differ: 0 when every order picks the same option, 1 when each picks another, about 1 - 1/n at random)."""
    question: int
    log_prior: tuple[float, ...]
    disagreement_before: float
    disagreement_after: float
    samples: int


def cyclic(options: Sequence[str], shift: int) -> list[str]:
    """The options moved `shift` positions down, cyclically: option i sits at position (i + shift) % n."""
    n = len(options)
    return [options[(p - shift) % n] for p in range(n)]


def fit_position_prior(by_shift: Sequence[Sequence[Sequence[Sequence[float]]]], n_options: Sequence[int]
                       ) -> list[PositionPrior]:
    """by_shift[s][i][q]: sample state i's probabilities (temperature 1, no bias) for question q's options, by
    position, with the question's options shifted by s (`cyclic`; every question of n options is scored under shifts
    0..n-1, shifts past n are ignored for it) -> per question its `PositionPrior` (PriDe)."""
    fits = []
    for q, n in enumerate(n_options):
        # [shifts, samples, positions] float64 of this question, shifts 0..n-1
        p = np.array([[state[q][:n] for state in by_shift[s]] for s in range(n)], dtype=np.float64)
        logp = np.log(np.maximum(p, MIN_PROBABILITY))
        per_sample = logp.mean(axis=0)                                              # [samples, positions]
        per_sample -= per_sample.mean(axis=1, keepdims=True)                        # centred log prior per sample
        prior = per_sample.mean(axis=0)                                             # [positions]
        fits.append(PositionPrior(q, tuple(float(x) for x in prior), _disagreement(logp, np.zeros(n)),
                                  _disagreement(logp, prior), p.shape[1]))
    return fits


def _disagreement(logp: np.ndarray, bias: np.ndarray) -> float:
    """logp [shifts, samples, positions]: over samples and ordered pairs of distinct shifts, the share of pairs whose
    top options (as content) differ once `bias` (per position) is subtracted."""
    n = logp.shape[2]
    if n < 2:
        return 0.0
    top_position = np.argmax(logp - bias[None, None, :], axis=2)                    # [shifts, samples]
    top_option = (top_position - np.arange(n)[:, None]) % n                          # back to the option's own index
    differ = top_option[:, None, :] != top_option[None, :, :]                        # [shifts, shifts, samples]
    return float(differ.sum() / (n * (n - 1) * top_option.shape[1]))


def fit_order(se, questions: Sequence[dict], states: Sequence[str], independent: bool = False,
              batch_size: int = 32) -> list[PositionPrior]:
    """PriDe on a SchemaEngine `se`: `states` scored (temperature 1, no calibration) under every cyclic shift of each
    question's options (a schema prepared per shift, released after), then `fit_position_prior`. questions: as
    `SchemaEngine.prepare` takes them."""
    n_options = [len(q["options"]) for q in questions]
    by_shift = []
    for shift in range(max(n_options)):
        shifted = [{"question": q["question"], "options": cyclic(q["options"], shift)} for q in questions]
        h = se.prepare(shifted, independent=independent, label_mass=False)
        try:
            scores = []
            for start in range(0, len(states), batch_size):
                scores += [t.tolist() for t in se.score(h, states[start:start + batch_size], temperature=1.0)]
        finally:
            se.release(h)
        by_shift.append(scores)
    return fit_position_prior(by_shift, n_options)
