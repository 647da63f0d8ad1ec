"""What a cycle publishes: one record per consumed state, in input order, a probability record or a dead letter.

Dead letters decided while routing (bad bytes, unknown schema, ...) are already on their ``Pending``; the others
come from the scorer's results. Counts by schema and by ``Reason`` are kept as the records are made, for the
metrics and the ``committed`` event.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import schemas
from worker.batcher import Cycle, Pending
from worker.config import Topics
from worker.records import OutgoingRecord, Reason, SchemaKey, dead_letter, probability_record
from worker.scorer import ScoredState

SAMPLES = 3
"""Probability records kept per cycle for the ``committed`` event (the demo prints them)."""


@dataclass
class CycleOutputs:
    """A cycle's records in input order, and what they hold."""

    records: list[OutgoingRecord] = field(default_factory=list)
    scored: Counter[str] = field(default_factory=Counter)  # by schema id
    dead_letters: Counter[Reason] = field(default_factory=Counter)
    samples: list[dict[str, Any]] = field(default_factory=list)


class Outputs:
    """Makes the worker's output records: its output topics, its id and the model's id go into each one."""

    def __init__(self, topics: Topics, worker_id: str, model_id: str) -> None:
        self._topics, self._worker_id, self._model_id = topics, worker_id, model_id

    def reject(self, pending: Pending, reason: Reason, message: str) -> None:
        """Decide ``pending``'s outcome: a dead letter for ``reason``."""
        pending.reason = reason
        pending.dead_letter = dead_letter(pending.source, reason, message, self._topics.dead_letter, self._worker_id,
                                          state=pending.state)

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
                                    self._worker_id, truncated=scored.truncated)
        out.scored[record["schema_id"]] += 1
        if len(out.samples) < SAMPLES:
            out.samples.append(record)
        return OutgoingRecord(self._topics.probabilities, pending.source.key, schemas.encode_probability(record))
