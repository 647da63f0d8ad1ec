"""The graph manager: CUDA graphs of a scoring step, one per (key, batch bucket, length bucket), in one memory pool.

Like vLLM's `cudagraph_utils.py`, `GraphManager` holds the bucket tables (`engine.buckets`) and picks the padded
shape a batch runs at (`shape`), warms up and captures (largest first, so smaller graphs reuse the pool's blocks:
`warmup_order`), copies inputs into a graph's static buffers, replays and slices the static output (`run`), and counts
captures, replays and eager steps (`stats`). Its callers build inputs at the shape it picked, on the host (pinned, so
that each is one asynchronous copy straight into its static buffer) or on the device, and say what one step computes.

Where a step's graph is missing, the manager either captures it there (`background=False`, the default: what a
benchmark or a test that warmed up wants) or never does so on the caller's path (`background=True`, the worker's):
the step runs on the cheapest captured graph that can serve it (`pick`: a larger batch bucket, a longer length bucket,
a key that `serves` it), or eagerly when none can, and its own graph is captured by a thread of the manager's
(`request`), which also captures what callers announce ahead of traffic (`engine.schema_engine.SchemaEngine.announce`).
A capture is `engine.capture.record_step`: one warm-up run, no device-wide synchronize or cache flush, `thread_local`
mode, so the scoring thread goes on launching beside it. Captures are serialised (one at a time into the one pool); a
graph joins the table only once captured, and only if nothing it reads was reallocated meanwhile (`clear`, the
caller's `valid`). While one is under way nothing in the process may empty PyTorch's caching allocator
(`torch.cuda.empty_cache`, or an allocation that fails and retries after freeing the cache): the allocator asserts
that no capture is under way there.
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from engine import buckets
from engine.capture import CapturedStep, CaptureRecord, record_step

__all__ = ["CaptureRecord", "CapturedStep", "GraphManager", "StepBuilder", "StepShape", "StepSpec"]

log = logging.getLogger(__name__)

IDLE_EXIT_S = 60.0
"""A manager's capture thread ends after this long with nothing to capture (a later request starts another)."""


@dataclass(frozen=True)
class StepShape:
    """The shape a step runs at: R requests of T tokens (padded to a bucket when `graphed`, else as they came)."""
    R: int
    T: int
    graphed: bool


StepBuilder = Callable[[StepShape], tuple[Callable[..., torch.Tensor], object]]
"""build(shape) -> (fn, keep): fn(*inputs) -> output, closed over whatever `keep` holds (what a graph must keep)."""

StepSpec = tuple[tuple[torch.Tensor, ...], Callable[..., torch.Tensor], object, Callable[[], bool]]
"""(example inputs at the shape, fn, keep, valid): what a requested capture is made of, built on the capturing thread
when its turn comes; valid() says whether what fn reads is still in place (checked before and after the capture)."""


@dataclass
class _Request:
    key: tuple
    shape: StepShape
    make: Callable[[], StepSpec]
    generation: int
    tag: object = None                    # the caller's, handed back to `on_captured`


def _same_key(held: tuple, wanted: tuple) -> bool:
    return held == wanted


_RUNNING: "weakref.WeakSet[GraphManager]" = weakref.WeakSet()     # managers whose capture thread was started


@atexit.register
def _close_all() -> None:
    # a capture thread still inside torch when the interpreter finalises aborts the process ("terminate called
    # without an active exception"): end every one first (after its capture under way)
    for manager in list(_RUNNING):
        manager.close()


