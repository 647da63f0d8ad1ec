"""What CUDA graphs a schema's batches can need, and having them captured ahead of its batches (`GraphPlans`, a part
of `engine.schema_engine.SchemaEngine`).

A graph depends on a step's shape alone (`engine.prefix_bank`: rows name their prefix by slot), keyed by (answers a
row, rounded up to a power of 2; whether the label mass is computed) and sized by (batch bucket, length bucket): one
graph serves every schema of its shape, and a graph of a larger key or size serves a smaller step (`serves`,
`engine.graphs.GraphManager.pick`). A schema prepared can be scored alone or in a batch with any live schema, whose
key is the mix's largest and whose rows are every state's (P a state), at any length its states have: `graph_plan`
lists those graphs at the lengths it is given and the ones the stream's states had so far; `announce` has them
captured (beside the scoring, with background captures); `warmup` captures one schema's own, now.
"""
from __future__ import annotations

import logging
import time
from typing import Sequence

import numpy as np
import torch

from engine.buckets import batch_buckets
from engine.graphs import StepShape, StepSpec
from engine.prompt import MAX_OPTIONS, schema_suffix_ids
from engine.step_layout import Row, StepLayout

log = logging.getLogger(__name__)

PLAN_SEEN_LENGTHS = 4
"""How many of the state lengths scored so far (the most frequent, in steps of 8 tokens) a new schema's graph plan
covers besides the lengths it is given (`SchemaEngine.graph_plan`): each length is about one length bucket, i.e. up to
one graph per batch bucket and key (16 at --max-batch 32), so this bounds what a schema adds; other lengths run on a
larger graph, or eagerly once, until theirs is captured."""


