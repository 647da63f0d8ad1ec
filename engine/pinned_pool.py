"""Pinned host buffers handed out again once the device is past their last use: the staging buffer every scoring step
fills (`engine.step_layout.StepLayout.stage`) and copies to the device, on the GPU thread between a cycle's close and
its launch.

torch's caching host allocator serves `torch.empty(..., pin_memory=True)` from its own pool, but each call takes its
lock and looks through the events of the blocks still in flight; run ED put 84 us of batch 1's 390 us launch in the
staging, about half of it beyond its Python and numpy. Here a buffer is given back with the event recorded behind its
launch (`SchemaEngine._record_done`) and taken again, first in first out, once that event has passed.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Iterable

import torch

STAGING_POOL = False
"""Whether a step's staging buffer comes from a `PinnedPool` (False: a new pinned allocation each step, as before).
Off until timed on the GPU (`bench/probes/launch_contention.py --modes sync --variant
"pool:engine.pinned_pool.STAGING_POOL=True"`). Read at each take and give-back, so one process can time both."""

POOLED_PER_SIZE = 8
"""Buffers of one size a pool keeps (more are left to torch's allocator): more than the steps ever in flight."""


class PinnedPool:
    """Pinned [numel] tensors by (numel, dtype), reused after the device has passed the event they came back with."""

    def __init__(self, allocate: Callable[[int, torch.dtype], torch.Tensor] | None = None,
                 per_size: int = POOLED_PER_SIZE):
        self._allocate = allocate or (lambda numel, dtype: torch.empty(numel, dtype=dtype, pin_memory=True))
        self._per_size = per_size
        self._lock = threading.Lock()          # given back on the GPU thread, taken on any thread that scores
        self._returned: dict[tuple[int, torch.dtype], deque] = {}

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A pinned [numel] tensor of `dtype`: the oldest given back whose event has passed, else a new one."""
        if STAGING_POOL:
            with self._lock:
                returned = self._returned.get((numel, dtype))
                # events come back in launch order on one stream: if the oldest has not passed, none has
                if returned and returned[0][1].query():
                    return returned.popleft()[0]
        return self._allocate(numel, dtype)

    def give_back(self, tensors: Iterable[torch.Tensor], event) -> None:
        """`tensors` from `take`, which nothing on the device reads after `event` (recorded behind their last use);
        nothing kept without an event (off CUDA) or while the pool is off."""
        if not STAGING_POOL or event is None:
            return
        with self._lock:
            for tensor in tensors:
                returned = self._returned.setdefault((tensor.numel(), tensor.dtype), deque())
                if len(returned) < self._per_size:
                    returned.append((tensor, event))
