"""User mistakes on the command line: each one, fed to its command, is one line on stderr saying what is wrong,
exit code 2, and never a traceback. Files are checked before any broker is contacted, so most cases need none
(``-b`` points nowhere).

Most cases run ``worker.cli.app.main`` (the console script's entry point) in this process, which is fast; one case of
each kind also runs as a real ``decider`` subprocess, and so do the cases that configure logging (a worker's
logging setup would outlive the test in this process)."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from confluent_kafka import OFFSET_BEGINNING, TopicPartition

import schemas
from tests.worker.conftest import REPO
from worker.cli import app as cli
from worker.kafka_clients import reader_consumer

NOWHERE = "127.0.0.1:9"  # never contacted: every case fails before
GOOD_LINE = json.dumps({"id": "ok", "state": "fine"})
GOOD_SCHEMA = {"questions": [{"id": "q", "question": "Is it fine?", "options": ["yes", "no"]}]}


@pytest.fixture
def decider(monkeypatch, capsys):
    """Run ``decider ARGS`` in this process through the console script's entry point."""

    def run(*args: str, stdin: bytes = b"", env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            cli.main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, exit_info.value.code, out.encode(), err.encode())

    return run


def decider_process(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    """Run ``decider ARGS`` as a subprocess (what a user's shell does)."""
    return subprocess.run([sys.executable, "-m", "worker", *args], input=stdin, capture_output=True, cwd=REPO, timeout=120)


def assert_one_line_exit_2(result: subprocess.CompletedProcess, *needles: str) -> str:
    stderr = result.stderr.decode(errors="replace")
    assert result.returncode == 2, (result.returncode, stderr)
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def _state_line(**fields) -> str:
    return json.dumps({"id": "s", "state": "text", **fields})


# ---- decider produce ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("second_line, says", [
    (_state_line(event_time="yesterday"), ['"event_time" "yesterday" is not a time', "ISO 8601"]),
    (_state_line(event_time=[1]), ['"event_time" [1] is not a time']),
    (_state_line(event_time=1e30), ['"event_time" 1e+30 is out of range']),
    (_state_line(event_time=True), ['"event_time" true is not a time']),
    (_state_line(event_time=1.5), ["not a whole number"]),
    (_state_line(event_time="2026-13-01T00:00:00Z"), ["is not a time"]),
    ('{"id": "s", "state": "\\ud800 lone"}', ['"state"', "unpaired surrogate"]),
    ('{"id": "\\udfff", "state": "text"}', ['"id"', "unpaired surrogate"]),
    ('{"id": "s", "state": "t", "metadata": {"k": "\\ud800"}}', ['"metadata"', "unpaired surrogate"]),
    (_state_line(evnet_time=0), ["unknown key 'evnet_time'", "did you mean 'event_time'"]),
    ('{"id": "s", "text": "the state"}', ["unknown key 'text'", "did you mean 'state'?", '"metadata"']),
    ('{"state_id": "s", "state": "t"}', ["unknown key 'state_id'", "did you mean 'id'?"]),
    ('{"id": "s", "state": "t", "timestamp": 0}', ["unknown key 'timestamp'", "did you mean 'event_time'?"]),
    ("not json", ["is not JSON"]),
    ('{"id": "s", "state": "unterminated', ["is not JSON: Unterminated string starting at column 22"]),
    ("[" * 100_000, ["is not JSON", "nested too deeply"]),
    ('{"id": 1, "state": "x"}', ['string "id" and "state"']),
])
def test_produce_refuses_a_bad_line_naming_it(decider, second_line, says):
    result = decider("produce", "-b", NOWHERE, "--schema-id", "s", "-", stdin=f"{GOOD_LINE}\n{second_line}\n".encode())
    assert_one_line_exit_2(result, "line 2", *says)


def test_produce_refuses_bytes_that_are_not_utf8_naming_the_line(decider, tmp_path):
    states = tmp_path / "states.jsonl"
    states.write_bytes(f"{GOOD_LINE}\n{GOOD_LINE}\n".encode() + b'{"id": "x", "state": "caf\xe9"}\n')
    assert_one_line_exit_2(decider("produce", "-b", NOWHERE, "--schema-id", "s", str(states)), "line 3", "not UTF-8", "0xe9")


