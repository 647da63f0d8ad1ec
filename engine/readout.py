"""From hidden states at the answer slots to option probabilities, without ever forming full-vocabulary logits (the
label mass reads the vocabulary in chunks: `engine.label_mass`)."""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from engine.label_mass import label_mass
from engine.prompt import MAX_OPTIONS


def fill_ids(rows: Sequence[Sequence[int]], B: int, T: int, pad: int, pin: bool = False) -> torch.Tensor:
    """[B, T] int64 ids: row i holds rows[i] then `pad`; rows past len(rows) are all `pad` (unused bucket slots)."""
    # numpy copies a Python list into a row ~5x faster than a tensor per row (this runs for every batch)
    filled = np.full((B, T), pad, dtype=np.int64)
    for i, r in enumerate(rows):
        filled[i, :len(r)] = r
    ids = torch.from_numpy(filled)
    return ids.pin_memory() if pin else ids


def option_mask(n_options: Sequence[int]) -> torch.Tensor:
    """[n, MAX_OPTIONS] bool: True for the options a question has."""
    return torch.arange(MAX_OPTIONS)[None, :] < torch.as_tensor(list(n_options))[:, None]


SCORE_COLUMNS = 2 * MAX_OPTIONS + 1
"""Columns of a read-out row: the calibrated probabilities (`PROBABILITIES`), the raw ones before the option bias
(`RAW`), the label mass (`MASS`)."""
PROBABILITIES, RAW, MASS = slice(0, MAX_OPTIONS), slice(MAX_OPTIONS, 2 * MAX_OPTIONS), 2 * MAX_OPTIONS

FUSED = True
"""Whether `read_rows` takes the kernel table's `score_rows` where it has one (one launch for the softmaxes and the
label mass, not ~17). Read at each call, so a CUDA graph keeps the path it was captured with and
`bench/probes/variant_ab.py` can time both in one process ("unfused:engine.readout.FUSED=False": run EO, p50 at batch 1
2.282 ms fused against 2.325, at batch 8 4.903 against 4.948, on an H100)."""

ScoreRowsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
"""(labels' logits [S, MAX_OPTIONS], inv_temp [S, 1], bias, mask, vocabulary log-sum-exp [S] or None) -> the read-out
[S, SCORE_COLUMNS] (`engine.kernels.score_rows.score_rows`)."""


def read_rows(hs: torch.Tensor, norm, W: torch.Tensor, inv_temp: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor,
              linear=F.linear, vocab_lse: Callable[[torch.Tensor], torch.Tensor] | None = None,
              ordered_mass: Callable | None = None, score_rows: ScoreRowsFn | None = None) -> torch.Tensor:
    """hs: [S, H] hidden states at the answer slots before the final norm (`HybridForward.layers(..., rows=slots)`);
    inv_temp: [S, 1]; bias: [S, MAX_OPTIONS] float32, a log-probability per option position (calibration);
    mask: [S, MAX_OPTIONS].

    -> [S, SCORE_COLUMNS] float32: per answer softmax((z - bias) * inv_temp) over its options, softmax(z * inv_temp)
    (the raw distribution), and the label mass (`engine.label_mass.label_mass` of `vocab_lse`, the final-normed rows'
    log-sum-exp over the whole vocabulary; NaN without it), z being the labels' logits. Options a question lacks are
    exactly 0. A bias of 0 gives the raw distribution's bits. The final norm and the label projection (`linear`, the
    forward's own) run on the S slot rows only; `score_rows` (a kernel table's) does the rest in one launch where
    `FUSED` is on, `ordered_mass` the label mass's sum where it is not.
    """
    normed = norm(hs)
    z = linear(normed, W)                                                               # [S, MAX_OPTIONS]
    lse = vocab_lse(normed) if vocab_lse is not None else None
    if score_rows is not None and FUSED:
        return score_rows(z, inv_temp, bias, mask, lse)
    z = z.float()
    raw = torch.softmax((z * inv_temp).masked_fill(~mask, float("-inf")), -1)
    calibrated = torch.softmax(((z - bias) * inv_temp).masked_fill(~mask, float("-inf")), -1)
    mass = label_mass(z, lse, mask, ordered_mass) if lse is not None else z.new_full(z.shape[:1], float("nan"))
    return torch.cat([calibrated, raw, mass[:, None]], -1)
