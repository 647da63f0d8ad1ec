"""Schema cache: compute a question schema's prefix once, then score states against it.

In production the questions are fixed and only the state changes.  With the schema-first layout
(`engine.prompt`) the question blocks are a prefix that does not depend on the state, so their layer states - K/V of
the full-attention layers, conv + recurrent state of the Gated DeltaNet layers - are computed once (`prepare`) into a
slot of the prefix bank (`engine.prefix_bank`).  A request runs only "Context: <state>" plus one answer slot per
question, each row reading its own prefix from the bank by index: one batch serves any mix of schemas
(`score_mixed`), and on CUDA a step is a graph per (batch bucket, length bucket, answers per row): how many schemas
are live changes neither the graphs nor their count.  Prefix states are read-only during a request.

    se = SchemaEngine(engine); h = se.prepare([{"question": ..., "options": [...]}, ...])
    probs = se.score(h, ["state 1", "state 2", ...])          # list of [n_questions, MAX_OPTIONS] tensors
    se.score_mixed([(h, se.tokenize(h, "state 1")), (h2, se.tokenize(h2, "state 2"))])   # plain lists
    pending = se.launch_mixed(requests); ...; pending.result()     # the same, read later (from any thread)
    se.score_details(h, ["state 1"])       # with the raw probabilities and the label mass (`engine.scores`)

A schema may carry calibration (`engine.calibration`): option biases, from its questions' `option_bias` and, with
`calibration="contextual"`, from its content-free states scored at prepare. Each answer's bias goes to the device with
its row and is subtracted there; the raw distribution and the label mass (`engine.label_mass`) come back beside the
calibrated one, all in the same step.
"""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import torch

from engine.calibration import CONTENT_FREE_STATES, check_calibration, contextual_bias, option_biases
from engine.errors import InputError
from engine.buckets import batch_buckets, unpadded_prefix
from engine.fingerprint import Fingerprint, calibration_part, prompt_part
from engine.graph_plans import GraphPlans, answers_per_row, serves
from engine.graphs import GraphManager, StepShape
from engine.model import SuffixContext
from engine.prefix_bank import PrefixBank
from engine.prompt import (DEFAULT_MAX_CTX_TOKENS, MAX_OPTIONS, ChatTemplate, Question, parse_questions,
                           resolve_temperatures, schema_prefix_ids, schema_suffix_arrays)
from engine.readout import MASS, PROBABILITIES, RAW, SCORE_COLUMNS, read_rows
from engine.scores import PendingScores, Scores
from engine.step_layout import Row, StepLayout

LABEL_MASS_BY_DEFAULT = True
"""Whether a schema's records carry the label mass when neither it (`prepare(..., label_mass=)`) nor the
SchemaEngine says: a step computes it when any of its rows' schemas wants it (the vocabulary's log-sum-exp at every
answer slot of the step). On by default while it costs at most 3% at batch 128 on the H200 (issue 34; bench/README.md
has the timing). Read when a SchemaEngine is made, so `bench/probes/variant_ab.py` can set it per variant."""


class TokenizedState(NamedTuple):
    """One state's suffix: token ids, the answer-slot positions in them, and whether the state was truncated."""
    ids: Sequence[int]                 # an int64 array from `tokenize`: a step copies it into its buffer as one memcpy
    slots: list[int]
    truncated: bool = False


@dataclass(eq=False)
class PreparedSchema:
    """A handle from `SchemaEngine.prepare`: the questions and the prefix bank slots of their prefix states."""
    id: int
    questions: tuple[Question, ...]
    independent: bool
    prefix_slots: tuple[int, ...]      # one per prefix: 1 packed, n_questions independent
    prefix_lengths: tuple[int, ...]
    nbytes: int                        # device memory its bank slots take (graphs excluded: shared by all schemas)
    calibration: str = "none"          # "none" | "contextual" (`engine.calibration`)
    biases: np.ndarray | None = None   # [n_questions, MAX_OPTIONS] float32 option biases applied; None: none
    calibrated: tuple[bool, ...] = ()  # per question, whether a bias changes it (its raw probabilities are reported)
    label_mass: bool = False           # whether its scores carry the label mass
    fingerprint: Fingerprint | None = None   # its scoring fingerprint, once `SchemaEngine.fingerprint` made it

    @property
    def P(self) -> int:
        """Prefixes: 1 packed, n_questions independent.  A request is P rows."""
        return len(self.prefix_slots)

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
        return sum(self.prefix_lengths)


