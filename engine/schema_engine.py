"""Schema cache: compute a question schema's prefix once, then score states against it.

In production the questions are fixed and only the state changes.  With the schema-first layout
(`engine.prompt`) the question blocks are a prefix that does not depend on the state, so their layer states - K/V of
the full-attention layers, conv + recurrent state of the Gated DeltaNet layers - are computed once (`prepare`).  A
request runs only "Context: <state>" plus one answer slot per question; on CUDA as a graph per (schema, batch bucket,
length bucket).  The prefix state is read-only during a request, so one copy serves every batch and every graph.

    se = SchemaEngine(engine); h = se.prepare([{"question": ..., "options": [...]}, ...])
    probs = se.score(h, ["state 1", "state 2", ...])          # list of [n_questions, MAX_OPTIONS] tensors
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from engine.errors import InputError
from engine.graphs import GraphManager, StepShape, batch_buckets
from engine.model import PrefixState, SuffixContext
from engine.prompt import (DEFAULT_MAX_CTX_TOKENS, MAX_OPTIONS, ChatTemplate, Question, parse_questions,
                           resolve_temperatures, schema_prefix_ids, schema_suffix_ids)
from engine.readout import fill_ids, option_mask, read_slots


class TokenizedState(NamedTuple):
    """One state's suffix: token ids, the answer-slot positions in them, and whether the state was truncated."""
    ids: list[int]
    slots: list[int]
    truncated: bool = False


@dataclass(eq=False)
class PreparedSchema:
    """A handle from `SchemaEngine.prepare`: the questions and their read-only prefix state."""
    id: int
    questions: tuple[Question, ...]
    independent: bool
    prefix: PrefixState
    option_mask: torch.Tensor          # [n_questions, MAX_OPTIONS] on the device

    @property
    def P(self) -> int:
        """Prefixes: 1 packed, n_questions independent.  A request is P rows."""
        return self.prefix.P

    @property
    def n_questions(self) -> int:
        return len(self.questions)

    @property
    def slots_per_row(self) -> int:
        return 1 if self.independent else self.n_questions

    @property
    def n_options(self) -> list[int]:
        return [len(q.options) for q in self.questions]

    @property
    def prefix_tokens(self) -> int:
        return sum(self.prefix.lengths)

    @property
    def nbytes(self) -> int:
        """Device memory held by the prefix state (graphs excluded)."""
        return self.prefix.nbytes


