"""The input mapping and output format options of worker and replay: flags, environment and the config file's
``[input]`` and ``[schema_registry]`` tables reach the loop's configuration; mistakes are one line, exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
import typer

from tests.worker.conftest import REPO
from worker.cli import app as cli
from worker.config_file import INPUT_KEYS, load_config_file
from worker.exceptions import ConfigError
from worker.formats.input_mapping import InputMapping

ROOT = typer.main.get_command(cli.app)


def write(tmp_path, text: str):
    path = tmp_path / "decider.toml"
    path.write_text(text)
    return path


def test_input_keys_are_the_mapping_options_of_worker_and_replay():
    fields = {"format" if k == "input_format" else k for k in INPUT_KEYS}
    assert fields == set(InputMapping.__dataclass_fields__)
    for command in ("worker", "replay"):
        names = {p.name for p in ROOT.commands[command].params}
        assert set(INPUT_KEYS) | {"output_format", "schema_registry_url", "auto_register"} <= names


def test_the_input_table_becomes_defaults_of_worker_and_replay_only(tmp_path):
    config = load_config_file(write(tmp_path, '''
[input]
input-format = "json"
text_template = "Subject: {ticket.subject}\\n\\n{ticket.body}"
metadata_fields = ["ticket.priority", "customer.tier"]
schema_id = "support"
[worker]
schema_id = "from-worker-table"
[schema_registry]
"basic.auth.user.info" = "decider:hunter2"
'''), ROOT)
    worker, replay = config.default_map["worker"], config.default_map["replay"]
    assert worker["metadata_fields"] == replay["metadata_fields"] == "ticket.priority,customer.tier"
    assert replay["text_template"] == "Subject: {ticket.subject}\n\n{ticket.body}"  # TOML's escapes, applied once
    assert (worker["schema_id"], replay["schema_id"]) == ("from-worker-table", "support")  # a command's table wins
    assert "schema_id" not in config.default_map.get("produce", {})  # produce's --schema-id is another option
    assert config.schema_registry == {"basic.auth.user.info": "decider:hunter2"}


@pytest.mark.parametrize("text, message", [
    ('[input]\ntext_feild = "a"\n', "unknown key 'text_feild' in [input]"),
    ('[input]\nmetadata_fields = [1]\n', "[input] metadata_fields must be a list of strings"),
    ('[input]\nid_field = 3\n', "[input] id_field must be a string"),
    ('[schema_registry]\nurl = "http://x"\n', "must not set url"),
])
def test_bad_tables_are_one_line_naming_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config_file(write(tmp_path, text), ROOT)


def test_a_shell_template_gets_its_escapes_and_lists_split():
    from worker.cli.options import input_mapping

    flags = {"input_format": "json", "id_field": None, "text_field": None, "text_template": r"{a}\n{b}",
             "schema_id_field": None, "schema_id": "s", "event_time_field": None, "metadata_fields": " a.b, c ",
             "propagate_headers": "traceparent"}

    class Shell:  # what click answers for a value typed on the command line
        @staticmethod
        def get_parameter_source(name):
            return type("Source", (), {"name": "COMMANDLINE"})

    mapping = input_mapping(Shell, flags)
    assert (mapping.text_template, mapping.metadata_fields, mapping.propagate_headers) == ("{a}\n{b}", ("a.b", "c"), ("traceparent",))


def decider(*args: str, config=None) -> subprocess.CompletedProcess:
    extra = ["--config", str(config)] if config else []
    return subprocess.run([sys.executable, "-m", "worker", *extra, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_mistakes_are_one_line_exit_2_before_the_broker_is_contacted(tmp_path):
    base = ["-b", "127.0.0.1:9", "--model", str(tmp_path / "no-model")]
    cases = [
        (["worker", *base, "--worker-id", "w", "--input-format", "json", "--schema-id", "s"], "needs --text-field PATH or --text-template"),
        (["replay", *base, "--name", "r", "--output-topic", "o", "--output-format", "avro-registry"], "--output-format avro-registry needs --schema-registry-url"),
        (["worker", *base, "--worker-id", "w", "--input-format", "xml"], "--input-format must be one of"),
        (["worker", *base, "--worker-id", "w", "--schema-id", "s"], "apply to --input-format json, avro-registry or text"),
    ]
    for args, message in cases:
        result = decider(*args)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
    # The [input] table completes what the flags leave out: the next check (the model directory) is reached.
    config = write(tmp_path, '[input]\ninput_format = "json"\ntext_field = "body"\nschema_id = "s"\n')
    result = decider("worker", *base, "--worker-id", "w", config=config)
    assert result.returncode == 2 and "no such directory" in result.stderr, result.stderr
