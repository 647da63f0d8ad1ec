"""What scoring returns: per state its calibrated probabilities, the raw ones where a bias changed them, and the
label mass (`engine.label_mass`), as tensors (`Scores`) or plain Python (`StateScores`, from `PendingScores`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from engine.readout import MASS, PROBABILITIES, RAW


class Scores(NamedTuple):
    """One state's scores as tensors (`SchemaEngine.score_details`)."""
    probabilities: torch.Tensor        # [n_questions, MAX_OPTIONS] float32: calibrated where the schema says so
    raw_probabilities: torch.Tensor    # [n_questions, MAX_OPTIONS]: before the option bias (equal where it is 0)
    label_mass: torch.Tensor           # [n_questions]: NaN where the schema does not ask for it


@dataclass
class StateScores:
    """One state's scores as plain Python, per question of its schema (`PendingScores.details`)."""
    probabilities: list[list[float]]                    # per question, its options' probabilities
    raw_probabilities: list[list[float] | None] | None  # before calibration, for the questions it changed; None: none
    label_mass: list[float] | None                      # per question; None: the schema does not ask for it


class PendingScores:
    """A batch launched by `SchemaEngine.launch_mixed`: `result()` waits for the device and returns the batch's
    probabilities; `details()` its `StateScores`.

    Reading does no device work but wait for an event, so any thread may do it (the worker's collector thread does,
    while its GPU thread launches the next batch). `schemas`: each state's prepared schema (its `n_options`,
    `calibrated` questions and `label_mass`)."""

    def __init__(self, schemas: Sequence, chunks: list[torch.Tensor], event: torch.cuda.Event | None) -> None:
        self._schemas, self._chunks, self._event = list(schemas), chunks, event
        self._device = torch.cuda.current_device() if event is not None else None
        self._details: list[StateScores] | None = None

    def result(self) -> list[list[list[float]]]:
        """Per state, per question of its schema, the probabilities of that question's options (waits for the
        device)."""
        return [state.probabilities for state in self.details()]

    def details(self) -> list[StateScores]:
        """Per state its `StateScores` (waits for the device)."""
        if self._details is None:
            if self._event is not None:
                with torch.cuda.device(self._device):
                    self._event.synchronize()
            # tolist() per step, no torch.cat: a CPU op here could start a second OpenMP team in this thread
            answers = (answer for chunk in self._chunks for answer in chunk.tolist())
            self._details = [_state_scores(h, [next(answers) for _ in h.n_options]) for h in self._schemas]
            self._chunks = []
        return self._details


def _state_scores(h, rows: list[list[float]]) -> StateScores:
    """A state's `StateScores` from its read-out rows (`engine.readout.SCORE_COLUMNS` each, in question order)."""
    probabilities = [row[PROBABILITIES][:n] for row, n in zip(rows, h.n_options)]
    raw = None
    if any(h.calibrated):
        raw = [row[RAW][:n] if changed else None for row, n, changed in zip(rows, h.n_options, h.calibrated)]
    mass = [row[MASS] for row in rows] if h.label_mass else None
    return StateScores(probabilities, raw, mass)
