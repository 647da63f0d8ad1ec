"""The bucket tables a scoring step is padded to, batch sizes (`B_BUCKETS`) and suffix lengths (`TS_BUCKETS`), and
the rounding up to them (`bucket`, `batch_buckets`).

Below both of their readers: the graph manager (`engine.graphs`) captures one graph per (batch bucket, length
bucket), and the deterministic kernel table (`engine.kernels.table`) checks its GEMMs at the row counts those
buckets give, so the kernel wing never imports the graph manager.
"""
from __future__ import annotations

from typing import Sequence

TS_BUCKETS = (*range(32, 257, 8), *range(288, 1025, 32), 1280, 1536, 2048)
"""Suffix lengths graphs are captured for: steps of 8 tokens where states usually fall (a 182-token suffix runs as
184, not 192: padding is wasted compute), coarser above; longer suffixes run eagerly."""
B_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128)
"""Requests per graph; larger batches are split into chunks of the largest. A padded row costs as much as a real one
(on the H200, 0.8B shape: ~2.4 ms per batch plus ~0.5 ms per row), and a stream's batches take whatever size its
rate and its deadlines give: under --latency-budget-ms at half load they hold 4 to 10 states, where a padded row
is a tenth of the batch's time, so every size up to 8 has its graph, and above it at most 20% of a graph's rows are
padding (33 states in 40), where powers of two would run a stream's batch of ~19 states as 32 rows."""


def bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= n, or None past the largest."""
    return next((b for b in buckets if b >= n), None)


def batch_buckets(max_batch: int) -> list[int]:
    """The batch buckets that batches of up to `max_batch` states run in (what a warm-up should capture)."""
    if max_batch > B_BUCKETS[-1]:
        return list(B_BUCKETS)            # larger batches run as chunks of the largest bucket plus a remainder
    return [b for b in B_BUCKETS if b <= bucket(max_batch, B_BUCKETS)]


def unpadded_prefix(rows_per_request: Sequence[int], buckets: tuple[int, ...] = B_BUCKETS) -> int:
    """How many leading requests of a batch (each ``rows_per_request`` rows, in order) make steps with no padded row:
    steps of ``buckets[-1]`` rows and a last one of exactly a bucket's rows. All of them when the whole batch does, or
    when no prefix of it does (requests of rows that fall between buckets); else the most that do."""
    largest = buckets[-1]
    exact = set(buckets)
    rows, best = 0, 0
    for k, n in enumerate(rows_per_request, start=1):
        rows += n
        if rows % largest == 0 or rows % largest in exact:
            best = k
    return len(rows_per_request) if best in (0, len(rows_per_request)) else best
