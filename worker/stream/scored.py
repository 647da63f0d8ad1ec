"""What the scorer reports back: a state's outcome (``ScoredState``) and when its cycle was launched (``LaunchTimes``)."""

from __future__ import annotations

from dataclasses import dataclass

from worker.formats.records import Reason


@dataclass
class ScoredState:
    """Outcome for one state: probabilities (per question, per option; with the raw ones where calibration changed
    them, and the label mass per question where the schema asks for it), or a dead-letter reason and message."""

    probabilities: list[list[float]] | None = None
    raw_probabilities: list[list[float] | None] | None = None
    label_mass: list[float] | None = None
    truncated: bool = False
    reason: Reason | None = None  # set when scoring did not happen
    error: str | None = None
    fingerprint: dict[str, str] | None = None  # the scoring fingerprint (``engine.fingerprint``) of its schema version


@dataclass(frozen=True)
class LaunchTimes:
    """When the GPU thread took a cycle, had its tokenized states (the tokenizer pool may still have been on them)
    and had its batch queued on the device, in ``time.monotonic()`` seconds; and the CUDA graphs its launch captured on
    the scoring path (``bench/tail_causes.py`` charges its time to them); and when the last of the tokenizer jobs its
    states came from was submitted and was done (None: no state came from one), which tell a wait for the tokenizers
    from one for the GIL after them; and the GPU thread's own CPU seconds from taking the cycle to its launch (the
    rest of that time it waited: for the tokenizers, for the GIL between its calls into torch, or for a core)."""

    taken_at: float
    gathered_at: float
    launched_at: float
    captures: int = 0
    tokenize_submitted_at: float | None = None
    tokenized_at: float | None = None
    cpu_s: float | None = None