@pytest.mark.parametrize("content", [b"", b"\n  \n"])
def test_a_states_file_without_a_state_warns_and_publishes_nothing(decider, tmp_path, content):
    """Exit 0 (an empty batch is no mistake in a pipeline; --help says so) with a warning, where it was a silent
    "0 states published"; the broker (nowhere here) is not even asked."""
    states = tmp_path / "states.jsonl"
    states.write_bytes(content)
    result = decider("produce", "-b", NOWHERE, "--schema-id", "s", str(states))
    assert result.returncode == 0 and result.stdout == b"", result
    assert result.stderr.decode() == f"warning: states file {states} holds no states (no line that is not blank); nothing published\n"
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (tmp_path / "schema.json").write_text(json.dumps(GOOD_SCHEMA))
    scored = decider("score", "--model", str(model), "--schema", str(tmp_path / "schema.json"), "--states", str(states))
    assert scored.returncode == 0 and scored.stdout == b"", scored
    assert scored.stderr.decode().splitlines() == [f"warning: states file {states} holds no states (no line that is not blank); nothing scored"]


def test_produce_publishes_iso_and_epoch_event_times_and_refuses_a_state_over_the_size_limit(decider, stream_factory):
    stream = stream_factory(partitions=1)
    env = {"DECIDER_STATES_TOPIC": stream.topics.states, "DECIDER_SCHEMAS_TOPIC": stream.topics.schemas}
    stream.put_schema("s", GOOD_SCHEMA)  # produce refuses a schema id the schemas topic does not hold
    lines = [_state_line(id="iso", event_time="2026-01-01T00:00:00Z"), _state_line(id="zone", event_time="2026-01-01T01:00:00+01:00"),
             _state_line(id="epoch", event_time=0), _state_line(id="digits", event_time="1700000000000")]
    published = decider("produce", "-b", stream.bootstrap, "--schema-id", "s", "-", stdin="\n".join(lines).encode(), env=env)
    assert published.returncode == 0, published.stderr
    assert _event_times(stream) == {"iso": 1_767_225_600_000, "zone": 1_767_225_600_000, "epoch": 0, "digits": 1_700_000_000_000}

    huge = _state_line(id="huge", state="x" * 1_000_000)
    too_large = decider("produce", "-b", stream.bootstrap, "--schema-id", "s", "-", stdin=huge.encode(), env=env)
    assert_one_line_exit_2(too_large, "state 'huge'", "over the producer's limit of 1000000 bytes", "message.max.bytes")


def _event_times(stream, expected: int = 4) -> dict[str, int]:
    consumer = reader_consumer(stream.bootstrap)
    consumer.assign([TopicPartition(stream.topics.states, 0, OFFSET_BEGINNING)])
    times: dict[str, int] = {}
    try:
        for _ in range(100):
            for message in consumer.consume(expected, timeout=0.1):
                if message.error() is None:
                    times[message.key().decode()] = schemas.decode_state(message.value())["event_time"]
            if len(times) >= expected:
                break
        return times
    finally:
        consumer.close()


# ---- decider schema put / decider score -------------------------------------------------------------------------
def _schema_with(**question) -> dict:
    return {"questions": [{"id": "q", "question": "Is it fine?", "options": ["yes", "no"], **question}]}


SCHEMA_MISTAKES = [
    ({"questions": [{"id": "q", "question": "Q?", "optoins": ["yes", "no"]}]}, ["unknown key 'optoins'", "did you mean 'options'"]),
    ({"questoins": []}, ["unknown key 'questoins'", "did you mean 'questions'"]),
    ({"questions": [{"id": "q", "question": "Q?", "options": ["a", "b"], "temprature": 1}]}, ["did you mean 'temperature'"]),
    (_schema_with(question="x" * 100_000), ["100000 characters", "at most 2000"]),
    (_schema_with(options=["yes", "n" * 501]), ["option of 501 characters", "at most 500"]),
    ({"questions": [{"id": f"q{i}", "question": "x" * 1990, "options": ["a", "b"]} for i in range(20)]}, ["at most 32000"]),
    (_schema_with(question="Is it \ud800 fine?"), ["unpaired surrogate"]),
    (_schema_with(options=["yes"]), ["has 1 option; 2 to 26"]),
    (_schema_with(options=[f"option {n}" for n in range(27)]), ["27 options; 2 to 26 are allowed"]),
    ({"questions": [{"id": f"q{i}", "question": "Is it fine?", "options": ["yes", "no"]} for i in range(65)]},
     ["65 questions; at most 64 are allowed"]),
]


