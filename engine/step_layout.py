"""A scoring step's rows and the one staging buffer their inputs travel to the device in (`StepLayout`)."""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import NamedTuple, Sequence

import numpy as np
import torch

from engine.prompt import MAX_OPTIONS


class Row(NamedTuple):
    """One row of a step: a suffix continuing one prefix, and the answers read from it."""
    prefix_slot: int
    ids: Sequence[int]
    answers: list[int]                 # positions in `ids` whose next-token distribution answers a question
    inv_temps: list[float]             # per answer
    n_options: list[int]               # per answer
    biases: np.ndarray | None = None   # [answers, MAX_OPTIONS] float32 option biases (calibration); None: all 0
    label_mass: bool = False           # whether its answers' label mass is wanted


@dataclass(frozen=True)
class StepLayout:
    """Where a step's inputs sit in its one int64 staging buffer: the ids [R, T]; per row its prefix slot; per answer
    its position in the flattened ids and its option count; per row its first answer's index and its answer count;
    then float32 values two to an element: the answers' inverse temperatures [A], then their option biases
    [A, MAX_OPTIONS].

    One buffer because a step then costs the GPU thread one pinned allocation and one copy, straight into the graph's
    static buffer: every torch call releases the GIL, and taking it back behind the worker loop's threads can cost a
    switch interval each."""
    R: int      # rows
    T: int      # tokens a row
    A: int      # answer slots: R x the answers a row may hold

    @property
    def _ints(self) -> int:
        return self.R * self.T

    @property
    def _temps(self) -> int:
        return self._ints + 3 * self.R + 2 * self.A

    @property
    def _floats(self) -> int:
        return self.A * (1 + MAX_OPTIONS)

    @property
    def size(self) -> int:
        """Elements of the buffer."""
        return self._temps + (self._floats + 1) // 2

    def stage(self, rows: Sequence[Row], pad: int, pin: bool) -> torch.Tensor:
        """The buffer of these rows (at most R; rows past them are padding that continues row 0's prefix, since a free
        slot's prefix has no keys at all), in pinned memory when `pin`."""
        # the GPU thread runs this between a cycle's close and its launch: the small sections go in as one list each
        # (a numpy call costs ~1-2 us whatever it writes, and np.cumsum ~9 us on a list of a handful)
        staged = torch.empty(self.size, dtype=torch.int64, pin_memory=pin)
        buf = staged.numpy()
        R, A, T, n = self.R, self.A, self.T, len(rows)
        ids = buf[:self._ints].reshape(R, T)
        ids.fill(pad)
        for i, r in enumerate(rows):
            ids[i, :len(r.ids)] = r.ids
        flat = [i * T + p for i, r in enumerate(rows) for p in r.answers]
        counts = [len(r.answers) for r in rows]
        unused_answers, unused_rows = A - len(flat), [0] * (R - n)
        slots = [r.prefix_slot for r in rows]
        buf[self._ints:self._temps] = (slots + [slots[0]] * (R - n)
                                       + flat + [0] * unused_answers
                                       + [k for r in rows for k in r.n_options] + [MAX_OPTIONS] * unused_answers
                                       + list(accumulate(counts, initial=0))[:n] + unused_rows
                                       + counts + unused_rows)
        floats = buf[self._temps:].view(np.float32)
        floats[:A] = [t for r in rows for t in r.inv_temps] + [1.0] * unused_answers
        biases = floats[A:self._floats].reshape(A, MAX_OPTIONS)
        biases.fill(0.0)
        at = 0
        for r in rows:
            if r.biases is not None:
                biases[at:at + len(r.answers)] = r.biases
            at += len(r.answers)
        return staged

    def unstage(self, staged: torch.Tensor):
        """(ids [R, T], prefix slots [R], answer positions [A], option counts [A], (first answer [R], answers [R]),
        inverse temperatures [A], option biases [A, MAX_OPTIONS]): views of the buffer `stage` filled (on the device,
        inside the step)."""
        R, A = self.R, self.A
        ints = staged[self._ints:self._temps]
        floats = staged[self._temps:].view(torch.float32)
        return (staged[:self._ints].view(R, self.T), ints[:R], ints[R:R + A], ints[R + A:R + 2 * A],
                (ints[R + 2 * A:2 * R + 2 * A], ints[2 * R + 2 * A:]), floats[:A],
                floats[A:self._floats].view(A, MAX_OPTIONS))
