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
from worker.ops.wording import counted
from worker.formats.records import engine_options, engine_questions, question_schema_record
from worker.cli.options import check_model_dir
from worker.cli.user_files import load_schema_file, no_states_warning, read_state_lines


def score_file(model_dir: str, schema_path: str | Path, states_path: str | Path, device: str = "cpu",
               dtype: str | None = None, schema_id: str | None = None, batch_size: int = 32,
               deterministic: bool | None = None) -> Iterator[dict]:
    """Read both files, load the model and prepare the schema now; return an iterator that scores the states,
    one result per state line in file order: {"state_id", "schema_id", "schema_version", "model_id",
    "questions": [{"id", "options", "probabilities", "label_mass", "raw_probabilities"}], "truncated"} (the label mass
    null where the schema turns it off, the raw probabilities null where calibration changed nothing)."""
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, not {batch_size}")
    schema_id = schema_id or Path(schema_path).stem
    schema = question_schema_record(load_schema_file(schema_path), schema_id, version=1)
    states = read_state_lines(states_path, schema_id)
    if not states:  # nothing to load the model for (its directory is still checked: a mistake there is one too)
        check_model_dir(model_dir)
        sys.stderr.write(no_states_warning(states_path, "nothing scored") + "\n")
        return iter(())
    se = load_schema_engine(model_dir, device, dtype, deterministic)
    from engine import InputError
    try:
        h = se.prepare(engine_questions(schema), **engine_options(schema))
    except InputError as exc:  # what only the model's tokenizer can tell, such as the prefix's length in tokens
        raise ConfigError(f"schema file {schema_path}: {exc}") from None
    return _scores(se, h, se.e.model_id, schema, states, batch_size)


def load_schema_engine(model_dir: str, device: str = "cpu", dtype: str | None = None,
                       deterministic: bool | None = None):
    """A ``SchemaEngine`` on the model in ``model_dir`` (loaded in this thread); ``ConfigError`` with the engine's
    reason when the directory or the device cannot serve."""
    check_model_dir(model_dir)  # before importing torch, which alone takes seconds
    from engine import DeviceUnavailableError, Engine, KernelsUnavailableError, ModelLoadError, SchemaEngine  # torch: once the flags are good
    try:
        eng = Engine.load(model_dir, device=device, dtype=dtype, deterministic=deterministic)
    except DeviceUnavailableError as exc:
        raise ConfigError.device_unavailable(device, exc.reason) from None
    except ModelLoadError as exc:
        raise ConfigError(f"--model: {exc}") from None
    try:
        return SchemaEngine(eng)  # builds the forward, and with it the kernel table
    except KernelsUnavailableError as exc:
        raise ConfigError(str(exc)) from None


def _scores(se, h, model_id: str, schema: dict, states: list[dict], batch_size: int) -> Iterator[dict]:
    for start in range(0, len(states), batch_size):
        batch = states[start:start + batch_size]
        rows = [se.tokenize(h, s["state"]) for s in batch]
        for state, row, scores in zip(batch, rows, se.launch_mixed([(h, r) for r in rows]).details()):
            masses = scores.label_mass or [None] * len(scores.probabilities)
            raws = scores.raw_probabilities or [None] * len(scores.probabilities)
            yield {"state_id": state["state_id"], "schema_id": schema["schema_id"], "schema_version": schema["version"],
                   "model_id": model_id, "truncated": row.truncated,
                   "questions": [{"id": q["id"], "options": q["options"], "probabilities": p, "label_mass": m,
                                  "raw_probabilities": r}
                                 for q, p, m, r in zip(schema["questions"], scores.probabilities, masses, raws)]}


def write_scores(results: Iterator[dict], out: IO[str], err: IO[str] = sys.stderr) -> int:
    """Print each result as a JSON line; a summary goes to `err` (its rate counts scoring only: pass an iterator
    whose model is already loaded, as ``score_file`` returns).  -> the count."""
    from worker.cli.commands import json_line

    t, n = time.perf_counter(), 0
    for n, result in enumerate(results, 1):
        out.write(json_line(result) + "\n")
        out.flush()
    dt = time.perf_counter() - t
    if n == 0:
        return 0  # score_file warned
    err.write(f"scored {counted(n, 'state')} in {dt:.1f} s ({n / dt if dt else 0:.1f} states/s; loading the model not counted)\n")
    return n
