"""A probe row for the attention kernels' batch-invariance tests, scored alone and placed among random neighbours.

The probe: L suffix tokens continuing bank entry `slot`, with its answers at `answers` (positions < L). A placement
(R, T): R rows padded to T >= L, the probe at row r0 (its padding random, like a padded row's), the other rows random,
each continuing a random bank entry with its own answer count and positions. `engine.kernels.suffix_attention`'s kernels
take these as the forward passes them; a kernel is batch-invariant when the probe's outputs are the same bits in every
placement as alone (T = L, R = 1).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass
class Case:
    """Shapes and the prefix bank: heads (Hq, Hkv, D), entries of `lengths` tokens in a bank of `capacity` columns."""
    heads: tuple[int, int, int]
    lengths: tuple[int, ...]
    capacity: int
    dtype: torch.dtype
    device: str
    seed: int = 0

    def __post_init__(self):
        Hq, Hkv, D = self.heads
        self.gen = torch.Generator(device=self.device).manual_seed(self.seed)
        self.bank_k, self.bank_v = (self.rnd(len(self.lengths), Hkv, self.capacity, D) for _ in range(2))
        self.key_lengths = torch.tensor(self.lengths, dtype=torch.int32, device=self.device)

    def rnd(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, device=self.device).to(self.dtype)

    def row(self, L: int) -> dict:
        """One row's own inputs: q [Hq, L, D], k, v [Hkv, L, D], gate [L, Hq, D]."""
        Hq, Hkv, D = self.heads
        return {"q": self.rnd(Hq, L, D), "k": self.rnd(Hkv, L, D), "v": self.rnd(Hkv, L, D), "gate": self.rnd(L, Hq, D)}

    def batch(self, probe: dict, slot: int, R: int, T: int, r0: int, rng: random.Random) -> dict:
        """q [R, Hq, T, D], k, v [R, Hkv, T, D] (v a strided view, as the forward's), gate [R, T, Hq, D] (a strided
        half, as the forward's), slots [R] int64: random rows with the probe's first L tokens at row r0."""
        Hq, Hkv, D = self.heads
        L = probe["q"].shape[1]
        q, k = self.rnd(R, Hq, T, D), self.rnd(R, Hkv, T, D)
        v = self.rnd(R, T, Hkv, 2 * D)[..., D:].transpose(1, 2)
        gate = torch.chunk(self.rnd(R, T, Hq, 2 * D), 2, dim=-1)[1]
        q[r0, :, :L], k[r0, :, :L], v[r0, :, :L], gate[r0, :L] = probe["q"], probe["k"], probe["v"], probe["gate"]
        slots = [rng.randrange(len(self.lengths)) for _ in range(R)]
        slots[r0] = slot
        return {"q": q, "k": k, "v": v, "gate": gate, "slots": torch.tensor(slots, device=self.device)}

    def answers(self, batch: dict, probe_answers: list[int], per_row: int, r0: int, rng: random.Random) -> dict:
        """The answer-row inputs of `batch` (`Kernels.answer_attention`'s): row r0 answers at probe_answers, every
        other row at up to per_row random positions; rows [S] (tokens b * T + t, the step's padding answers at token
        0), starts and counts [R], q and gate [S, Hq, D] gathered at those tokens. -> its kwargs, and the probe's
        answers' indices among the S rows."""
        R, Hq, T, D = batch["q"].shape
        positions = [sorted(rng.sample(range(T), rng.randrange(per_row + 1))) for _ in range(R)]
        positions[r0] = probe_answers
        tokens = [b * T + t for b, ts in enumerate(positions) for t in ts]
        rows = torch.zeros(R * per_row, dtype=torch.int64)
        rows[:len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
        counts = torch.tensor([len(ts) for ts in positions])
        starts = counts.cumsum(0) - counts
        rows = rows.to(self.device)
        q = batch["q"].permute(0, 2, 1, 3).reshape(R * T, Hq, D)[rows]                      # [S, Hq, D]
        gate = batch["gate"].reshape(R * T, Hq, D)[rows]
        first = int(starts[r0])
        return ({"q": q, "k": batch["k"], "v": batch["v"], "bank_k": self.bank_k, "bank_v": self.bank_v,
                 "key_lengths": self.key_lengths, "slots": batch["slots"], "rows": rows,
                 "starts": starts.to(self.device), "counts": counts.to(self.device), "gate": gate},
                slice(first, first + len(probe_answers)))

    def suffix_args(self, batch: dict) -> tuple:
        """`Kernels.suffix_attention`'s arguments but the scale."""
        return (batch["q"], batch["k"], batch["v"], self.bank_k, self.bank_v, self.key_lengths, batch["slots"],
                batch["gate"])


def answer_args(kw: dict) -> tuple:
    """`Kernels.answer_attention`'s arguments but the scale, from `Case.answers`' kwargs."""
    return tuple(kw[name] for name in ("q", "k", "v", "bank_k", "bank_v", "key_lengths", "slots", "rows", "starts",
                                       "counts", "gate"))


def probe_in_placements(case: Case, attention, answers_attention, placements, L: int, slot: int, probe_answers,
                        per_row: int, scale: float, seed: int = 0) -> list[dict]:
    """The probe alone, then in each placement (R, T): whether its suffix attention output (`attention`, the
    suffix kernel) and its answers' output (`answers_attention`) are the same bits. -> one dict per placement."""
    rng = random.Random(seed)
    probe = case.row(L)
    alone = case.batch(probe, slot, 1, L, 0, rng)
    ref = attention(*case.suffix_args(alone), scale)[0]                                     # [L, Hq * D]
    kw, at = case.answers(alone, probe_answers, per_row, 0, rng)
    ref_answers = answers_attention(*answer_args(kw), scale)[at]
    out = []
    for R, T in placements:
        r0 = rng.randrange(R)
        batch = case.batch(probe, slot, R, T, r0, rng)
        got = attention(*case.suffix_args(batch), scale)[r0, :L]
        kw, at = case.answers(batch, probe_answers, per_row, r0, rng)
        got_answers = answers_attention(*answer_args(kw), scale)[at]
        out.append({"R": R, "T": T, "r0": r0, "suffix_equal": bool(torch.equal(got, ref)),
                    "suffix_max_abs": float((got.float() - ref.float()).abs().max()),
                    "answers_equal": bool(torch.equal(got_answers, ref_answers)),
                    "answers_max_abs": float((got_answers.float() - ref_answers.float()).abs().max())})
    return out