@pytest.mark.parametrize("document, says", SCHEMA_MISTAKES)
def test_schema_put_refuses_a_bad_schema_file(decider, tmp_path, document, says):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(document))  # json.dumps writes a lone surrogate as its \ud800 escape
    assert_one_line_exit_2(decider("schema", "put", "-b", NOWHERE, "--id", "s", str(path)), *says)


def test_schema_put_refuses_bytes_that_are_not_utf8(decider, tmp_path):
    path = tmp_path / "schema.json"
    path.write_bytes(b'{"questions": [{"id": "q",\n "question": "Caf\xe9?", "options": ["yes", "no"]}]}')
    assert_one_line_exit_2(decider("schema", "put", "-b", NOWHERE, "--id", "s", str(path)), "line 2", "not UTF-8")


@pytest.mark.parametrize("schema_document, states_bytes, says", [
    (GOOD_SCHEMA, b'{"id": "a", "state": "ok"}\n{"id": "b", "state": "\xff"}\n', ["line 2", "not UTF-8"]),
    (GOOD_SCHEMA, b'{"id": "a", "state": "\\ud800"}\n', ["line 1", "unpaired surrogate"]),
    (SCHEMA_MISTAKES[0][0], b'{"id": "a", "state": "ok"}\n', ["did you mean 'options'"]),
])
def test_score_refuses_bad_files_before_loading_a_model(decider, tmp_path, schema_document, states_bytes, says):
    (tmp_path / "schema.json").write_text(json.dumps(schema_document))
    (tmp_path / "states.jsonl").write_bytes(states_bytes)
    result = decider("score", "--model", str(tmp_path / "no-model"), "--schema", str(tmp_path / "schema.json"),
                     "--states", str(tmp_path / "states.jsonl"))
    assert_one_line_exit_2(result, *says)


# ---- options of worker, replay, tail, topics create -----------------------------------------------------------------
def _worker_args(tmp_path: Path, *extra: str) -> list[str]:
    """A worker command line whose model directory passes the check made before anything loads (it has a config.json),
    so that the mistake in ``extra`` is the one met."""
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text("{}")
    return ["worker", "-b", NOWHERE, "--model", str(tmp_path / "model"), "--worker-id", "w", *extra]


@pytest.mark.parametrize("extra, says", [
    (("--metrics-port", "70000"), ["--metrics-port", "65535"]),
    (("--metrics-port", "0"), ["--metrics-port"]),
    (("--log-level", "verbose"), ["--log-level must be debug, info, warning or error, not 'verbose'"]),
    (("--tokenizer-threads", "0"), ["--tokenizer-threads", "greater than or equal to 1"]),
    (("--max-batch", "many"), ["--max-batch", "see decider worker --help"]),
    (("--latency-budget-ms", "0"), ["--latency-budget-ms", "greater than or equal to 1"]),
    (("--latency-budget-ms", "600001"), ["--latency-budget-ms", "less than or equal to 600000"]),
    (("--latency-budget-ms", "-5"), ["--latency-budget-ms", "greater than or equal to 1"]),
    (("--latency-budget-ms", "fast"), ["--latency-budget-ms", "see decider worker --help"]),
])
def test_worker_refuses_bad_options(decider, tmp_path, extra, says):
    assert_one_line_exit_2(decider(*_worker_args(tmp_path, *extra)), *says)


