"""``decider replay`` as a user meets it: the range is checked before the model loads and its times are shown as
typed (ISO 8601, not epoch ms); while the progress bar runs, no line per transaction, and one summary at the end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from tests.worker.conftest import QUESTIONS, state_texts


def _replay(stream, model, name: str, *flags: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "worker", "replay", "-b", stream.bootstrap, "--model", str(model), "--name", name,
            "--states-topic", stream.topics.states, "--schemas-topic", stream.topics.schemas,
            "--output-topic", stream.topics.probabilities, "--dead-letter-topic", stream.topics.dead_letter, *flags]
    return subprocess.run(args, capture_output=True, text=True, timeout=180, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr  # nothing loaded, nothing logged first
    return lines[0]


def test_replay_range_is_checked_first_shown_in_iso_and_its_bar_runs_alone(stream, model_dir, tmp_path):
    stream.put_schema("tickets", QUESTIONS)
    stream.produce_states([(f"r-{i}", t) for i, t in enumerate(state_texts(12, seed=31))], "tickets")

    done = _replay(stream, model_dir, "iso", "--from-time", "2026-01-01T00:00:00Z", "--max-batch", "2")
    assert done.returncode == 0, done.stderr
    lines = [line for line in re.split(r"[\r\n]", done.stderr) if line.strip()]
    assert lines[-1].startswith("replay iso: complete; 12 states scored, 0 dead letters in "), lines[-1]
    assert not [line for line in lines if "decider.events: committed" in line], done.stderr  # 6 transactions, no line each
    assert "exempted from garbage collection" not in done.stderr

    # A model directory that cannot load: these errors come before any loading is tried.
    unloadable = tmp_path / "unloadable"
    unloadable.mkdir()
    (unloadable / "config.json").write_text(json.dumps({"model_type": "not-qwen"}))
    changed = _error(_replay(stream, unloadable, "iso", "--from-time", "2026-01-02T00:00:00+00:00"))
    assert ("replay iso was started with --from-time 2026-01-01T00:00:00Z, not --from-time 2026-01-02T00:00:00Z"
            in changed), changed
    inverted = _error(_replay(stream, unloadable, "late", "--from-time", "2100-01-01T00:00:00Z", "--to-offset", "0"))
    assert re.search(r"the range ends \(offset 0, --to-offset 0\) before it starts \(offset \d+, --from-time "
                     r"2100-01-01T00:00:00Z\)", inverted), inverted
    backwards = _error(_replay(stream, unloadable, "back", "--from-time", "2026-02-01T00:00:00Z", "--to-time", "2026-01-01"))
    assert "--to-time 2026-01-01T00:00:00Z is before --from-time 2026-02-01T00:00:00Z" in backwards, backwards