class GraphManager:
    """Captured steps by (key, R, T), all in one private memory pool; `stats` counts captures, replays and eager steps.

    enabled=False (CPU, or graphs switched off) runs every step eagerly at the batch's own shape. `device`: where steps
    run (inputs elsewhere are copied there; None: eager steps run where their inputs are, graphs on the current CUDA
    device). background: never capture on a step's path (module docstring); serves(held_key, wanted_key): whether a
    graph of `held_key` computes a step of `wanted_key` (default: only its own key).
    The pool belongs to this manager alone: PyTorch frees a private pool once no graph holds it, and a later capture
    into a freed pool's handle trips an allocator assertion, so each manager (and each refill after `clear` emptied
    it) takes a fresh handle.

    Thread use: `run`, `pick`, `clear` from the thread that scores; `request` and the counters from any thread; the
    manager's own thread captures what was requested (one at a time; `wait_idle` waits for it to run dry).
    """

    def __init__(self, enabled: bool, batch_sizes: tuple[int, ...] = buckets.B_BUCKETS,
                 token_lengths: tuple[int, ...] = buckets.TS_BUCKETS, device: torch.device | str | None = None,
                 background: bool = False, serves: Callable[[tuple, tuple], bool] = _same_key):
        self.enabled, self.background, self.serves = enabled, background, serves
        self.device = None if device is None else torch.device(device)
        self.batch_sizes, self.token_lengths = batch_sizes, token_lengths
        # captures: graphs captured (anywhere); inline: of those, on a step's path; covered: steps run on a larger
        # graph than their own (background, while theirs is missing); eager: steps run without a graph
        self.stats = {"captures": 0, "replays": 0, "eager": 0, "covered": 0, "inline": 0}
        self.capture_seconds = 0.0
        self.records: deque[CaptureRecord] = deque(maxlen=4096)
        self.on_captured: Callable[[CaptureRecord, object], None] | None = None   # (record, request tag), its thread
        self._pool = None
        self._steps: dict[tuple, CapturedStep] = {}
        self._covers: dict[tuple, tuple | None] = {}      # (key, R, T) -> the held full key that serves it, or None
        self._generation = 0                             # bumped by `clear`: captures begun before it are dropped
        self._lock = threading.Lock()                    # guards the tables above and the queue below
        self._capturing = threading.Lock()               # one capture at a time, into the one pool
        self._work = threading.Condition(self._lock)
        self._queue: deque[_Request] = deque()
        self._queued: set[tuple] = set()
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None

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

    # ---- the step's path -------------------------------------------------------------------------------------------
    def pick(self, key: tuple, shape: StepShape) -> tuple[tuple, StepShape]:
        """The (key, shape) a step of `key` at `shape` runs at: its own when captured, or when the manager captures on
        the path (not `background`); else the held graph that serves it at the least padding (fewest R x T, then the
        smallest key), counted in `covered`; else its own (it will run eagerly: `run`)."""
        if not shape.graphed or not self.background or (*key, shape.R, shape.T) in self._steps:
            return key, shape
        wanted = (key, shape.R, shape.T)
        covers = self._covers
        if wanted not in covers:
            covers[wanted] = self._cover(key, shape)
        cover = covers[wanted]
        if cover is None:
            return key, shape
        self.stats["covered"] += 1
        return cover[:-2], StepShape(cover[-2], cover[-1], graphed=True)

    def _cover(self, key: tuple, shape: StepShape) -> tuple | None:
        best = None
        for full in list(self._steps):          # a copy: the capture thread may add to the table meanwhile
            held, R, T = full[:-2], full[-2], full[-1]
            if R >= shape.R and T >= shape.T and self.serves(held, key):
                rank = (R * T, held, R)
                if best is None or rank < best[0]:
                    best = (rank, full)
        return None if best is None else best[1]

    def run(self, key: tuple, shape: StepShape, inputs: tuple[torch.Tensor, ...], build: StepBuilder,
            out_rows: int, on_miss: Callable[[tuple, StepShape], None] | None = None) -> torch.Tensor:
        """One step on `inputs` (built at `shape`, on the host or the device): replayed from its graph when
        `shape.graphed` and it is held; if it is not, captured first (not `background`), or run eagerly at `shape`
        with `on_miss(key, shape)` called after (`background`: the caller requests the capture); not graphed: run
        eagerly on the inputs moved to the device. -> the first `out_rows` rows of the output; a graph's output is its
        static buffer, valid until the next replay of any graph of this manager."""
        if shape.graphed:
            full_key = (*key, shape.R, shape.T)
            step = self._steps.get(full_key)
            if step is None and not self.background:
                fn, keep = build(shape)
                step = self._capture(full_key, inputs, fn, keep, lambda: True, self._generation, "inline")
            if step is not None:
                self.stats["replays"] += 1
                return step.replay(*inputs)[:out_rows]
        self.stats["eager"] += 1
        fn, _ = build(shape)
        if self.device is not None:
            inputs = tuple(x.to(self.device, non_blocking=True) for x in inputs)
        out = fn(*inputs)[:out_rows]
        if shape.graphed and on_miss is not None:
            on_miss(key, shape)
        return out

    def __len__(self) -> int:
        """Graphs held."""
        return len(self._steps)

    def holds(self, key: tuple, shape: StepShape) -> bool:
        """Whether a graph of `key` at `shape` is captured already."""
        return (*key, shape.R, shape.T) in self._steps

    def held(self) -> list[tuple]:
        """The (key..., R, T) of every graph held."""
        return list(self._steps)

    def clear(self) -> list[tuple]:
        """Forget every graph (the buffers they read were reallocated) and every capture requested or under way;
        later steps capture again. -> the (key..., R, T) that were held, most replayed first (what to capture again)."""
        with self._lock:
            self._generation += 1
            held = sorted(self._steps, key=lambda k: -self._steps[k].replays)
            self._steps, self._covers, self._pool = {}, {}, None
            self._queue.clear()
            self._queued.clear()
        return held

    # ---- captures ahead of a step ----------------------------------------------------------------------------------
    def request(self, key: tuple, shape: StepShape, make: Callable[[], StepSpec], first: bool = False,
                tag: object = None) -> bool:
        """Queue the capture of `key` at `shape` on the manager's thread (`make` builds what it needs when its turn
        comes); first: ahead of everything queued (a shape a batch is waiting on). -> whether it was queued (False:
        held already, queued already, closed, or graphs are off)."""
        if not self.enabled or not shape.graphed:
            return False
        full = (*key, shape.R, shape.T)
        with self._lock:
            if full in self._steps or self._closed:
                return False
            if full in self._queued:
                if first:                               # a batch is waiting on it now: move it up
                    queued = next((r for r in self._queue if (*r.key, r.shape.R, r.shape.T) == full), None)
                    if queued is not None:
                        self._queue.remove(queued)
                        self._queue.appendleft(queued)
                return False
            self._queued.add(full)
            request = _Request(key, shape, make, self._generation, tag)
            self._queue.appendleft(request) if first else self._queue.append(request)
            if self._thread is None:
                self._thread = threading.Thread(target=self._capture_loop, name="decider-capture", daemon=True)
                self._thread.start()
                _RUNNING.add(self)
            self._work.notify()
        return True

    def capture_now(self, key: tuple, shape: StepShape, make: Callable[[], StepSpec], where: str = "warmup") -> bool:
        """Capture `key` at `shape` on the calling thread, now (after a capture of the manager's thread that is under
        way). -> whether a graph was captured (False: held already, graphs off, or no longer `valid`)."""
        if not self.enabled or not shape.graphed or self.holds(key, shape):
            return False
        example, fn, keep, valid = make()
        return self._capture((*key, shape.R, shape.T), example, fn, keep, valid, self._generation, where) is not None

    def close(self, timeout: float = 30.0) -> None:
        """Drop the captures requested and end the manager's thread (after the capture under way); later requests are
        refused. The graphs held stay usable."""
        with self._work:
            self._closed = True
            self._queue.clear()
            self._queued.clear()
            thread = self._thread
            self._work.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def pending(self) -> int:
        """Captures requested and not done yet (the one under way included)."""
        with self._lock:
            return len(self._queue) + self._busy

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every requested capture is done. -> False if `timeout` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._work:
            while self._queue or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._work.wait(left)
        return True

    def _capture_loop(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        done: list[CaptureRecord] = []          # captured since the queue last ran dry
        with torch.no_grad():                   # grad mode is per thread
            while True:
                with self._work:
                    while not self._queue:
                        if self._busy:
                            self._busy = False
                            self._work.notify_all()
                            self._log_captured(done)
                            done = []
                        # closed, or idle for long: end (a later request starts another thread)
                        if self._closed or (not self._work.wait(IDLE_EXIT_S) and not self._queue):
                            self._thread = None
                            return
                    request = self._queue.popleft()
                    self._busy = True
                full = (*request.key, request.shape.R, request.shape.T)
                try:
                    if request.generation == self._generation and full not in self._steps:
                        example, fn, keep, valid = request.make()
                        step = self._capture(full, example, fn, keep, valid, request.generation, "background")
                        if step is not None:
                            done.append(step.record)
                            if self.on_captured is not None:
                                self.on_captured(step.record, request.tag)
                except Exception:       # noqa: BLE001 - a shape that cannot be captured keeps running as it did
                    log.exception("capturing the CUDA graph of %s at %d x %d tokens failed; its steps run on a "
                                  "larger graph or eagerly", request.key, request.shape.R, request.shape.T)
                finally:
                    with self._lock:
                        self._queued.discard(full)

    def _log_captured(self, done: list[CaptureRecord]) -> None:
        if not done:
            return
        log.info("captured %d CUDA graphs in the background in %.2f s (%.1f MiB of device memory; the slowest %.0f "
                 "ms): keys %s, batch buckets %s, length buckets %s; %d graphs held", len(done),
                 sum(r.seconds for r in done), sum(r.nbytes for r in done) / 2**20,
                 max(r.seconds for r in done) * 1000, sorted({r.key for r in done}), sorted({r.R for r in done}),
                 sorted({r.T for r in done}), len(self._steps))

    def _capture(self, full_key: tuple, example: tuple[torch.Tensor, ...], fn: Callable, keep: object,
                 valid: Callable[[], bool], generation: int, where: str) -> CapturedStep | None:
        """Warm up and capture one step on this thread (`_record`); -> the step, held from now on, or None when `clear`
        ran or `valid()` turned False meanwhile (the graph is dropped: it may read freed buffers)."""
        with self._capturing:
            if generation != self._generation or full_key in self._steps:
                return self._steps.get(full_key) if generation == self._generation else None
            started = time.perf_counter()

            def begin(graph) -> bool:
                # under the lock: `clear` cannot drop the pool between reading its handle and the capture taking its
                # share of it, and a capture begun after `clear` never starts
                with self._lock:
                    if generation != self._generation or not valid():
                        return False
                    if self._pool is None:
                        self._pool = self._new_pool()
                    graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                    return True

            made = self._record(example, fn, keep, begin, host_wait=where == "background")
            if made is None:
                return None
            step, nbytes = made
            seconds = time.perf_counter() - started
            step.record = CaptureRecord(full_key[:-2], full_key[-2], full_key[-1], where, seconds, nbytes)
            with self._lock:
                if generation != self._generation or not valid():
                    return None
                self._steps[full_key] = step
                self._covers = {}
                self.stats["captures"] += 1
                if where == "inline":
                    self.stats["inline"] += 1
                self.capture_seconds += seconds
                self.records.append(step.record)
            return step

    @staticmethod
    def _new_pool():
        return torch.cuda.graph_pool_handle()

    def _record(self, example: tuple[torch.Tensor, ...], fn: Callable, keep: object,
                begin: Callable[[torch.cuda.CUDAGraph], bool], host_wait: bool = False
                ) -> tuple[CapturedStep, int] | None:
        """The CUDA part of a capture (`engine.capture.record_step`; tests replace it on the CPU)."""
        return record_step(example, fn, keep, begin, self.device, host_wait)
