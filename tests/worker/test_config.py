"""The group protocol settings of a loop's configuration: one protocol, given once, with only the settings it has;
a mistake is one line and exit code 2 before anything connects."""

from __future__ import annotations

import pytest

from tests.worker.test_config_file import _decider
from worker.config import WorkerConfig
from worker.exceptions import ConfigError


def _config(**fields) -> WorkerConfig:
    return WorkerConfig(bootstrap="k:9092", model_dir="m", worker_id="w", **fields)


def test_the_protocol_comes_from_the_option_or_the_kafka_table_and_defaults_to_the_brokers_best():
    assert _config().requested_group_protocol is None
    assert _config(group_protocol="consumer").requested_group_protocol == "consumer"
    assert _config(kafka={"group.protocol": "classic"}).requested_group_protocol == "classic"
    assert _config(group_protocol="classic", kafka={"group.protocol": "classic"}).requested_group_protocol == "classic"


REFUSED = [
    ({"group_protocol": "cooperative"}, "--group-protocol 'cooperative': use classic or consumer"),
    ({"kafka": {"group.protocol": "eager"}}, "[kafka] \"group.protocol\" 'eager': use classic or consumer"),
    ({"group_protocol": "consumer", "kafka": {"group.protocol": "classic"}}, "give the protocol once"),
    ({"group_protocol": "consumer", "session_timeout_ms": 6000}, "the broker sets the session timeout"),
    ({"group_protocol": "consumer", "kafka": {"partition.assignment.strategy": "range"}}, "classic-protocol setting"),
    ({"kafka": {"group.protocol": "consumer", "heartbeat.interval.ms": 500}}, "[kafka] \"heartbeat.interval.ms\""),
]


@pytest.mark.parametrize("fields, message", REFUSED, ids=[m[:30] for _, m in REFUSED])
def test_a_protocol_that_does_not_exist_or_cannot_take_the_settings_given_is_refused(fields, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        _config(**fields)


def test_the_classic_protocol_takes_its_own_settings():
    config = _config(group_protocol="classic", session_timeout_ms=6000,
                     kafka={"partition.assignment.strategy": "range", "heartbeat.interval.ms": 500})
    assert config.session_timeout_ms == 6000


def test_the_command_line_says_what_is_wrong_in_one_line(model_dir):
    for args, message in ((["--group-protocol", "kip848"], "--group-protocol 'kip848': use classic or consumer"),
                          (["--group-protocol", "consumer", "--session-timeout-ms", "6000"], "the broker sets the session")):
        result = _decider("worker", "-b", "localhost:1", "--model", str(model_dir), "--worker-id", "w", *args)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and message in lines[0], result.stderr


@pytest.mark.parametrize("linger_ms", [-1, 10_001])
def test_a_commit_linger_outside_0_to_10_s_is_refused(linger_ms):
    with pytest.raises(ConfigError, match=f"--commit-linger-ms {linger_ms} is out of range: give 0 to 10000 ms"):
        _config(commit_linger_ms=linger_ms)
    assert _config(commit_linger_ms=10_000).commit_linger_ms == 10_000 and _config().commit_linger_ms == 0