class SchemaEngine:
    """Prepares question schemas and scores states against them.  Holds any number of prepared schemas.

    Thread use: `tokenize` is CPU-only and safe from any thread; `prepare`, `score_rows` and `warmup` use the device
    and must be called from one thread at a time (the worker's GPU lock).
    """

    def __init__(self, engine, use_graphs: bool = True, chat: ChatTemplate | None = None,
                 max_ctx_tokens: int = DEFAULT_MAX_CTX_TOKENS):
        """chat: wrap prompts in a chat template (`engine.prompt.QWEN_CHAT` for Qwen3.5 instruct models)."""
        self.e, self.fwd, self.chat, self.max_ctx_tokens = engine, engine.forward, chat, max_ctx_tokens
        # a table that attends request by request needs each batch's lengths, which a captured graph cannot take
        by_request = self.fwd.kernels.attend_by_request
        self.graphs = GraphManager(enabled=use_graphs and engine.use_graphs and not by_request)
        self._ids = itertools.count()

    # ---- schemas ---------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def prepare(self, questions: Sequence[dict], independent: bool = False) -> PreparedSchema:
        """Run the prefix(es) of these questions once and return a handle for `score`.

        questions: [{"question": str, "options": [str, ...], "temperature"?: float, "id"?: str}] in answer order.
        independent=False: one prefix holds every question (a request costs state + n slots).
        independent=True: one prefix per question, one row per question (a request costs n x (state + 1 slot); no
        question can influence another's answer).
        Raises InputError (ValueError) on malformed questions.
        """
        qs = tuple(parse_questions(questions))
        groups = [[q] for q in qs] if independent else [list(qs)]
        parts = [self.fwd.prefix(schema_prefix_ids(self.e.tok, g, chat=self.chat)) for g in groups]
        h = PreparedSchema(id=next(self._ids), questions=qs, independent=bool(independent),
                           prefix=PrefixState.stack(parts), option_mask=option_mask([len(q.options) for q in qs]).to(self.e.dev))
        return h

    def release(self, h: PreparedSchema) -> None:
        """Forget a schema's graphs; its prefix memory goes with the last reference to `h`."""
        self.graphs.drop(h.id)

    def batch_buckets(self, max_batch: int) -> list[int]:
        """The batch sizes graphs are captured for when batches hold up to `max_batch` states (what to warm up)."""
        return batch_buckets(max_batch)

    @torch.no_grad()
    def warmup(self, h: PreparedSchema, batch_sizes=(1, 8, 32), state_tokens=(64, 128, 256)) -> float:
        """Capture the graphs for these batch sizes and state lengths ahead of traffic (no-op without graphs).
        Returns the seconds spent."""
        t = time.perf_counter()
        empty = self.tokenize(h, "")
        shapes = self.graphs.warmup_order(batch_sizes, [n + len(empty.ids) for n in state_tokens])
        for shape in shapes:
            row = TokenizedState([self.e.tok.pad_token_id] * shape.T, empty.slots)
            self._score_chunk(h, [row] * shape.R, torch.ones(h.n_questions))
        if shapes:
            torch.cuda.synchronize()
        return time.perf_counter() - t

    def graph_stats(self) -> dict[str, int]:
        """How batches ran so far: CUDA graph `captures` and `replays` (0 without graphs), and `eager` steps."""
        return dict(self.graphs.stats)

    # ---- requests --------------------------------------------------------------------------------------------------
    def tokenize(self, h: PreparedSchema, context: str, max_ctx_tokens: int | None = None) -> TokenizedState:
        """CPU part of a request (do it outside any GPU lock)."""
        if not isinstance(context, str):
            raise InputError(f"state must be a string, got {type(context).__name__}")
        ids, slots, truncated = schema_suffix_ids(self.e.tok, context, h.slots_per_row,
                                                  max_ctx_tokens or self.max_ctx_tokens, chat=self.chat)
        return TokenizedState(ids, slots, truncated)

    def score(self, h: PreparedSchema, contexts: Sequence[str], temperature=None,
              max_ctx_tokens: int | None = None) -> list[torch.Tensor]:
        """-> one [n_questions, MAX_OPTIONS] float32 CPU tensor of probabilities per context.

        temperature: None (each question's own, default 1), a number, or one number per question.
        """
        if isinstance(contexts, str) or not isinstance(contexts, Sequence):
            raise InputError("states: expected a list of strings")
        return self.score_rows(h, [self.tokenize(h, c, max_ctx_tokens) for c in contexts], temperature)

    def score_lists(self, h: PreparedSchema, rows: Sequence[TokenizedState], temperature=None) -> list[list[list[float]]]:
        """`score_rows` as plain Python: per state, per question, the probabilities of that question's options."""
        # one tolist() of the batch: per-row tensors cost ~35 us each to convert (2-core CPU machine), on the thread
        # that drives the GPU
        table = self._score_table(h, rows, temperature).tolist()
        return [[p[:n] for p, n in zip(probs, h.n_options)] for probs in table]

    def score_rows(self, h: PreparedSchema, rows: Sequence[TokenizedState], temperature=None) -> list[torch.Tensor]:
        """rows: from `tokenize`.  -> one [n_questions, MAX_OPTIONS] float32 CPU tensor per row."""
        return list(self._score_table(h, rows, temperature).unbind(0))

    @torch.no_grad()
    def _score_table(self, h: PreparedSchema, rows: Sequence[TokenizedState], temperature=None) -> torch.Tensor:
        """-> [n_rows, n_questions, MAX_OPTIONS] float32 on the CPU."""
        if not rows:
            raise InputError("states: empty batch")
        inv_temp = 1.0 / torch.tensor(resolve_temperatures(h.questions, temperature))              # [n_questions]
        chunk = self.graphs.max_batch
        out = []
        for start in range(0, len(rows), chunk):
            out.append(self._score_chunk(h, rows[start:start + chunk], inv_temp))
        return torch.cat(out).view(len(rows), h.n_questions, MAX_OPTIONS)

    def _score_chunk(self, h: PreparedSchema, rows: Sequence[TokenizedState], inv_temp: torch.Tensor) -> torch.Tensor:
        """-> [len(rows) * n_questions, MAX_OPTIONS] float32 on the CPU."""
        n = len(rows)
        shape = self.graphs.shape(n, max(len(r.ids) for r in rows))
        R, T = shape.R, shape.T
        dev, pin = self.e.dev, self.e.dev.type == "cuda"
        ids = fill_ids([r.ids for r in rows for _ in range(h.P)], R * h.P, T, self.e.tok.pad_token_id, pin=pin)
        flat = torch.zeros(R * h.n_questions, dtype=torch.long)
        flat[:n * h.n_questions] = torch.tensor(self._slot_indices(h, rows, T))
        temps = inv_temp.repeat(R)[:, None]                                                  # [R * nq, 1]
        inputs = tuple(x.to(dev, non_blocking=True) for x in (ids, flat.pin_memory() if pin else flat, temps))
        lengths = [len(r.ids) for r in rows] if self.fwd.kernels.attend_by_request else None
        probs = self.graphs.run((h.id,), shape, inputs, lambda s: self._step_fn(h, s, lengths),
                                out_rows=n * h.n_questions)
        return probs.float().cpu()

    @staticmethod
    def _slot_indices(h: PreparedSchema, rows: Sequence[TokenizedState], T: int) -> list[int]:
        """Flat [row * T + position] of every answer slot, in (request, question) order."""
        if h.P == 1:     # packed: the request's n slots sit in its one row
            return [r * T + s for r, row in enumerate(rows) for s in row.slots]
        return [(r * h.P + p) * T + row.slots[0] for r, row in enumerate(rows) for p in range(h.P)]

    def _step(self, h: PreparedSchema, ctx: SuffixContext, ids, flat, inv_temp) -> torch.Tensor:
        hidden = self.fwd.layers(ids, ctx.positions, ctx)                                     # [R*P, T, H]
        mask = h.option_mask.repeat(ctx.R, 1)                                                 # [R*nq, MAX_OPTIONS]
        return read_slots(hidden, flat, self.fwd.final_norm, self.e.W, inv_temp, mask, self.fwd.kernels.linear)

    def _step_fn(self, h: PreparedSchema, shape: StepShape, lengths: list[int] | None = None):
        """-> (fn(ids, flat, inv_temp) -> probabilities, the context it closes over) for one step at `shape`;
        lengths: the requests' suffix lengths, for a kernel table that attends request by request."""
        ctx = SuffixContext(h.prefix, shape.R, shape.T, self.e.dev, lengths)
        return (lambda ids, flat, inv_temp: self._step(h, ctx, ids, flat, inv_temp)), ctx
