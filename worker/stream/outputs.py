"""What a cycle publishes: one record per consumed state, in input order, a probability record or a dead letter.

Dead letters decided while routing (bad bytes, unknown schema, ...) are already on their ``Pending``; the others
come from the scorer's results. Counts by schema and by ``Reason`` are kept as the records are made, for the
metrics and the ``committed`` event.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import schemas
from worker.ops import metrics
from worker.stream.batcher import Cycle, Pending
from worker.config import Topics, WorkerConfig
from worker.formats.output_formats import DEAD_LETTER, PROBABILITIES, OutputEncoder
from worker.formats.probability_avro import ProbabilityWriter, matches_schema
from worker.formats.records import (Headers, OutgoingRecord, Reason, SchemaKey, SourceRecord, dead_letter,
                                    probability_record, state_key)
from worker.stream.scored import ScoredState

SAMPLES = 3
"""Probability records kept per cycle for the ``committed`` event (the demo prints them)."""


def start_encoder(config: WorkerConfig) -> OutputEncoder:
    """The encoder of ``config``'s ``--output-format``, started: with a registry, decider's schemas are registered (or
    looked up) now, so a registry that is down or refuses them stops the loop before any record (one line)."""
    topics = config.topics
    encoder = OutputEncoder(config.output_format, {PROBABILITIES: topics.probabilities, DEAD_LETTER: topics.dead_letter},
                            config.registry)
    encoder.start()
    return encoder


@dataclass
class CycleOutputs:
    """A cycle's records in input order, and what they hold."""

    records: list[OutgoingRecord] = field(default_factory=list)
    scored: Counter[str] = field(default_factory=Counter)  # by schema id
    dead_letters: Counter[Reason] = field(default_factory=Counter)
    samples: "Samples" = field(default_factory=lambda: Samples())

    def dead_letters_by_code(self) -> dict[str, int]:
        """The dead letters by reason code, as events, logs and metrics show them."""
        return {reason.value: count for reason, count in self.dead_letters.items()}


class Samples(Sequence):
    """A cycle's first ``SAMPLES`` probability records as dicts, made only if read (the ``committed`` event carries them;
    the logs drop them): the records themselves are written without a dict."""

    def __init__(self) -> None:
        self._made: list[dict[str, Any]] | None = []
        self._pending: list[Callable[[], dict[str, Any]]] = []

    def add(self, make: Callable[[], dict[str, Any]]) -> None:
        self._pending.append(make)

    def _records(self) -> list[dict[str, Any]]:
        if self._pending:
            self._made += [make() for make in self._pending]
            self._pending = []
        return self._made

    def __len__(self) -> int:
        return len(self._made) + len(self._pending)

    def __getitem__(self, index):
        return self._records()[index]


class Outputs:
    """Makes the worker's output records: its output topics, its id and the model's id go into each one, encoded
    by ``encoder`` (``--output-format``; started already), with the input record's headers that ``headers_of``
    picks (``--propagate-headers``)."""

    def __init__(self, topics: Topics, worker_id: str, model_id: str, encoder: OutputEncoder | None = None,
                 headers_of: Callable[[SourceRecord], Headers] | None = None) -> None:
        self._topics, self._worker_id, self._model_id = topics, worker_id, model_id
        self._encode_probability = encoder.probability if encoder is not None else schemas.encode_probability
        self._encode_dead_letter = encoder.dead_letter if encoder is not None else schemas.encode_dead_letter
        self._headers_of = headers_of or (lambda source: [])
        # schemaless Avro (the default) is written without the record's dict, per schema version
        schemaless = encoder is None or encoder.output_format == "avro"
        self._writers: dict[tuple, ProbabilityWriter] | None = {} if schemaless and matches_schema() else None

    def reject(self, pending: Pending, reason: Reason, message: str) -> None:
        """Decide ``pending``'s outcome: a dead letter for ``reason``."""
        pending.reason = reason
        pending.dead_letter = dead_letter(pending.source, reason, message, self._topics.dead_letter, self._worker_id,
                                          state=pending.state, encode=self._encode_dead_letter,
                                          headers=self._headers_of(pending.source) or None)

    def of_cycle(self, cycle: Cycle, results: dict[SchemaKey, list[ScoredState]]) -> CycleOutputs:
        """The records of ``cycle`` given its batches' scoring ``results`` (scored now: one time for the cycle)."""
        out = CycleOutputs()
        scored_at = int(time.time() * 1000)
        for pending in cycle.entries:
            if pending.dead_letter is None:
                scored = results[pending.batch_key][pending.batch_index]
                if scored.reason is not None:
                    self.reject(pending, scored.reason, scored.error or scored.reason.value)
                else:
                    out.records.append(self._probabilities(pending, cycle.batches[pending.batch_key].schema, scored, out,
                                                           scored_at))
                    continue
            out.dead_letters[pending.reason] += 1
            out.records.append(pending.dead_letter)
        return out

    def _probabilities(self, pending: Pending, schema: dict[str, Any], scored: ScoredState, out: CycleOutputs,
                       scored_at: int) -> OutgoingRecord:
        schema_id = schema["schema_id"]
        out.scored[schema_id] += 1
        if scored.label_mass:
            # as records are made: a cycle whose transaction aborts is scored, and observed, again
            metrics.LABEL_MASS.labels(schema_id).observe(min(scored.label_mass))
        writer = self._writer(schema, scored.fingerprint)
        record = lambda: probability_record(  # noqa: E731
            pending.state, schema, scored.probabilities, self._model_id, pending.source, self._worker_id,
            truncated=scored.truncated, label_mass=scored.label_mass, raw_probabilities=scored.raw_probabilities,
            fingerprint=scored.fingerprint, scored_at=scored_at)
        if len(out.samples) < SAMPLES:
            out.samples.add(record)
        if writer is None:
            return OutgoingRecord(self._topics.probabilities, state_key(pending.state["state_id"]),
                                  self._encode_probability(record()), self._headers_of(pending.source) or None)
        source = pending.source
        value = writer.write(pending.state, scored.probabilities, source.topic, source.partition, source.offset, scored_at,
                             scored.truncated, scored.label_mass, scored.raw_probabilities)
        return OutgoingRecord(self._topics.probabilities, state_key(pending.state["state_id"]), value,
                              self._headers_of(source) or None)

    def _writer(self, schema: dict[str, Any], fingerprint: dict[str, str] | None) -> ProbabilityWriter | None:
        """The schemaless writer of ``schema``'s version as scored with ``fingerprint`` (None: records go through the
        encoder of --output-format)."""
        if self._writers is None:
            return None
        key = (schema["schema_id"], schema["version"], fingerprint["digest"] if fingerprint else None)
        writer = self._writers.get(key)
        if writer is None:
            writer = self._writers[key] = ProbabilityWriter(schema, self._model_id, self._worker_id, fingerprint)
        return writer
