"""``decider calibrate --report DIR``: the figures as ``report.json`` and one picture per question.

``--method temperature``: a reliability diagram per question (accuracy against confidence in 15 bins of the top
probability, before and after the fitted temperature, on the held-out answers). ``--method order``: the fitted
position prior per question (a probability per option position: flat means no position bias). matplotlib draws
them off screen (its Agg backend: no display needed).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Sequence

from worker.cli.temperature_fit import ReliabilityBin
from worker.exceptions import ConfigError


def report_dir(path: str | Path) -> Path:
    """``path`` made a directory (with its parents); ``ConfigError`` if it cannot be."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--report {path}: cannot create the directory ({exc.strerror})") from None
    return path


def write_json(directory: Path, report: dict[str, Any]) -> Path:
    """``report.json`` in ``directory``."""
    path = directory / "report.json"
    path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def _file_name(kind: str, question_id: str) -> str:
    return f"{kind}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', question_id)}.png"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    return pyplot


def reliability_diagram(directory: Path, question_id: str, before: Sequence[ReliabilityBin],
                        after: Sequence[ReliabilityBin], temperatures: tuple[float, float]) -> Path:
    """A PNG of the held-out answers' accuracy per confidence bin, before and after: the diagonal is calibrated."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(5, 5))
    width = 1 / len(before)
    for bins, label, offset, color in ((before, f"before (T={temperatures[0]:.3g})", -width / 4, "tab:red"),
                                       (after, f"after (T={temperatures[1]:.3g})", width / 4, "tab:blue")):
        used = [b for b in bins if b.count]
        axes.bar([(b.low + b.high) / 2 + offset for b in used], [b.accuracy for b in used], width=width / 2,
                 color=color, alpha=0.75, label=label)
    axes.plot([0, 1], [0, 1], color="gray", linestyle="--", linewidth=1, label="calibrated")
    axes.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence (top probability)", ylabel="accuracy",
             title=f"{question_id}: held-out answers")
    axes.legend(loc="upper left")
    path = directory / _file_name("reliability", question_id)
    figure.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(figure)
    return path


def position_prior_chart(directory: Path, question_id: str, prior: Sequence[float]) -> Path:
    """A PNG of a question's fitted prior over option positions (exp of the log prior, normalised)."""
    import math

    plt = _pyplot()
    weights = [math.exp(x) for x in prior]
    total = sum(weights)
    figure, axes = plt.subplots(figsize=(5, 3.5))
    positions = [chr(ord("A") + i) for i in range(len(prior))]
    axes.bar(positions, [w / total for w in weights], color="tab:purple", alpha=0.8)
    axes.axhline(1 / len(prior), color="gray", linestyle="--", linewidth=1, label="no position bias")
    axes.set(xlabel="option position", ylabel="prior probability", title=f"{question_id}: position prior (PriDe)")
    axes.legend(loc="upper right")
    path = directory / _file_name("position-prior", question_id)
    figure.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(figure)
    return path