class SchemaEngine(GraphPlans):
    """Prepares question schemas and scores states against them.  Holds any number of prepared schemas, in one prefix
    bank, and scores any mix of them in one batch.

    Thread use: `tokenize` is CPU-only and safe from any thread; `prepare`, `release`, the `score*` methods and
    `warmup` use the device and must be called from one thread at a time (the worker's GPU lock).
    """

    def __init__(self, engine, use_graphs: bool = True, chat: ChatTemplate | None = None,
                 max_ctx_tokens: int = DEFAULT_MAX_CTX_TOKENS, prefix_slots: int = 8, label_mass: bool | None = None,
                 background_captures: bool = False):
        """chat: wrap prompts in a chat template (`engine.prompt.QWEN_CHAT` for Qwen3.5 instruct models);
        prefix_slots: the prefix bank's first size (a packed schema takes one slot, an independent one a slot per
        question); it doubles when full, which drops the graphs captured so far (they are recaptured as batches
        come), so a deployment that knows its schema count can size it once; label_mass: whether schemas that do not
        say carry the label mass (None: `LABEL_MASS_BY_DEFAULT`); background_captures: never capture a CUDA graph on
        a step's path: a batch whose graph is missing runs on a larger captured graph that serves it, or eagerly,
        while a thread captures its graph (and those `announce` asks for) beside the scoring (`engine.graphs`; the
        worker's choice). Off: a step captures its missing graph before it runs (what a benchmark wants)."""
        self.e, self.fwd, self.chat, self.max_ctx_tokens = engine, engine.forward, chat, max_ctx_tokens
        self.label_mass = LABEL_MASS_BY_DEFAULT if label_mass is None else bool(label_mass)
        # a table that attends row by row needs each batch's lengths, which a captured graph cannot take
        by_request = self.fwd.kernels.attend_by_request
        self.graphs = GraphManager(enabled=use_graphs and engine.use_graphs and not by_request, device=engine.dev,
                                   background=background_captures, serves=serves)
        self.bank = PrefixBank(engine.dev, prefix_slots)
        self._graphs_generation = self.bank.generation
        self._ids = itertools.count()
        self._live: dict[int, PreparedSchema] = {}       # prepared and not released: what mixed batches can hold
        self._overheads: dict[int, int] = {}             # answer slots a row -> suffix tokens of an empty state
        self._seen_lengths: Counter[int] = Counter()     # state tokens of each step's longest row, in steps of 8
        self._pad_id = engine.tok.pad_token_id      # read once: transformers answers it through __getattr__ (~15 us)

    # ---- schemas ---------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def prepare(self, questions: Sequence[dict], independent: bool = False, calibration: str = "none",
                label_mass: bool | None = None) -> PreparedSchema:
        """Run the prefix(es) of these questions once into the prefix bank and return a handle for `score`.

        questions: [{"question": str, "options": [str, ...], "temperature"?: float, "id"?: str,
        "option_bias"?: [float, ...]}] in answer order.
        independent=False: one prefix holds every question (a request costs state + n slots).
        independent=True: one prefix per question, one row per question (a request costs n x (state + 1 slot); no
        question can influence another's answer).
        calibration: "none", or "contextual": the content-free states are scored now and the log of their mean
        distribution is added to each question's option bias (`engine.calibration`).
        label_mass: whether its scores carry the label mass (None: the SchemaEngine's `label_mass`).
        Raises InputError (ValueError) on malformed questions.
        """
        qs = tuple(parse_questions(questions))
        check_calibration(calibration)
        groups = [[q] for q in qs] if independent else [list(qs)]
        parts = [self.fwd.prefix(schema_prefix_ids(self.e.tok, g, chat=self.chat)) for g in groups]
        slots = tuple(self.bank.add(p) for p in parts)
        h = PreparedSchema(id=next(self._ids), questions=qs, independent=bool(independent), prefix_slots=slots,
                           prefix_lengths=tuple(p.lengths[0] for p in parts), nbytes=len(slots) * self.bank.slot_nbytes,
                           calibration=calibration, label_mass=self.label_mass if label_mass is None else bool(label_mass))
        bias = option_biases(qs)
        if calibration == "contextual":
            context = contextual_bias(self._content_free_scores(h), h.n_options)
            bias = context if bias is None else bias + context
        h.biases = None if bias is None else bias.astype(np.float32)
        h.calibrated = tuple(h.biases is not None and bool(np.any(h.biases[q, :n] != 0))
                             for q, n in enumerate(h.n_options))
        self._live[h.id] = h
        return h

    def fingerprint(self, h: PreparedSchema) -> Fingerprint:
        """The scoring fingerprint of `h`'s scores on this engine (`engine.fingerprint`): scores of a state with equal
        fingerprints are bit-identical with a deterministic table. Made once (the engine's parts once per engine; the
        model was hashed at load) and kept as `h.fingerprint`. It assumes the questions' own temperatures, as the
        worker scores (a `temperature=` given to `score` is not in it)."""
        if h.fingerprint is None:
            model, decider, kernels = self.e.fingerprint_parts()
            h.fingerprint = Fingerprint(model, decider, kernels,
                                        prompt_part(h.questions, h.independent, self.chat, self.max_ctx_tokens),
                                        calibration_part(h.questions, h.calibration))
        return h.fingerprint

    def _content_free_scores(self, h: PreparedSchema) -> list[list[list[float]]]:
        """Per content-free state, per question, its probabilities at temperature 1 (`h` has no bias yet: raw)."""
        rows = [self.tokenize(h, text) for text in CONTENT_FREE_STATES]
        return self._launch([(h, r, [1.0] * h.n_questions) for r in rows]).result()

    def release(self, h: PreparedSchema) -> None:
        """Give the schema's bank slots back (their memory is reused by the next schema prepared; graphs stay)."""
        self._live.pop(h.id, None)
        self.bank.free(h.prefix_slots)

    def live_schemas(self) -> int:
        """Schemas prepared and not released."""
        return len(self._live)

    def memory(self) -> dict[str, int]:
        """Device memory of prepared schemas: the prefix bank's `bank_bytes`, its `slots` and `live_slots`, and
        `slot_bytes` (one prefix)."""
        return {"bank_bytes": self.bank.nbytes, "slots": self.bank.capacity, "live_slots": self.bank.live_slots,
                "slot_bytes": self.bank.slot_nbytes}

    def batch_buckets(self, max_batch: int) -> list[int]:
        """The batch sizes graphs are captured for when batches hold up to `max_batch` states (what to warm up)."""
        return batch_buckets(max_batch)

    def graph_stats(self) -> dict[str, int]:
        """How batches ran so far: CUDA graph `captures` (`inline`: of those, on a step's path) and `replays` (0
        without graphs), steps `covered` by a larger graph than their own (`background_captures`, while theirs is
        being captured), `eager` steps, the `graphs` held now and the captures `pending`."""
        return {**self.graphs.stats, "graphs": len(self.graphs), "pending": self.graphs.pending()}

    # ---- requests --------------------------------------------------------------------------------------------------
    def tokenize(self, h: PreparedSchema, context: str, max_ctx_tokens: int | None = None) -> TokenizedState:
        """CPU part of a request (do it outside any GPU lock): the ids as an array, so that the GPU thread, which stages
        a batch's rows, copies each as one block (on a 2-core host: 37 against 63 us for 8 rows of 180 tokens)."""
        return self.tokenize_many(h, [context], max_ctx_tokens)[0]

    def tokenize_many(self, h: PreparedSchema, contexts: Sequence[str],
                      max_ctx_tokens: int | None = None) -> list[TokenizedState]:
        """`tokenize` of several states in one tokenizer call (what a worker's batch of states costs once, not once a
        state)."""
        for context in contexts:
            if not isinstance(context, str):
                raise InputError(f"state must be a string, got {type(context).__name__}")
        return [TokenizedState(ids, slots, truncated) for ids, slots, truncated in
                schema_suffix_arrays(self.e.tok, contexts, h.slots_per_row, max_ctx_tokens or self.max_ctx_tokens,
                                     chat=self.chat)]

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
        inv_temps = self._inv_temps(h, temperature)
        return self._launch([(h, r, inv_temps) for r in rows]).result()

    def unpadded_count(self, schemas: Sequence[PreparedSchema]) -> int:
        """For a batch of states of these schemas (one entry a state, in order): how many leading states run with no
        padded row in their steps' CUDA graphs (`engine.buckets.unpadded_prefix`; all of them without graphs). A padded
        row costs the device what a real one does, so a caller whose batch would wait behind another anyway can launch
        these and keep the rest for its next batch."""
        if not self.graphs.enabled:
            return len(schemas)
        return unpadded_prefix([h.P for h in schemas], self.graphs.batch_sizes)

    def score_mixed(self, requests: Sequence[tuple[PreparedSchema, TokenizedState]]) -> list[list[list[float]]]:
        """States of any mix of prepared schemas in one batch ((schema, tokenized state) pairs, each schema's own
        temperatures) -> per state, per question of its schema, the probabilities of that question's options."""
        return self.launch_mixed(requests).result()

    def launch_mixed(self, requests: Sequence[tuple[PreparedSchema, TokenizedState]]) -> PendingScores:
        """`score_mixed` without waiting: the batch is queued on the device and the scores are read later with
        `PendingScores.result()`, from any thread. A caller that launches the next batch before reading this one's keeps
        the device busy while it turns scores into records (on CPU the batch is scored before this returns)."""
        temps = {}
        for h, _ in requests:
            if h.id not in temps:
                temps[h.id] = self._inv_temps(h, None)
        return self._launch([(h, r, temps[h.id]) for h, r in requests])

    def score_rows(self, h: PreparedSchema, rows: Sequence[TokenizedState], temperature=None) -> list[torch.Tensor]:
        """rows: from `tokenize`.  -> one [n_questions, MAX_OPTIONS] float32 CPU tensor per row."""
        return list(self._table(h, rows, temperature)[:, :, PROBABILITIES].unbind(0))

    def score_details(self, h: PreparedSchema, contexts: Sequence[str], temperature=None,
                      max_ctx_tokens: int | None = None) -> list[Scores]:
        """`score` with the raw probabilities (before the option bias) and the label mass: one `Scores` per context."""
        if isinstance(contexts, str) or not isinstance(contexts, Sequence):
            raise InputError("states: expected a list of strings")
        table = self._table(h, [self.tokenize(h, c, max_ctx_tokens) for c in contexts], temperature)
        return [Scores(t[:, PROBABILITIES], t[:, RAW], t[:, MASS]) for t in table.unbind(0)]

    def _table(self, h: PreparedSchema, rows: Sequence[TokenizedState], temperature) -> torch.Tensor:
        """[rows, n_questions, SCORE_COLUMNS] float32 CPU tensor of the rows' read-out."""
        inv_temps = self._inv_temps(h, temperature)
        chunks = self._launch_requests([(h, r, inv_temps) for r in rows])
        self._synchronize()
        table = torch.cat(chunks).view(len(rows), h.n_questions, SCORE_COLUMNS)
        if not h.label_mass:
            table[:, :, MASS] = float("nan")      # a step it shared with (or ran on the graph of) a schema that wants it
        return table

    @staticmethod
    def _inv_temps(h: PreparedSchema, temperature) -> list[float]:
        return [1.0 / t for t in resolve_temperatures(h.questions, temperature)]

    def _launch(self, requests: Sequence[tuple[PreparedSchema, TokenizedState, list[float]]]) -> PendingScores:
        return PendingScores([h for h, _, _ in requests], self._launch_requests(requests), self._record_done())

    def _record_done(self) -> torch.cuda.Event | None:
        """An event behind everything queued so far (None off CUDA, where nothing is queued)."""
        if self.e.dev.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _synchronize(self) -> None:
        if self.e.dev.type == "cuda":
            torch.cuda.current_stream().synchronize()

    @torch.no_grad()
    def _launch_requests(self, requests: Sequence[tuple[PreparedSchema, TokenizedState, list[float]]]
                         ) -> list[torch.Tensor]:
        """Queue the batch -> per step, [its answers, SCORE_COLUMNS] float32 host tensors (being filled on CUDA until
        the stream reaches the steps), request by request, in question order."""
        if not requests:
            raise InputError("states: empty batch")
        rows = [row for h, state, inv_temps in requests for row in self._rows_of(h, state, inv_temps)]
        chunk = self.graphs.max_batch
        return [self._score_step(rows[start:start + chunk]) for start in range(0, len(rows), chunk)]

    @staticmethod
    def _rows_of(h: PreparedSchema, state: TokenizedState, inv_temps: list[float]) -> list[Row]:
        """A request's rows: its one row (packed) or one per question (independent), in question order."""
        biases = h.biases
        if not h.independent:
            return [Row(h.prefix_slots[0], state.ids, state.slots, inv_temps, h.n_options, biases, h.label_mass)]
        return [Row(slot, state.ids, state.slots[:1], [t], [n], None if biases is None else biases[q:q + 1],
                    h.label_mass)
                for q, (slot, t, n) in enumerate(zip(h.prefix_slots, inv_temps, h.n_options))]

    def _score_step(self, rows: Sequence[Row]) -> torch.Tensor:
        """Queue one step over up to `graphs.max_batch` rows -> [their answers, SCORE_COLUMNS] float32 on the host, in
        pinned memory the step's copy fills when the stream reaches it (on CUDA: read it after an event behind it).
        The step computes the label mass when any of its rows wants it (a graph per choice)."""
        self._sync_graphs()
        longest = max(rows, key=_ids_length)
        tmax = len(longest.ids)
        self._seen_lengths[-(-(tmax - self._overhead(len(longest.answers))) // 8) * 8] += 1
        shape = self.graphs.shape(len(rows), tmax)
        key = (answers_per_row(max(len(r.answers) for r in rows)), any(r.label_mass for r in rows))
        key, shape = self.graphs.pick(key, shape)           # with background captures: a larger graph while its own
        per_row, with_mass = key                            # is missing
        layout = StepLayout(shape.R, shape.T, shape.R * per_row)
        pin = self.e.dev.type == "cuda"
        staged = layout.stage(rows, self._pad_id, pin=pin)
        slots = [r.prefix_slot for r in rows]
        by_row = self.fwd.kernels.attend_by_request
        lengths = [len(r.ids) for r in rows] if by_row else None
        host_slots = slots if by_row else None
        key_span = self.bank.capacity_tokens if shape.graphed else max(self.bank.host_lengths[s] for s in slots)
        probs = self.graphs.run(key, shape, (staged,),
                                lambda s: self._step_fn(s, layout, key_span, lengths, host_slots, with_mass),
                                out_rows=sum(len(r.answers) for r in rows), on_miss=self._missed)
        if not pin:
            return probs.float()
        # a graph's output buffer is overwritten by the next replay, but this copy is queued before it
        host_probs = torch.empty(probs.shape, dtype=torch.float32, pin_memory=True)
        return host_probs.copy_(probs, non_blocking=True)

    def _step_fn(self, shape: StepShape, layout: StepLayout, key_span: int, lengths: list[int] | None,
                 host_slots: list[int] | None, with_mass: bool):
        """-> (fn(staged) -> the read-out of the step's answers, nothing to keep) at `shape` (`layout`'s)."""
        kernels = self.fwd.kernels
        vocab_lse = None
        if with_mass:
            def vocab_lse(normed):
                return self.e.vocab.logsumexp(normed, kernels.linear, kernels.row_logsumexp, kernels.vocab_logsumexp)

        def step(staged):
            ids, slots, flat, n_options, answers, inv_temp, bias = layout.unstage(staged)
            mask = torch.arange(MAX_OPTIONS, device=ids.device)[None, :] < n_options[:, None]      # [A, MAX_OPTIONS]
            ctx = SuffixContext(self.bank, slots, shape.T, key_span, lengths, host_slots, answers)
            hidden = self.fwd.layers(ids, ctx.positions, ctx, rows=flat)                      # [A, H]
            return read_rows(hidden, self.fwd.final_norm, self.e.W, inv_temp[:, None], bias, mask, kernels.linear,
                             vocab_lse, kernels.ordered_mass, kernels.score_rows)
        return step, None


def _ids_length(row: Row) -> int:
    return len(row.ids)
