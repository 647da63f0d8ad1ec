"""Temperature scaling (Guo et al., 2017) of published probabilities against labelled answers, and the figures that
judge it: log-loss, expected calibration error (ECE, equal-width bins of the top probability) and the Brier score.

Plain Python on plain lists: a question's distributions and labels are a few thousand numbers, and ``decider calibrate
--method temperature`` needs neither torch nor a model. Re-tempering a published distribution p by t gives
softmax(log p / t); the worker computes softmax((z - bias) / T) from the labels' logits z, so a question published at
temperature T and re-tempered by t is exactly that question at temperature T x t.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Sequence

ECE_BINS = 15
TEMPERATURE_RANGE = (0.05, 20.0)
"""Where the fitted factor is searched (the log-loss is convex in 1/t, so its minimum there is found)."""
HELD_OUT_SHARE = 0.2
_FLOOR = 1e-12


@dataclass(frozen=True)
class Labelled:
    """One labelled answer: the published distribution over a question's options and the option the label names."""
    state_id: str
    probabilities: tuple[float, ...]
    label: int


def tempered(probabilities: Sequence[float], factor: float) -> list[float]:
    """softmax(log p / factor): the distribution re-tempered (factor > 1 flattens it)."""
    logits = [math.log(max(p, _FLOOR)) / factor for p in probabilities]
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    total = sum(weights)
    return [w / total for w in weights]


def log_loss(items: Sequence[Labelled], factor: float = 1.0) -> float:
    """Mean negative log-probability of the labels, the distributions re-tempered by `factor`."""
    return -sum(math.log(max(tempered(i.probabilities, factor)[i.label], _FLOOR)) for i in items) / len(items)


def fit_factor(items: Sequence[Labelled], tolerance: float = 1e-4) -> float:
    """The factor t minimising `log_loss` (golden-section search over log t in `TEMPERATURE_RANGE`)."""
    lo, hi = (math.log(t) for t in TEMPERATURE_RANGE)
    ratio = (math.sqrt(5) - 1) / 2
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = log_loss(items, math.exp(a)), log_loss(items, math.exp(b))
    while hi - lo > tolerance:
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = log_loss(items, math.exp(a))
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = log_loss(items, math.exp(b))
    return math.exp((lo + hi) / 2)


@dataclass(frozen=True)
class ReliabilityBin:
    """One bin of the top probability: its range, how many answers fell in it, their mean confidence and accuracy."""
    low: float
    high: float
    count: int
    confidence: float
    accuracy: float


def reliability(items: Sequence[Labelled], factor: float = 1.0, bins: int = ECE_BINS) -> list[ReliabilityBin]:
    """Answers binned by their top probability (equal-width bins over [0, 1]), each bin's confidence and accuracy."""
    sums = [[0, 0.0, 0] for _ in range(bins)]                       # count, confidence, correct
    for item in items:
        p = tempered(item.probabilities, factor)
        top = max(range(len(p)), key=p.__getitem__)
        at = min(int(p[top] * bins), bins - 1)
        sums[at][0] += 1
        sums[at][1] += p[top]
        sums[at][2] += top == item.label
    return [ReliabilityBin(b / bins, (b + 1) / bins, n, conf / n if n else 0.0, correct / n if n else 0.0)
            for b, (n, conf, correct) in enumerate(sums)]


def ece(items: Sequence[Labelled], factor: float = 1.0, bins: int = ECE_BINS) -> float:
    """Expected calibration error: the bins' |accuracy - confidence| weighted by their share of the answers."""
    return sum(b.count * abs(b.accuracy - b.confidence) for b in reliability(items, factor, bins)) / len(items)


def brier(items: Sequence[Labelled], factor: float = 1.0) -> float:
    """Mean over answers of the squared distance between the distribution and the label's one-hot vector."""
    total = 0.0
    for item in items:
        p = tempered(item.probabilities, factor)
        total += sum((pk - (k == item.label)) ** 2 for k, pk in enumerate(p))
    return total / len(items)


def held_out(state_id: str, question_id: str, share: float = HELD_OUT_SHARE) -> bool:
    """Whether a labelled answer belongs to the held-out part: a hash of its ids, so the split is the same on every
    run and does not follow the order feedback arrived in."""
    digest = hashlib.sha256(f"{state_id}\x00{question_id}".encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share
