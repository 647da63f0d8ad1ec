"""RoPE's cos and sin by position, looked up in a table made once per model instead of computed at every step.

transformers' rotary embedding computes a step's angles from its positions (a float32 product of the inverse
frequencies and the positions, cos and sin, the multi-axis recomposition, a cast): on CUDA about a dozen small launches
at every step, whatever its size. Every one of those operations is elementwise in the position (the product has one
term, so no kernel can sum it in another order), so the angles of position p are the same numbers whichever step
computes them: a table of every position's, computed by the same module once, gives a step's angles bit for bit in one
gather each. Only for the default RoPE, whose frequencies never change (a dynamic RoPE rescales them by the length).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ROPE_TABLE = True
"""Whether a step reads its angles from the table where it covers the step's positions (False: the module at every step,
as before). Read when a step is traced, so a CUDA graph keeps the setting it was captured under and
`bench/probes/variant_ab.py` can time both in one process."""

ROPE_TABLE_POSITIONS = 32768
"""Positions the table holds at most (fewer where the model's `max_position_embeddings` is lower): at the 0.8B shape's
64 rotary dimensions in bf16, 8 MB of device memory for cos and sin. Prefix and suffix together are far shorter here;
a step reaching past it computes its angles with the module."""


class RopeTable:
    """A model's RoPE angles for positions 0 .. `positions` - 1, in the dtype of its hidden states."""

    def __init__(self, rotary_emb, positions: int, dtype: torch.dtype, device: torch.device):
        self.rotary_emb = rotary_emb
        self.cos = self.sin = None
        if getattr(rotary_emb, "rope_type", "default") == "default":
            every = torch.arange(positions, device=device)[None]                              # [1, P]
            cos, sin = rotary_emb(torch.empty(0, dtype=dtype, device=device), every[None].expand(3, -1, -1))
            self.cos, self.sin = cos[0], sin[0]                                               # [P, D] each

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [B, T, D] for positions [B, T] (h: the hidden states, for their dtype), every position below
        `bound` (known on the host, so a position past the table never reaches a gather): from the table where it
        covers them, else from the module."""
        if ROPE_TABLE and self.cos is not None and bound <= self.cos.shape[0] and self.cos.dtype == h.dtype:
            return F.embedding(positions, self.cos), F.embedding(positions, self.sin)
        return self.rotary_emb(h, positions[None].expand(3, -1, -1))
