"""``--config FILE`` / ``DECIDER_CONFIG``: bad files and unknown keys fail fast (exit 2, one line naming the key),
and one precedence rule holds: flag > environment > file > built-in default."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.worker.conftest import REPO
from worker.config_file import load_config_file, split_config_flag


def _decider(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DECIDER_")}
    return subprocess.run([sys.executable, "-m", "worker", *args], capture_output=True, text=True, timeout=60, cwd=REPO,
                          env={**clean, **(env or {})})


BAD_FILES = [
    ("wat = 1\n", "unknown key 'wat'"),
    ("[worker]\nmax_batchh = 5\n", "unknown key 'max_batchh' in [worker] (did you mean 'max_batch'? known: "),
    ("[wokrer]\nmax_batch = 5\n", "unknown key 'wokrer' (did you mean 'worker'?"),
    ("bootstap = \"k:9092\"\n", "unknown key 'bootstap' (did you mean 'bootstrap'?"),
    ("[topics.craete]\npartitions = 2\n", "unknown key 'craete' in [topics] (did you mean 'create'?"),
    ("[input]\nid-feild = \"ticket.id\"\n", "unknown key 'id-feild' in [input] (did you mean 'id_field'?"),
    ("[worker]\nmax_batch = \"five\"\n", "[worker] max_batch must be an integer, not str 'five'"),
    ("[worker]\nschema_memory_mb = true\n", "[worker] schema_memory_mb must be a number"),
    ("bootstrap = 9092\n", "bootstrap must be a string"),
    ("[worker]\nmax_batch = \n", "invalid TOML"),
    ("[kafka]\n\"transactional.id\" = \"mine\"\n", "[kafka] 'transactional.id' is set by decider"),
    ("[kafka]\n\"isolation.level\" = \"read_uncommitted\"\n", "[kafka] 'isolation.level' is set by decider"),
    ("[kafka]\nsecurity.protocol = \"SSL\"\n", "key 'security' is a table: quote dotted librdkafka names"),
    ("[kafka]\n\"no.such.setting\" = \"x\"\n", "No such configuration property: \"no.such.setting\""),
    ("[kafka]\n\"security.protocol\" = \"CARRIER_PIGEON\"\n", "security.protocol"),
    ("kafka = 3\n", "[kafka] must be a table"),
]


@pytest.mark.parametrize("text, message", BAD_FILES, ids=[m.split("'")[1] if "'" in m else m[:20] for _, m in BAD_FILES])
def test_a_bad_config_file_fails_fast_with_one_line_naming_the_key(tmp_path, text, message):
    path = tmp_path / "decider.toml"
    path.write_text(text)
    result = _decider("--config", str(path), "worker")
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: config {path}: ") and message in lines[0], result.stderr


def test_config_from_the_environment_and_a_missing_file(tmp_path):
    path = tmp_path / "decider.toml"
    path.write_text("[worker]\nmax_batchh = 5\n")
    result = _decider("worker", env={"DECIDER_CONFIG": str(path)})
    assert result.returncode == 2 and "unknown key 'max_batchh' in [worker]" in result.stderr
    result = _decider("--config", str(tmp_path / "nope.toml"), "tail")
    assert result.returncode == 2 and result.stderr.strip() == f"error: config {tmp_path / 'nope.toml'}: no such file"


def test_flag_beats_environment_beats_file_beats_default(tmp_path):
    path = tmp_path / "decider.toml"
    # bootstrap at the top level applies to every command; [worker] holds the worker's own keys.
    path.write_text('bootstrap = "127.0.0.1:1"\n[worker]\nworker-id = "from-file"\nmodel = "/from-file"\n')
    # --model is checked before any broker is contacted: the error names the value that won.
    assert "--model /from-file: no such directory" in _decider("--config", str(path), "worker").stderr
    env = {"DECIDER_MODEL": "/from-env"}
    assert "--model /from-env: no such directory" in _decider("--config", str(path), "worker", env=env).stderr
    flagged = _decider("worker", "--model", "/from-flag", "--config", str(path), env=env)
    assert flagged.returncode == 2 and "--model /from-flag: no such directory" in flagged.stderr
    # Without the file, the required options are missing again (the file was the only source).
    assert _decider("worker", env=env).returncode == 2


def test_the_file_becomes_click_default_map_for_every_command_with_the_option(tmp_path):
    from typer.main import get_command

    from worker.cli.app import app

    path = tmp_path / "decider.toml"
    path.write_text('bootstrap = "k:9092"\nstates_topic = "s"\n[worker]\nmax_batch = 64\n[topics.create]\npartitions = 12\n'
                    '[kafka]\n"security.protocol" = "SSL"\n"ssl.endpoint.identification.algorithm" = "none"\n')
    loaded = load_config_file(path, get_command(app))
    assert loaded.default_map["worker"] == {"bootstrap": "k:9092", "states_topic": "s", "max_batch": 64}
    assert loaded.default_map["topics"]["create"] == {"bootstrap": "k:9092", "states_topic": "s", "partitions": 12}
    assert loaded.default_map["tail"] == {"bootstrap": "k:9092"}
    assert "score" not in loaded.default_map  # no option of decider score is set by this file
    assert loaded.kafka == {"security.protocol": "SSL", "ssl.endpoint.identification.algorithm": "none"}


def test_the_latency_budget_is_a_worker_key_checked_like_its_flag(tmp_path):
    path = tmp_path / "decider.toml"
    path.write_text('bootstrap = "127.0.0.1:1"\n[worker]\nworker-id = "w"\nmodel = "/nope"\nlatency-budget-ms = 0\n')
    result = _decider("--config", str(path), "worker")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "--latency-budget-ms" in lines[0] and "greater than or equal to 1" in lines[0], result.stderr
    path.write_text('[worker]\nlatency-budget-ms = "50ms"\n')
    result = _decider("--config", str(path), "worker")
    assert result.returncode == 2 and "[worker] latency-budget-ms must be an integer" in result.stderr, result.stderr


def test_config_flag_is_taken_out_wherever_it_is():
    assert split_config_flag(["--config", "a.toml", "worker", "-b", "x"], {}) == (Path("a.toml"), ["worker", "-b", "x"])
    assert split_config_flag(["worker", "--config=b.toml"], {"DECIDER_CONFIG": "c.toml"}) == (Path("b.toml"), ["worker"])
    assert split_config_flag(["worker"], {"DECIDER_CONFIG": "c.toml"}) == (Path("c.toml"), ["worker"])
    assert split_config_flag(["worker"], {}) == (None, ["worker"])
