"""What scoring returns: per state its calibrated probabilities, the raw ones where a bias changed them, and the
label mass (`engine.label_mass`), as tensors (`Scores`) or plain Python (`StateScores`, from `PendingScores`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
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
            # numpy views of the steps' host tensors, no torch op: one here could start a second OpenMP team in this
            # thread. Only the columns a state's records carry become Python floats (4 of a row's 53 at 4 options).
            chunks = [chunk.numpy() for chunk in self._chunks]
            table = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
            layouts: dict[int, _Layout] = {}
            self._details, at = [], 0
            for h in self._schemas:
                layout = layouts.get(id(h))
                if layout is None:
                    layout = layouts[id(h)] = _Layout(h)
                self._details.append(layout.scores(table[at:at + layout.answers]))
                at += layout.answers
            self._chunks = []
        return self._details


class _Layout:
    """Where one schema's scores sit in a state's read-out rows (`engine.readout.SCORE_COLUMNS` each, one per question,
    in question order)."""

    def __init__(self, h) -> None:
        self.n_options, self.calibrated, self.label_mass = list(h.n_options), list(h.calibrated), bool(h.label_mass)
        self.answers = len(self.n_options)
        self.width = self.n_options[0] if len(set(self.n_options)) == 1 else None   # every question as wide
        self.raw = any(self.calibrated)

    def scores(self, rows: np.ndarray) -> StateScores:
        """A state's `StateScores` from its [questions, SCORE_COLUMNS] rows."""
        if self.width is not None:
            probabilities = rows[:, PROBABILITIES][:, :self.width].tolist()
        else:
            probabilities = [row[:n].tolist() for row, n in zip(rows[:, PROBABILITIES], self.n_options)]
        raw = None
        if self.raw:
            raw = [row[:n].tolist() if changed else None
                   for row, n, changed in zip(rows[:, RAW], self.n_options, self.calibrated)]
        mass = rows[:, MASS].tolist() if self.label_mass else None
        return StateScores(probabilities, raw, mass)
