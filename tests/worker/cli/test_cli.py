"""The ``decider`` command line as users run it: help text, env-var defaults, and one-line errors (no
tracebacks) for an unreachable broker, a missing topic, a bad model path and a bad schema file."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.worker.conftest import REPO, SCHEMA_FILE
from worker.devbroker.processes import free_port


def decider(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "worker", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("command", [[], ["demo"], ["broker"], ["topics", "create"], ["schema", "put"], ["schema", "delete"],
                                     ["schema", "list"], ["schema", "get"],
                                     ["produce"], ["worker"], ["replay"], ["score"], ["tail"], ["tiny-model"]])
def test_every_command_has_help(command):
    result = decider(*command, "--help")
    assert result.returncode == 0 and "Usage" in result.stdout


@pytest.mark.parametrize("command", ["worker", "replay"])
def test_loop_help_reads_at_80_columns(command):
    """~40 options in panels; at 80 columns nothing is cut (an environment variable name in full, no "…"), and the
    descriptions get a column of their own wide enough to read (typer's tables had left them ~15 characters)."""
    from worker.cli.app import app
    from worker.cli.options import PANELS
    import typer

    result = decider(command, "--help", env={"COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "…" not in result.stdout and max(map(len, lines)) <= 80
    assert len(lines) < 220, len(lines)  # 408 before
    for panel in PANELS:
        assert f"{panel}:" in lines, panel
    flat = " ".join(line.strip() for line in lines)
    params = typer.main.get_command(app).commands[command].params
    for param in params:
        if param.envvar:
            assert f"env var: {param.envvar}" in flat or f"var: {param.envvar}" in flat, param.envvar
    # the description column: where the help text of "--bootstrap" starts, and how wide its lines run
    start = next(line for line in lines if line.lstrip().startswith("-b, --bootstrap")).index("Kafka bootstrap servers")
    assert start <= 36 and 80 - start >= 44, start


def test_loop_help_uses_the_terminal_width_and_puts_every_option_in_its_section():
    """click wraps at 80 columns whatever the terminal: 192 lines of `worker --help` in any window. It now takes the
    terminal's width (COLUMNS here), and --stall-after-s stands in Operations, not above the sections."""
    narrow = decider("worker", "--help", env={"COLUMNS": "80"}).stdout.splitlines()
    wide = decider("worker", "--help", env={"COLUMNS": "120"}).stdout.splitlines()
    assert 100 < max(map(len, wide)) <= 120 and len(wide) < 0.7 * len(narrow), (len(wide), len(narrow))
    options, operations = wide[wide.index("Options:"):wide.index("Kafka:")], wide[wide.index("Operations:"):]
    assert [line.split()[0] for line in options if line.lstrip().startswith("-")] == ["--help"], options
    assert any(line.lstrip().startswith("--stall-after-s") for line in operations), operations


@pytest.mark.parametrize("command", [[], ["schema"], ["produce"], ["score"], ["tail"], ["worker"], ["replay"], ["demo"]])
def test_help_gives_no_type_to_a_flag(command):
    """A flag (--help, --json, --deterministic/--no-deterministic) takes no value: no "<bool>" beside it."""
    result = decider(*command, "--help")
    assert result.returncode == 0 and "Usage" in result.stdout, result.stderr
    assert "<bool>" not in result.stdout and "--help " in result.stdout, result.stdout


def test_unreachable_broker_is_one_clear_line():
    result = decider("topics", "create", "-b", f"127.0.0.1:{free_port()}")
    assert result.returncode == 4
    assert result.stderr.startswith("error: no Kafka broker answered at 127.0.0.1:")
    assert "Traceback" not in result.stderr + result.stdout


def test_missing_topic_names_the_fix(kafka_bootstrap):
    result = decider("produce", "-b", kafka_bootstrap, "--schema-id", "x", "--states-topic", "no-such-topic",
                     str(REPO / "worker" / "examples" / "support_states.jsonl"))
    assert result.returncode == 4
    assert "no-such-topic" in result.stderr and "decider topics create" in result.stderr
    assert "Traceback" not in result.stderr


def test_tail_of_a_missing_topic_says_typo_and_gives_the_flags(kafka_bootstrap):
    """`topics create -b B` alone would create the default topics and leave the same error: the fix names the topic."""
    result = decider("tail", "-b", kafka_bootstrap, "--probabilities-topic", "nosuch.topic", "--timeout", "1")
    assert result.returncode == 4 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert "nosuch.topic do not exist" in result.stderr and "a typo?" in result.stderr, result.stderr
    assert result.stderr.rstrip().endswith(f"decider topics create -b {kafka_bootstrap} --probabilities-topic nosuch.topic")
    dead = decider("tail", "-b", kafka_bootstrap, "--topic", "dead-letter", "--dead-letter-topic", "decider.dead-leter")
    assert dead.stderr.rstrip().endswith("--dead-letter-topic decider.dead-leter"), dead.stderr


@pytest.mark.parametrize("command", [["worker", "--worker-id", "w"], ["replay", "--name", "r", "--output-topic", "out"]])
def test_a_loop_error_is_told_once(kafka_bootstrap, model_dir, command):
    """One "error:" line, not an ERROR log line with the same message before it; under --log-format json one JSON
    event instead (for log shippers), and no plain line among the JSON ones."""
    flags = [*command, "-b", kafka_bootstrap, "--model", str(model_dir), "--states-topic", "nosuch.states"]
    human = decider(*flags)
    assert human.returncode == 4, human.stderr
    assert human.stderr.startswith("error: topic(s) nosuch.states") and human.stderr.count("\n") == 1, human.stderr
    machine = decider(*flags, "--log-format", "json")
    assert machine.returncode == 4, machine.stderr
    events = [json.loads(line) for line in machine.stderr.splitlines()]
    assert [(e["event"], e["exit_code"]) for e in events if e["level"] == "error"] == [("fatal", 4)], machine.stderr
    assert "nosuch.states" in events[-1]["message"]


def test_bad_model_path_and_non_model_directory(stream, tmp_path):
    flags = ["-b", stream.bootstrap, "--worker-id", "w", "--states-topic", stream.topics.states,
             "--schemas-topic", stream.topics.schemas, "--probabilities-topic", stream.topics.probabilities,
             "--dead-letter-topic", stream.topics.dead_letter]
    missing = decider("worker", "--model", str(tmp_path / "nope"), *flags)
    assert missing.returncode == 2 and "no such directory" in missing.stderr, missing.stderr
    empty = tmp_path / "empty-model"
    empty.mkdir()
    not_a_model = decider("worker", "--model", str(empty), *flags, timeout=120)
    assert not_a_model.returncode == 2, not_a_model.stderr
    assert "cannot load the model from" in not_a_model.stderr and "Traceback" not in not_a_model.stderr


def test_worker_on_cuda_without_cuda_suggests_cpu(stream, model_dir):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = decider("worker", "-b", stream.bootstrap, "--model", str(model_dir), "--device", "cuda:0", "--worker-id", "w",
                     "--states-topic", stream.topics.states, "--schemas-topic", stream.topics.schemas,
                     "--probabilities-topic", stream.topics.probabilities, "--dead-letter-topic", stream.topics.dead_letter,
                     timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "error: --device cuda:0: CUDA is not available" in result.stderr and "use --device cpu" in result.stderr


def test_bad_schema_file_is_rejected_before_publishing(kafka_bootstrap, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"questions": [{"id": "q", "question": "Q?", "options": ["only one"]}]}))
    result = decider("schema", "put", "-b", kafka_bootstrap, "--id", "x", str(bad))
    assert result.returncode == 2 and "has 1 option; 2 to 26 are allowed" in result.stderr


def test_topics_schema_produce_tail_through_env_vars(kafka_bootstrap, tmp_path):
    suffix = tmp_path.name[-12:].replace("_", "-")
    env = {"DECIDER_BOOTSTRAP": kafka_bootstrap, "DECIDER_STATES_TOPIC": f"cli-{suffix}.states",
           "DECIDER_SCHEMAS_TOPIC": f"cli-{suffix}.schemas", "DECIDER_PROBABILITIES_TOPIC": f"cli-{suffix}.probabilities",
           "DECIDER_DEAD_LETTER_TOPIC": f"cli-{suffix}.dead-letter"}
    created = decider("topics", "create", "--partitions", "2", env=env)
    assert created.returncode == 0 and created.stdout.count("created") == 4, created.stderr
    again = decider("topics", "create", env=env)
    assert again.returncode == 0 and again.stdout.count("exists") == 4
    assert "version 1 published" in decider("schema", "put", "--id", "support", str(SCHEMA_FILE), env=env).stdout
    same = decider("schema", "put", "--id", "support", str(SCHEMA_FILE), env=env)
    assert same.returncode == 0 and same.stdout.startswith("schema support unchanged, version 1"), same.stdout + same.stderr
    produced = decider("produce", "--schema-id", "support", str(REPO / "worker" / "examples" / "support_states.jsonl"), env=env)
    assert produced.returncode == 0 and "20 states published" in produced.stdout
    assert decider("schema", "delete", "--id", "support", env=env).returncode == 0
    tail = decider("tail", "--json", "--from-beginning", "--timeout", "1", env=env)
    assert tail.returncode == 0 and tail.stdout == ""  # no worker ran: nothing committed to the output


def test_demo_runs_the_whole_pipeline_and_stops_everything():
    result = decider("demo", "--show", "1", timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for expected in ("embedded Kafka broker", "decider.schemas created", "schema support v1 prepared",
                     "batch committed", "read back 20 committed records", "angry", "worker stopped"):
        assert expected in out, out


def test_tiny_model_writes_a_model_directory_quietly_and_refuses_a_used_one(model_dir, tmp_path):
    """What the README's Stream section starts with: the demo's model, written where the user says (it lived only in
    the demo's temporary directory), without transformers' "Writing model shards" progress bar."""
    written = decider("tiny-model", str(tmp_path / "tiny"), timeout=120)
    assert written.returncode == 0 and written.stderr == "", written.stderr
    assert written.stdout.strip().endswith(f"use it with --model {tmp_path / 'tiny'}"), written.stdout
    assert {p.name for p in (tmp_path / "tiny").iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert (tmp_path / "tiny" / "config.json").read_text() == (model_dir / "config.json").read_text()  # seed 0 both
    again = decider("tiny-model", str(tmp_path / "tiny"))
    assert again.returncode == 2 and again.stderr == f"error: {tmp_path / 'tiny'} is not empty; give a new or empty directory for the tiny model\n"


def test_bad_warmup_state_tokens_exit_2_naming_the_option(tmp_path):
    flags = ["-b", "127.0.0.1:1", "--worker-id", "w", "--model", str(tmp_path)]
    for value, says in (("128,abc", "expected comma-separated whole numbers"), ("128,0", "at least 1 token")):
        result = decider("worker", *flags, "--warmup-state-tokens", value)
        assert result.returncode == 2 and "--warmup-state-tokens" in result.stderr and says in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
