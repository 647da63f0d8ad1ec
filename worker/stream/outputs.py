"""What a cycle publishes: one record per consumed state, in input order, a probability record or a dead letter.

Dead letters decided while routing (bad bytes, unknown schema, ...) are already on their ``Pending``; the others
come from the scorer's results. Counts by schema and by ``Reason`` are kept as the records are made, for the
metrics and the ``committed`` event.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import schemas
from worker.ops import metrics
from worker.stream.batcher import Cycle, Pending
from worker.config import Topics, WorkerConfig
from worker.formats.output_formats import DEAD_LETTER, PROBABILITIES, OutputEncoder
from worker.formats.records import (Headers, OutgoingRecord, Reason, SchemaKey, SourceRecord, dead_letter,
                                    probability_record, state_key)
from worker.stream.scorer import ScoredState

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
    samples: list[dict[str, Any]] = field(default_factory=list)

    def dead_letters_by_code(self) -> dict[str, int]:
        """The dead letters by reason code, as events, logs and metrics show them."""
        return {reason.value: count for reason, count in self.dead_letters.items()}


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

    def reject(self, pending: Pending, reason: Reason, message: str) -> None:
        """Decide ``pending``'s outcome: a dead letter for ``reason``."""
        pending.reason = reason
        pending.dead_letter = dead_letter(pending.source, reason, message, self._topics.dead_letter, self._worker_id,
                                          state=pending.state, encode=self._encode_dead_letter,
                                          headers=self._headers_of(pending.source) or None)

    def of_cycle(self, cycle: Cycle, results: dict[SchemaKey, list[ScoredState]]) -> CycleOutputs:
        """The records of ``cycle`` given its batches' scoring ``results``."""
        out = CycleOutputs()
        for pending in cycle.entries:
            if pending.dead_letter is None:
                scored = results[pending.batch_key][pending.batch_index]
                if scored.reason is not None:
                    self.reject(pending, scored.reason, scored.error or scored.reason.value)
                else:
                    out.records.append(self._probabilities(pending, cycle.batches[pending.batch_key].schema, scored, out))
                    continue
            out.dead_letters[pending.reason] += 1
            out.records.append(pending.dead_letter)
        return out

    def _probabilities(self, pending: Pending, schema: dict[str, Any], scored: ScoredState, out: CycleOutputs) -> OutgoingRecord:
        record = probability_record(pending.state, schema, scored.probabilities, self._model_id, pending.source,
                                    self._worker_id, truncated=scored.truncated, label_mass=scored.label_mass,
                                    raw_probabilities=scored.raw_probabilities, fingerprint=scored.fingerprint)
        out.scored[record["schema_id"]] += 1
        if scored.label_mass:
            # as records are made: a cycle whose transaction aborts is scored, and observed, again
            metrics.LABEL_MASS.labels(record["schema_id"]).observe(min(scored.label_mass))
        if len(out.samples) < SAMPLES:
            out.samples.append(record)
        return OutgoingRecord(self._topics.probabilities, state_key(record["state_id"]), self._encode_probability(record),
                              self._headers_of(pending.source) or None)
