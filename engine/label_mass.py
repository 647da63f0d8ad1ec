"""Label mass: how much of the model's next-token distribution at an answer slot falls on the option labels.

The read-out (`engine.readout`) projects the answer slots onto the label rows " A".." Z" alone and renormalises over a
question's options, so it cannot tell a confident answer from a slot where the model would rather write something
else. The label mass is the share of the full-vocabulary softmax (temperature 1) on the question's labels, before
renormalising: near 1 the model answers in format, low it does not.

It needs the log-sum-exp of every vocabulary logit at the slot. The unembedding is read in chunks of `VOCAB_CHUNK`
rows (a [answers, VOCAB_CHUNK] block of logits at a time, never the [answers, vocabulary] matrix: 1.3 GB at batch 128
of 10 questions for Qwen3.5's 248k tokens); each chunk's GEMM runs through the kernel table's `linear` (batch-invariant
in a deterministic table: the chunk's shape is among the weights its check covers) and its rows' log-sum-exps through
`Kernels.row_logsumexp` into one column of a [answers, chunks] table, whose rows are reduced the same way. Every
chunk has the same shape (the last is a zero-padded copy whose padding the reduction skips), so the order of every
sum is fixed by the vocabulary alone: a row's label mass does not depend on the batch around it. Nothing syncs with
the host, so a CUDA graph captures it.

On CUDA the kernel table's `vocab_logsumexp` (`engine.kernels.vocab_logsumexp`) does the same in one GEMM kernel whose
epilogue reduces each tile of logits, and a small kernel combining the tiles: two launches instead of 62, the logits
never written (at batch 128 the chunks write and re-read 636 MB of them). `FUSED` switches it off.
"""
from __future__ import annotations

from typing import Callable

import torch

from engine.prompt import MAX_OPTIONS

VOCAB_CHUNK = 8192
"""Vocabulary rows per GEMM of the log-sum-exp. At this width the deterministic table's check of the chunk's GEMM at
load (up to 131,072 rows) allocates what the MLP's 7,168-wide projection's does (~2 GB); wider chunks would save
launches (31 chunks for 248,320 tokens) at the cost of that check's memory."""

FUSED = True
"""Whether `FullVocabulary.logsumexp` takes the kernel table's `vocab_logsumexp` where it has one (False: the chunks,
as before it). Read at each call, so a CUDA graph keeps the path it was captured with and `bench/probes/variant_ab.py`
can time both in one process ("chunked:engine.label_mass.FUSED=False")."""


class FullVocabulary:
    """The unembedding matrix [V, hidden] (`weight`), also as chunks of `VOCAB_CHUNK` rows (views, the last a
    zero-padded copy), and the log-sum-exp over all V logits of given hidden rows."""

    def __init__(self, weight: torch.Tensor, chunk: int = VOCAB_CHUNK):
        V, H = weight.shape
        self.weight = weight
        C = min(chunk, V)
        whole = V // C * C
        self.chunks = list(weight[:whole].split(C))                                  # [C, H] views
        self.valid = [C] * len(self.chunks)                                          # real rows of each chunk
        if whole < V:
            last = weight.new_zeros(C, H)
            last[:V - whole] = weight[whole:]
            self.chunks.append(last)
            self.valid.append(V - whole)

    @property
    def chunk_weight(self) -> torch.Tensor:
        """One chunk: the weight shape whose GEMM a batch-invariant table must check."""
        return self.chunks[0]

    def logsumexp(self, x: torch.Tensor, linear: Callable, row_logsumexp: Callable,
                  fused: Callable | None = None) -> torch.Tensor:
        """x [S, H] (final-normed hidden states) -> [S] float32: log(sum(exp(x @ W.T))) over the whole vocabulary, by
        `fused` (a table's `vocab_logsumexp`) where given and `FUSED` is on, else by chunks through `linear` and
        `row_logsumexp`."""
        if fused is not None and FUSED:
            return fused(x, self.weight, self.weight.shape[0])
        partial = torch.empty(x.shape[0], len(self.chunks), dtype=torch.float32, device=x.device)   # [S, chunks]
        for i, (w, n) in enumerate(zip(self.chunks, self.valid)):
            row_logsumexp(linear(x, w), n, out=partial[:, i])                       # [S, C] logits, then [S]
        return row_logsumexp(partial, len(self.chunks))


ORDERED_MASS_KERNEL = True
"""Whether `label_mass` sums a row's shares with the kernel table's `ordered_mass` where it has one (one launch, the
same bits) rather than with its loop of MAX_OPTIONS - 1 adds (a launch each: on the H100's batch-1 timeline they were 25
of its 35 `elementwise_kernel`s, ~1.4 us each and ~0.45 us of gap behind each, run DD). Read at each call, so a CUDA
graph keeps the path it was captured with and `bench/probes/variant_ab.py` can time both in one process."""


def label_mass(logits: torch.Tensor, lse: torch.Tensor, mask: torch.Tensor,
               ordered_mass: Callable | None = None) -> torch.Tensor:
    """logits [S, MAX_OPTIONS] float32 (the labels' logits at temperature 1), lse [S] (the full vocabulary's
    log-sum-exp), mask [S, MAX_OPTIONS] (the options each answer's question has) -> [S] float32: the softmax mass on
    the question's labels, at most 1 (the labels' logits come from their own GEMM, which may round them a little
    above their share of the vocabulary's). ``ordered_mass`` (a kernel table's): the sum and the clamp in one launch,
    in the loop's order."""
    share = torch.exp(logits - lse[:, None]).masked_fill(~mask, 0.0)                  # [S, MAX_OPTIONS]
    if ordered_mass is not None and ORDERED_MASS_KERNEL:
        return ordered_mass(share)
    total = share[:, 0]
    for k in range(1, MAX_OPTIONS):          # one add at a time: the same order whatever the batch (no reduction)
        total = total + share[:, k]
    return total.clamp(max=1.0)
