"""One scoring step captured as a CUDA graph (`record_step`), cheaper than `torch.cuda.graph` and safe beside a thread
that goes on scoring, and what a captured step is (`CapturedStep`) and cost (`CaptureRecord`).

`torch.cuda.graph` runs a device-wide synchronize, `empty_cache` and the pinned-memory `empty_cache` before every
capture: in a serving process each of those costs later allocations a fresh cudaMalloc or cudaHostAlloc, and a
device-wide synchronize waits for the scoring thread's queue. `record_step` does none of them, warms up once
(`WARMUP_RUNS`), and captures in `thread_local` mode on a side stream of its own, so another thread may keep launching
(replays, copies, events, allocations) meanwhile. The graph manager (`engine.graphs`) serialises captures and decides
when one may start (`begin`).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import torch

WARMUP_RUNS = 1
"""Eager runs of a step before its capture, on the capture stream: Triton compiles and loads its kernels at their
first launch, cuBLAS makes its workspace for the stream, and the allocator caches blocks, none of which may happen
inside a capture. One run does all of that (a second one found nothing more to do; `tests/engine/test_gpu.py` checks
graphs against eager steps)."""


@dataclass
class CapturedStep:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]      # static input buffers on the device, filled before each replay
    output: torch.Tensor                  # static output, valid until the next replay of any graph in the pool
    keep: object                          # tensors the graph reads that nothing else holds (positions, masks)
    replays: int = 0
    record: "CaptureRecord | None" = None

    def replay(self, *values: torch.Tensor) -> torch.Tensor:
        for buf, val in zip(self.inputs, values):
            buf.copy_(val, non_blocking=True)
        self.graph.replay()
        self.replays += 1
        return self.output


@dataclass(frozen=True)
class CaptureRecord:
    """One capture: the graph's key and shape, where it ran (`inline` on a step's path, `warmup`, `background`), its
    seconds (warm-up run included) and the device bytes it took (the pool's growth and the driver's share for the
    executable graph: exact when nothing else allocated meanwhile)."""
    key: tuple
    R: int
    T: int
    where: str
    seconds: float
    nbytes: int


_streams = threading.local()


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's capture stream (one a thread: captures on one thread run one after the other)."""
    streams = getattr(_streams, "by_device", None)
    if streams is None:
        streams = _streams.by_device = {}
    if device not in streams:
        streams[device] = torch.cuda.Stream(device=device)
    return streams[device]


def record_step(example: tuple[torch.Tensor, ...], fn: Callable[..., torch.Tensor], keep: object,
                begin: Callable[[torch.cuda.CUDAGraph], bool], device: torch.device | None,
                host_wait: bool = False) -> tuple[CapturedStep, int] | None:
    """Capture fn(*inputs) at the example's shapes on this thread's side stream: static inputs filled from `example`,
    `WARMUP_RUNS` eager runs, then the capture, which `begin(graph)` starts (`graph.capture_begin`) or declines.

    host_wait: this thread is not the one that replays (the manager's capture thread): wait here for the side
    stream's work (the example's copy into the static inputs, the warm-up), which a replay on another stream must not
    overtake (its own copy into the same buffers would be overwritten); else the calling thread's stream waits for it,
    on the device. -> (the step, the device bytes it took), or None when `begin` declined."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    free_before = torch.cuda.mem_get_info(device)[0]
    caller = torch.cuda.current_stream(device)
    side = side_stream(device)
    # the static inputs belong to the stream steps replay on (the caller's; for the capture thread the device's
    # default stream, where the scoring thread replays), and are filled on the side stream
    static = tuple(torch.empty_like(x, device=device) for x in example)
    for buf in static:
        buf.record_stream(side)                 # freed (a declined capture, a dropped graph) after the side's use
    side.wait_stream(caller)
    with torch.cuda.stream(side):
        for buf, x in zip(static, example):
            buf.copy_(x, non_blocking=True)
        for _ in range(WARMUP_RUNS):               # compiles, lazy loads and workspaces happen outside the capture
            fn(*static)
        graph = torch.cuda.CUDAGraph()
        if not begin(graph):
            return None
        try:
            out = fn(*static)
        except BaseException:
            try:
                graph.capture_end()             # ends the (invalidated) capture; the step's own error is the one raised
            except Exception:                   # noqa: BLE001
                pass
            raise
        graph.capture_end()
    if host_wait:
        side.synchronize()
    else:
        caller.wait_stream(side)
    return CapturedStep(graph, static, out, keep), max(0, free_before - torch.cuda.mem_get_info(device)[0])
