"""The prefix bank: every prepared prefix's layer states in one set of device buffers, one slot per prefix.

A suffix row names its prefix by slot index, so one batch can continue the prefixes of many schemas at once, and a
step's captured work (a CUDA graph) depends on the batch's shape alone, never on which schemas it serves: graphs read
the bank's buffers in place and the rows' slots from an input buffer.

Per layer, a slot holds K/V (after RoPE) right-padded to `capacity_tokens` for full-attention layers, and the last
K-1 conv inputs and the recurrent state for Gated DeltaNet layers; `lengths[slot]` is the prefix's real length (keys
past it are padding no kernel reads). Slots freed by `free` are reused. When the bank is full, or a prefix is longer
than its token capacity, the buffers are reallocated larger (slots doubled, tokens rounded up to `TOKEN_STEP`) and
`generation` changes: whatever captured the old buffers (graphs) must be dropped.
"""
from __future__ import annotations

import logging

import torch

from engine.model import PrefixState

log = logging.getLogger(__name__)

TOKEN_STEP = 256
"""Prefix token capacity grows in steps of this: a longer prefix costs a reallocation (and the graphs) only when it
crosses a step."""
FIRST_SLOTS = 8
CONV_TIME_MAJOR = True
"""Conv states stored time-major (`_resized`); False: channel-major, as before. Read when the bank grows, so
`bench/probes/variant_ab.py` can time both (each variant's engine has its own bank)."""


class PrefixBank:
    """Read-only (during scoring) layer states of every prepared prefix, one slot each, in shared device buffers."""

    def __init__(self, device: torch.device, slots: int = FIRST_SLOTS):
        self.device = torch.device(device)
        self.capacity = max(1, slots)
        self.capacity_tokens = 0
        self.generation = 0
        self.k: dict[int, torch.Tensor] = {}          # layer -> [S, Hkv, capacity_tokens, D]
        self.v: dict[int, torch.Tensor] = {}          # layer -> [S, Hkv, capacity_tokens, D]
        self.conv: dict[int, torch.Tensor] = {}       # layer -> [S, C, K-1] (a view of [S, K-1, C])
        self.rec: dict[int, torch.Tensor] = {}        # layer -> [S, Hv, Dk, Dv] float32
        self.lengths = torch.zeros(0, dtype=torch.int32, device=self.device)   # [S]: each slot's prefix length
        self.host_lengths: list[int] = []                                     # the same, on the host
        self._free: list[int] = []

    @property
    def allocated(self) -> bool:
        return bool(self.host_lengths)

    @property
    def live_slots(self) -> int:
        return len(self.host_lengths) - len(self._free)

    @property
    def nbytes(self) -> int:
        """Device bytes of the whole bank, free slots included."""
        return sum(t.numel() * t.element_size() for d in (self.k, self.v, self.conv, self.rec) for t in d.values())

    @property
    def slot_nbytes(self) -> int:
        """Device bytes one slot takes (what one prepared prefix costs)."""
        return self.nbytes // max(1, len(self.host_lengths))

    def add(self, prefix: PrefixState) -> int:
        """Copy one prefix's states (a `PrefixState` of P = 1) into a free slot, growing the bank if needed; -> its
        slot. Graphs see the new slot in place (no reallocation) unless `generation` changed."""
        length = prefix.lengths[0]
        if not self.allocated or length > self.capacity_tokens or not self._free:
            self._grow(prefix, length)
        slot = self._free.pop()
        for i, t in prefix.k.items():
            self.k[i][slot, :, :length] = t[0]
            self.v[i][slot, :, :length] = prefix.v[i][0]
        for i, t in prefix.conv.items():
            self.conv[i][slot] = t[0]
        for i, t in prefix.rec.items():
            self.rec[i][slot] = t[0]
        self.lengths[slot] = length
        self.host_lengths[slot] = length
        return slot

    def free(self, slots) -> None:
        """Give slots back for reuse (their memory stays with the bank)."""
        for slot in slots:
            self.host_lengths[slot] = 0
            self.lengths[slot] = 0
            self._free.append(slot)

    def snapshot(self, slot: int) -> list[torch.Tensor]:
        """Copies of one slot's states (tests check that scoring never writes to them)."""
        n = self.host_lengths[slot]
        kv = [t[slot, :, :n].clone() for d in (self.k, self.v) for t in d.values()]
        return kv + [t[slot].clone() for d in (self.conv, self.rec) for t in d.values()]

    def _grow(self, prefix: PrefixState, length: int) -> None:
        used = len(self.host_lengths)
        slots = used if self._free else max(self.capacity, 2 * used)
        tokens = max(self.capacity_tokens, -(-length // TOKEN_STEP) * TOKEN_STEP)
        grown = {}
        for name in ("k", "v"):
            grown[name] = {i: self._resized(getattr(self, name).get(i), (slots, t.shape[1], tokens, t.shape[3]), t)
                           for i, t in getattr(prefix, name).items()}
        grown["conv"] = {i: self._resized(self.conv.get(i), (slots, *t.shape[1:]), t, time_major=CONV_TIME_MAJOR)
                         for i, t in prefix.conv.items()}
        grown["rec"] = {i: self._resized(self.rec.get(i), (slots, *t.shape[1:]), t) for i, t in prefix.rec.items()}
        for name, tensors in grown.items():
            setattr(self, name, tensors)
        lengths = torch.zeros(slots, dtype=torch.int32, device=self.device)
        lengths[:used] = self.lengths
        self.lengths = lengths
        self._free = [s for s in range(slots - 1, used - 1, -1)] + self._free
        self.host_lengths += [0] * (slots - used)
        self.capacity, self.capacity_tokens = slots, tokens
        self.generation += 1
        if used:
            log.info("prefix bank grown to %d slots x %d tokens (%.1f MiB); graphs captured on the old buffers are "
                     "dropped", slots, tokens, self.nbytes / 2**20)

    def _resized(self, old: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor,
                 time_major: bool = False) -> torch.Tensor:
        if time_major:
            # [S, C, K-1] stored as [S, K-1, C]: a state's inputs at one time are contiguous across channels, so the
            # conv kernel reads a head's slice of them in 16-byte vectors as it reads the projection's rows (stored
            # channel-major, the reads were 2-byte gathers 3 values apart, and they held the kernel's registers:
            # ptxas, sm_90, 8 tokens x 2 warps: 92 registers a thread against 62)
            new = torch.zeros(shape[0], shape[2], shape[1], dtype=like.dtype, device=self.device).transpose(1, 2)
        else:
            new = torch.zeros(shape, dtype=like.dtype, device=self.device)
        if old is not None:
            new[tuple(slice(0, n) for n in old.shape)] = old
        return new
