"""The graph manager: CUDA graphs of a scoring step, one per (key, batch bucket, length bucket), in one memory pool.

Like vLLM's `cudagraph_utils.py`, `GraphManager` holds the bucket tables (`engine.buckets`) and picks the padded
shape a batch runs at (`shape`), warms up and captures (largest first, so smaller graphs reuse the pool's blocks:
`warmup_order`), copies inputs into a graph's static buffers, replays and slices the static output (`run`), and counts
captures, replays and eager steps (`stats`). Its callers build inputs at the shape it picked, on the host (pinned, so
that each is one asynchronous copy straight into its static buffer) or on the device, and say what one step computes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from engine import buckets


@dataclass(frozen=True)
class StepShape:
    """The shape a step runs at: R requests of T tokens (padded to a bucket when `graphed`, else as they came)."""
    R: int
    T: int
    graphed: bool


@dataclass
class CapturedStep:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]      # static input buffers on the device, filled before each replay
    output: torch.Tensor                  # static output, valid until the next replay of any graph in the pool
    keep: object                          # tensors the graph reads that nothing else holds (positions, masks)

    def replay(self, *values: torch.Tensor) -> torch.Tensor:
        for buf, val in zip(self.inputs, values):
            buf.copy_(val, non_blocking=True)
        self.graph.replay()
        return self.output


StepBuilder = Callable[[StepShape], tuple[Callable[..., torch.Tensor], object]]
"""build(shape) -> (fn, keep): fn(*inputs) -> output, closed over whatever `keep` holds (what a graph must keep)."""


class GraphManager:
    """Captured steps by (key, R, T), all in one private memory pool; `stats` counts captures, replays and eager steps.

    enabled=False (CPU, or graphs switched off) runs every step eagerly at the batch's own shape. `device`: where steps
    run (inputs elsewhere are copied there; None: eager steps run where their inputs are, graphs on the current CUDA
    device).
    The pool belongs to this manager alone: PyTorch frees a private pool once no graph holds it, and a later capture
    into a freed pool's handle trips an allocator assertion, so each manager (and each refill after `clear` emptied
    it) takes a fresh handle.
    """

    def __init__(self, enabled: bool, batch_sizes: tuple[int, ...] = buckets.B_BUCKETS,
                 token_lengths: tuple[int, ...] = buckets.TS_BUCKETS, device: torch.device | str | None = None):
        self.enabled = enabled
        self.device = None if device is None else torch.device(device)
        self.batch_sizes, self.token_lengths = batch_sizes, token_lengths
        self.stats = {"captures": 0, "replays": 0, "eager": 0}
        self._pool = None
        self._steps: dict[tuple, CapturedStep] = {}

    @property
    def max_batch(self) -> int:
        """The most requests one step runs: callers split larger batches into chunks of this."""
        return self.batch_sizes[-1]

    def shape(self, n: int, tmax: int) -> StepShape:
        """The shape a batch of n requests, the longest tmax tokens, runs at: its buckets if a graph can serve it."""
        R, T = buckets.bucket(n, self.batch_sizes), buckets.bucket(tmax, self.token_lengths)
        if self.enabled and R is not None and T is not None:
            return StepShape(R, T, graphed=True)
        return StepShape(n, tmax, graphed=False)

    def warmup_order(self, batch_sizes: Iterable[int], token_lengths: Iterable[int]) -> list[StepShape]:
        """The graphed shapes that batches of these sizes and lengths run at, largest first (captured in this order,
        smaller graphs reuse the blocks the larger ones freed). Empty when graphs are off."""
        shapes = {self.shape(n, t) for n in batch_sizes for t in token_lengths}
        return sorted((s for s in shapes if s.graphed), key=lambda s: (s.R, s.T), reverse=True)

    def run(self, key: tuple, shape: StepShape, inputs: tuple[torch.Tensor, ...], build: StepBuilder,
            out_rows: int) -> torch.Tensor:
        """One step on `inputs` (built at `shape`, on the host or the device): replayed from its graph (captured first
        if needed) when `shape.graphed`, else run eagerly on the inputs moved to the device. -> the first `out_rows`
        rows of the output; a graph's output is its static buffer, valid until the next replay of any graph of this
        manager."""
        if not shape.graphed:
            self.stats["eager"] += 1
            fn, _ = build(shape)
            if self.device is not None:
                inputs = tuple(x.to(self.device, non_blocking=True) for x in inputs)
            return fn(*inputs)[:out_rows]
        full_key = (*key, shape.R, shape.T)
        step = self._steps.get(full_key)
        if step is None:
            step = self._steps[full_key] = self._capture(inputs, *build(shape))
        self.stats["replays"] += 1
        return step.replay(*inputs)[:out_rows]

    def __len__(self) -> int:
        """Graphs held."""
        return len(self._steps)

    def holds(self, key: tuple, shape: StepShape) -> bool:
        """Whether a graph of `key` at `shape` is captured already."""
        return (*key, shape.R, shape.T) in self._steps

    def clear(self) -> None:
        """Forget every graph (the buffers they read were reallocated); later steps capture again."""
        self._steps.clear()
        self._pool = None

    def _capture(self, example: tuple[torch.Tensor, ...], fn: Callable, keep: object) -> CapturedStep:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        device = self.device or torch.device("cuda")
        static = tuple(torch.empty_like(x, device=device).copy_(x) for x in example)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):          # warm-up: lazy inits and autotuning happen outside the capture
            for _ in range(2):
                fn(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = fn(*static)
        self.stats["captures"] += 1
        return CapturedStep(graph, static, out, keep)