class GraphPlans:
    """The graph-planning part of `SchemaEngine` (it holds `graphs`, `bank`, `e`, `chat`, `max_ctx_tokens`, the live
    schemas `_live`, the state lengths met `_seen_lengths`, and `_step_fn`, `_synchronize`, `_graphs_generation`)."""

    @torch.no_grad()
    def warmup(self, h, batch_sizes=(1, 8, 32), state_tokens=(64, 128, 256)) -> float:
        """Capture the graphs batches of this schema run at, for these batch sizes (in states) and state lengths, now,
        on this thread; graphs are shared by every schema, so a later schema of the same shape captures nothing.
        No-op without graphs. Returns the seconds spent. (`announce`: the same and more, off the caller's path.)"""
        t = time.perf_counter()
        self._sync_graphs()
        rows = [n * h.P for n in batch_sizes]
        shapes = self.graphs.warmup_order([min(r, self.graphs.max_batch) for r in rows],
                                          [n + self._overhead(h.slots_per_row) for n in state_tokens])
        key = (answers_per_row(h.slots_per_row), h.label_mass)
        for shape in shapes:
            self.graphs.capture_now(key, shape, self._spec(key, shape))
        if shapes:
            self._synchronize()
        return time.perf_counter() - t

    def graph_plan(self, h, max_batch: int = 32, state_tokens: Sequence[int] = ()
                   ) -> list[tuple[tuple, StepShape]]:
        """The (key, shape) of every graph a batch holding `h`'s states can run at that is not captured yet, largest
        first: batches of up to `max_batch` states of `h` alone and mixed with each live schema (a mixed batch's key is
        its rows' most answers a row and whether any wants the label mass; its rows are every state's, P a state), at
        the state lengths `state_tokens` and the `PLAN_SEEN_LENGTHS` lengths met most so far (each at every schema of
        the mix's suffix overhead). Empty without graphs, or when no length is known."""
        if not self.graphs.enabled:
            return []
        lengths = set(state_tokens) | {n for n, _ in self._seen_lengths.most_common(PLAN_SEEN_LENGTHS)}
        if not lengths:
            return []
        kinds = {(x.slots_per_row, x.label_mass, x.P) for x in list(self._live.values()) if x is not h}
        own = (h.slots_per_row, h.label_mass, h.P)
        wanted: set[tuple[tuple, StepShape]] = set()
        for group in [(own,)] + [(own, other) for other in kinds]:
            key = (answers_per_row(max(g[0] for g in group)), any(g[1] for g in group))
            rows = min(max_batch * max(g[2] for g in group), self.graphs.max_batch)
            tokens = {n + self._overhead(g[0]) for n in lengths for g in group}
            for shape in self.graphs.warmup_order(batch_buckets(rows), tokens):
                if not self.graphs.holds(key, shape):
                    wanted.add((key, shape))
        return sorted(wanted, key=lambda ks: (ks[1].R * ks[1].T, ks[1].R, ks[0]), reverse=True)

    def announce(self, h, max_batch: int = 32, state_tokens: Sequence[int] = ()
                 ) -> list[tuple[tuple, StepShape]]:
        """Request the capture of `graph_plan(h, max_batch, state_tokens)` and return at once: with
        `background_captures` the manager's thread captures them beside the scoring, largest first (the first one
        serves every smaller shape of its key while the rest come); without, they are captured now, here. -> the plan
        (what was requested)."""
        self._sync_graphs()         # graphs captured now must not be dropped by the next step for an old reallocation
        plan = self.graph_plan(h, max_batch, state_tokens)
        if not plan:
            return plan
        if self.graphs.background:
            for key, shape in plan:
                self.graphs.request(key, shape, self._spec(key, shape), tag=h.id)
            log.info("schema #%d (%d questions, %d rows a state): %d CUDA graphs requested for capture in the "
                     "background: keys (answers a row, label mass) %s, batch buckets %s, length buckets %s", h.id,
                     h.n_questions, h.P, len(plan), sorted({k for k, _ in plan}), sorted({s.R for _, s in plan}),
                     sorted({s.T for _, s in plan}))
        else:
            with torch.no_grad():
                for key, shape in plan:
                    self.graphs.capture_now(key, shape, self._spec(key, shape))
        return plan

    def close(self) -> None:
        """End the background capture thread (after the capture under way); scoring goes on with the graphs held."""
        self.graphs.close()

    def wait_for_captures(self, timeout: float | None = None) -> bool:
        """Wait until the graphs requested so far are captured (`announce`, batches that missed theirs). -> False if
        `timeout` passed first."""
        return self.graphs.wait_idle(timeout)

    def _overhead(self, slots_per_row: int) -> int:
        """Suffix tokens of an empty state, for rows of this many answer slots (the state's own tokens come on top)."""
        n = self._overheads.get(slots_per_row)
        if n is None:
            n = self._overheads[slots_per_row] = len(schema_suffix_ids(self.e.tok, "", slots_per_row,
                                                                       self.max_ctx_tokens, chat=self.chat)[0])
        return n

    def _spec(self, key: tuple, shape: StepShape):
        """-> make(): what capturing `key` at `shape` needs (`engine.graphs.StepSpec`), built when its turn comes:
        a step of padding rows continuing a live prefix (a graph's work depends on the shape alone), on the bank as it
        is then; valid while the bank keeps its buffers."""
        def make() -> StepSpec:
            generation = self.bank.generation
            per_row, with_mass = key
            layout = StepLayout(shape.R, shape.T, shape.R * per_row)
            slot = next((x.prefix_slots[0] for x in list(self._live.values())), 0)
            pad = self.e.tok.pad_token_id
            row = Row(slot, np.full(shape.T, pad, dtype=np.int64), [shape.T - 1], [1.0], [MAX_OPTIONS], None,
                      with_mass)
            staged = layout.stage([row], pad, pin=self.e.dev.type == "cuda")
            fn, keep = self._step_fn(shape, layout, self.bank.capacity_tokens, None, None, with_mass)
            return (staged,), fn, keep, lambda: self.bank.generation == generation
        return make

    def _sync_graphs(self) -> None:
        """Drop the graphs when the bank reallocated its buffers (they read the old ones); with background captures,
        ask for them again, most replayed first."""
        if self.bank.generation == self._graphs_generation:
            return
        self._synchronize()     # a launched batch may still be replaying one of the graphs dropped here
        held = self.graphs.clear()
        self._graphs_generation = self.bank.generation
        if self.graphs.background and held:
            for full in held:
                key, shape = full[:-2], StepShape(full[-2], full[-1], graphed=True)
                self.graphs.request(key, shape, self._spec(key, shape))
            log.info("prefix bank reallocated: %d CUDA graphs dropped, captured again in the background", len(held))

    def _missed(self, key: tuple, shape: StepShape) -> None:
        """A step ran eagerly for want of a graph that serves it (background captures): capture its own next."""
        self.graphs.request(key, shape, self._spec(key, shape), first=True)


def serves(held: tuple, wanted: tuple) -> bool:
    """Whether a graph of key `held` (answers a row, label mass) computes a step of key `wanted`: room for as many
    answers a row, and the label mass if it is wanted (computed and left unread where it is not)."""
    return held[0] >= wanted[0] and held[1] >= wanted[1]


def answers_per_row(n: int) -> int:
    """The answers a step's rows may hold: the power of 2 at or above the most any row holds (a graph's key)."""
    return 1 << (n - 1).bit_length()
