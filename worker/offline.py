"""`decider score`: score a states file against a schema file with a local model, no Kafka.

For trying a schema and a model before streaming: the same engine, prompt layout and output shape as the worker's
probability records, one JSON line per state on stdout.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import IO, Iterator

from worker.exceptions import ConfigError
from worker.commands import read_state_lines
from worker.records import engine_questions, load_schema_file, question_schema_record


def score_file(model_dir: str, schema_path: str | Path, states_path: str | Path, device: str = "cpu",
               dtype: str | None = None, schema_id: str | None = None, batch_size: int = 32) -> Iterator[dict]:
    """Yield one result per state line: {"state_id", "schema_id", "schema_version", "model_id", "questions":
    [{"id", "options", "probabilities"}], "truncated"} in file order."""
    from engine import Engine, ModelLoadError, SchemaEngine

    if batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, not {batch_size}")
    schema_id = schema_id or Path(schema_path).stem
    schema = question_schema_record(load_schema_file(schema_path), schema_id, version=1)
    states = read_state_lines(states_path, schema_id)
    try:
        eng = Engine.load(model_dir, device=device, dtype=dtype)
    except ModelLoadError as exc:
        raise ConfigError(f"--model: {exc}") from None
    se = SchemaEngine(eng)
    h = se.prepare(engine_questions(schema), independent=schema["mode"] == "independent")
    for start in range(0, len(states), batch_size):
        batch = states[start:start + batch_size]
        rows = [se.tokenize(h, s["state"]) for s in batch]
        for state, row, probs in zip(batch, rows, se.score_lists(h, rows)):
            yield {"state_id": state["state_id"], "schema_id": schema_id, "schema_version": schema["version"],
                   "model_id": eng.model_id, "truncated": row.truncated,
                   "questions": [{"id": q["id"], "options": q["options"], "probabilities": p}
                                 for q, p in zip(schema["questions"], probs)]}


def write_scores(results: Iterator[dict], out: IO[str], err: IO[str] = sys.stderr) -> int:
    """Print each result as a JSON line; a summary goes to `err`.  -> the count."""
    from worker.commands import json_line

    t, n = time.perf_counter(), 0
    for n, result in enumerate(results, 1):
        out.write(json_line(result) + "\n")
        out.flush()
    dt = time.perf_counter() - t
    err.write(f"scored {n} states in {dt:.1f} s ({n / dt if dt else 0:.1f} states/s)\n")
    return n