@pytest.mark.parametrize("args, says", [
    (("replay", "-b", NOWHERE, "--model", ".", "--name", "n", "--output-topic", "o", "--metrics-port", "70000"), ["--metrics-port"]),
    (("replay", "-b", NOWHERE, "--model", ".", "--name", "n", "--output-topic", "o", "--log-level", "loud"), ["--log-level"]),
    (("tail", "-b", NOWHERE, "--max", "abc"), ["--max"]),
    (("tail", "-b", NOWHERE, "--timeout", "-1"), ["--timeout"]),
    (("broker", "--port", "70000"), ["--port"]),
    (("demo", "--port", "-1"), ["--port"]),
    (("topics", "create", "-b", NOWHERE, "--partitions", "0"), ["--partitions"]),
    (("no-such-command",), ["No such command"]),
])
def test_other_commands_refuse_bad_options(decider, args, says):
    assert_one_line_exit_2(decider(*args), *says)


def test_metrics_address_mistakes_as_a_user_meets_them(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        taken = decider_process(*_worker_args(tmp_path, "--metrics-port", str(port)))
    assert_one_line_exit_2(taken, f"port {port} is already in use by pid {os.getpid()}", "--metrics-port")
    unknown_host = decider_process(*_worker_args(tmp_path, "--metrics-port", "9400", "--metrics-host", "no-such-host.invalid"))
    assert_one_line_exit_2(unknown_host, "--metrics-host 'no-such-host.invalid'")


def test_one_mistake_of_each_command_as_a_user_meets_it(tmp_path):
    bad_time = f"{GOOD_LINE}\n" + _state_line(event_time="yesterday")
    assert_one_line_exit_2(decider_process("produce", "-b", NOWHERE, "--schema-id", "s", "-", stdin=bad_time.encode()),
                           "line 2", "is not a time")
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA_MISTAKES[0][0]))
    assert_one_line_exit_2(decider_process("schema", "put", "-b", NOWHERE, "--id", "s", str(tmp_path / "schema.json")),
                           "did you mean 'options'")
    (tmp_path / "states.jsonl").write_bytes(b'{"id": "b", "state": "\xff"}\n')
    (tmp_path / "good.json").write_text(json.dumps(GOOD_SCHEMA))
    assert_one_line_exit_2(decider_process("score", "--model", str(tmp_path), "--schema", str(tmp_path / "good.json"),
                                           "--states", str(tmp_path / "states.jsonl")), "line 1", "not UTF-8")
    assert_one_line_exit_2(decider_process(*_worker_args(tmp_path, "--tokenizer-threads", "0")), "--tokenizer-threads")


def test_topics_create_refuses_more_partitions_than_existing_topics_have(decider, kafka_bootstrap, tmp_path):
    prefix = f"parts-{os.getpid()}-{tmp_path.name}"
    env = {"DECIDER_STATES_TOPIC": f"{prefix}.states", "DECIDER_SCHEMAS_TOPIC": f"{prefix}.schemas",
           "DECIDER_PROBABILITIES_TOPIC": f"{prefix}.probabilities", "DECIDER_DEAD_LETTER_TOPIC": f"{prefix}.dead-letter"}
    assert decider("topics", "create", "-b", kafka_bootstrap, "--partitions", "4", env=env).returncode == 0
    again = decider("topics", "create", "-b", kafka_bootstrap, "--partitions", "8", env=env)
    assert_one_line_exit_2(again, "--partitions 8", f"{prefix}.states has 4")
    assert again.stdout.decode().count("exists (4 partitions)") == 3
    default = decider("topics", "create", "-b", kafka_bootstrap, env=env)  # no explicit request: only reported
    assert default.returncode == 0 and "exists (4 partitions)" in default.stdout.decode()


def test_score_refuses_a_schema_whose_prefix_is_over_the_token_limit(decider, model_dir, tmp_path):
    # Within every character limit, but over the prefix-token limit: only the model's tokenizer can tell.
    document = {"questions": [{"id": f"q{i}", "question": "Q? " * 663, "options": ["a", "b"]} for i in range(16)]}
    (tmp_path / "schema.json").write_text(json.dumps(document))
    (tmp_path / "states.jsonl").write_text(GOOD_LINE + "\n")
    result = decider("score", "--model", str(model_dir), "--schema", str(tmp_path / "schema.json"),
                     "--states", str(tmp_path / "states.jsonl"))
    assert_one_line_exit_2(result, "prefix is", "tokens; at most 16384 are allowed")
