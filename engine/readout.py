"""From hidden states at the answer slots to option probabilities, without ever forming full-vocabulary logits."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

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


def read_rows(hs: torch.Tensor, norm, W: torch.Tensor, inv_temp: torch.Tensor, mask: torch.Tensor,
              linear=F.linear) -> torch.Tensor:
    """hs: [S, H] hidden states at the answer slots before the final norm (`HybridForward.layers(..., rows=slots)`);
    inv_temp: [S, 1]; mask: [S, MAX_OPTIONS].

    -> [S, MAX_OPTIONS] float32 probabilities; options a question lacks are exactly 0.
    The final norm and the label projection (`linear`, the forward's own) run on the S slot rows only.
    """
    logits = linear(norm(hs), W).float() * inv_temp                                  # [S, MAX_OPTIONS]
    return torch.softmax(logits.masked_fill(~mask, float("-inf")), -1)
