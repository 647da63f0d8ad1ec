"""CUDA graphs of the scoring step, one per (schema, batch bucket, length bucket), sharing one memory pool.

Like vLLM's graph manager: fixed buckets, warm-up on a side stream, capture largest first (so smaller graphs reuse
the pool's blocks), replay after copying inputs into the static buffers, and slice the static output.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

TS_BUCKETS = (*range(32, 257, 8), *range(288, 1025, 32), 1280, 1536, 2048)
"""Suffix lengths graphs are captured for: steps of 8 tokens where states usually fall (a 182-token suffix runs as
184, not 192: padding is wasted compute), coarser above; longer suffixes run eagerly."""
FULL_PROMPT_STEP = 8
"""Whole-prompt graphs (`full_fast`) pad to a multiple of this, up to 4096 tokens: the same granularity as the
suffixes, so that the benchmark's comparison does not charge the recomputing server more padding than the cache."""
B_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128)
"""Requests per graph; larger batches are split into chunks of the largest. A padded row costs as much as a real one
(on the H200, 0.8B shape: ~2 ms per batch plus ~0.6 ms per row), and a stream's batches take whatever size its
rate and --max-wait-ms give, so above 8 the steps are small (at most 29% of a graph's rows are padding: 17 states
in 24). With powers of two, the stream benchmark's batches of ~19 states (716 states/s, --max-wait-ms 20) ran as
32 rows: 20.5 ms each."""


def bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= n, or None past the largest."""
    return next((b for b in buckets if b >= n), None)


def batch_buckets(max_batch: int) -> list[int]:
    """The batch buckets that batches of up to `max_batch` states run in (what a warm-up should capture)."""
    if max_batch > B_BUCKETS[-1]:
        return list(B_BUCKETS)            # larger batches run as chunks of the largest bucket plus a remainder
    return [b for b in B_BUCKETS if b <= bucket(max_batch, B_BUCKETS)]


@dataclass
class CapturedStep:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]      # static input buffers, filled before each replay
    output: torch.Tensor                  # static output, valid until the next replay of any graph in the pool
    keep: object                          # tensors the graph reads that nothing else holds (positions, masks)

    def replay(self, *values: torch.Tensor) -> torch.Tensor:
        for buf, val in zip(self.inputs, values):
            buf.copy_(val, non_blocking=True)
        self.graph.replay()
        return self.output


class GraphCache:
    """Captured steps by key, all in one private memory pool; `stats` counts captures and replays.

    The pool belongs to this cache alone: PyTorch frees a private pool once no graph holds it, and a later capture
    into a freed pool's handle trips an allocator assertion, so each cache (and each refill after `drop` emptied it)
    takes a fresh handle.
    """

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()
        self.steps: dict[tuple, CapturedStep] = {}
        self.stats = {"captures": 0, "replays": 0}

    def run(self, key: tuple, inputs: tuple[torch.Tensor, ...], build: Callable[[], tuple[Callable, object]]):
        """Replay the step for `key` on `inputs`, capturing it first if needed.

        build() -> (fn, keep): fn(*static_inputs) -> output, closed over whatever `keep` holds.
        """
        step = self.steps.get(key)
        if step is None:
            step = self.steps[key] = self.capture(inputs, *build())
        self.stats["replays"] += 1
        return step.replay(*inputs)

    def capture(self, example: tuple[torch.Tensor, ...], fn: Callable, keep: object) -> CapturedStep:
        static = tuple(x.clone() for x in example)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):          # warm-up: lazy inits and autotuning happen outside the capture
            for _ in range(2):
                fn(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn(*static)
        self.stats["captures"] += 1
        return CapturedStep(graph, static, out, keep)

    def drop(self, schema_id) -> None:
        for key in [k for k in self.steps if k[0] == schema_id]:
            del self.steps[key]
        if not self.steps:
            self.pool = torch.cuda.graph_pool_handle()
