"""A secured cluster's librdkafka settings ([kafka] in the config file) reach every client the worker creates,
decider's own exactly-once settings stay in force, and secrets never reach a log line or an error message.
(No SASL/SSL broker is available here: the configuration of every client the worker builds is checked, and real
librdkafka clients are built from them, which validates every setting, the CA file included.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient

from tests.worker.conftest import REPO
from worker.config import WorkerConfig
from worker.config_file import REDACTED, load_config_file, redact, redact_text
from worker.devbroker.processes import free_port
from worker.kafka_clients import (base_config, reader_consumer_config, replay_consumer_config, transactional_producer_config,
                                  worker_consumer_config)

PASSWORD = "s3cr3t-Hunter2-do-not-log"
CA = Path(__file__).parent / "data" / "test-ca.pem"  # a self-signed CA certificate (its key was never kept)
SECURED = f"""
bootstrap = "127.0.0.1:{{port}}"
[worker]
worker_id = "secure-1"
[kafka]
"security.protocol" = "SASL_SSL"
"sasl.mechanism" = "SCRAM-SHA-512"
"sasl.username" = "decider"
"sasl.password" = "{PASSWORD}"
"ssl.ca.location" = "{CA}"
"ssl.endpoint.identification.algorithm" = "https"
"""


@pytest.fixture
def secured_file(tmp_path) -> Path:
    path = tmp_path / "secured.toml"
    path.write_text(SECURED.replace("{port}", str(free_port())))
    return path


def test_every_worker_client_gets_the_security_settings(secured_file):
    from typer.main import get_command

    from worker.cli.app import app

    settings = load_config_file(secured_file, get_command(app)).kafka
    config = WorkerConfig(bootstrap="b:9093", model_dir="m", worker_id="secure-1", kafka=settings)
    # Every client a worker or a replay creates: its consumer, its transactional producer, the admin client, the schema reader.
    configs = {"consumer": worker_consumer_config(config), "replay_consumer": replay_consumer_config(config),
               "transactional_producer": transactional_producer_config(config),
               "admin": base_config(config.cluster), "schema_reader": reader_consumer_config(config.cluster)}
    for role, client_config in configs.items():
        for key, value in settings.items():
            assert client_config[key] == value, (role, key)
        assert client_config["bootstrap.servers"] == "b:9093"
    # decider's own settings are not displaced by the pass-through.
    assert configs["consumer"]["isolation.level"] == "read_committed"
    assert configs["consumer"]["enable.auto.commit"] is False
    assert configs["transactional_producer"]["transactional.id"] == "decider.decider.secure-1"
    # librdkafka accepts each configuration as built (it validates every property at construction).
    Consumer(configs["consumer"]).close()
    Consumer(configs["replay_consumer"]).close()
    Consumer(configs["schema_reader"]).close()
    Producer(configs["transactional_producer"]).flush(0)
    AdminClient(configs["admin"])


def test_secrets_are_redacted():
    settings = {"sasl.username": "u", "sasl.password": PASSWORD, "ssl.key.password": "k", "sasl.jaas.config": "j",
                "sasl.oauthbearer.client.secret": "c", "ssl.key.pem": "PEM", "ssl.ca.location": "/ca"}
    shown = redact(settings)
    assert shown["sasl.username"] == "u" and shown["ssl.ca.location"] == "/ca"
    assert all(shown[k] == REDACTED for k in ("sasl.password", "ssl.key.password", "sasl.jaas.config",
                                               "sasl.oauthbearer.client.secret", "ssl.key.pem"))
    assert redact_text(f"auth failed for password {PASSWORD}", settings) == f"auth failed for password {REDACTED}"


def test_worker_logs_its_settings_without_the_password(secured_file, model_dir):
    # The broker port has nothing listening: the worker logs its client settings, then fails to connect (exit 4).
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DECIDER_")}
    result = subprocess.run([sys.executable, "-m", "worker", "--config", str(secured_file), "worker", "--model", str(model_dir),
                             "--log-format", "json"], capture_output=True, text=True, timeout=60, cwd=REPO, env=clean)
    output = result.stdout + result.stderr
    assert result.returncode == 4, output
    assert "kafka client settings from the config file" in output and "SCRAM-SHA-512" in output
    assert REDACTED in output
    assert PASSWORD not in output


def test_a_fetch_wait_from_the_kafka_table_reaches_every_consumer(tmp_path):
    """decider's fetch waits are defaults: a key it does not own, set in [kafka], wins (it was silently overridden)."""
    from typer.main import get_command

    from worker.cli.app import app

    path = tmp_path / "waits.toml"
    path.write_text('bootstrap = "b:9092"\n[kafka]\n"fetch.wait.max.ms" = 250\n')
    settings = load_config_file(path, get_command(app)).kafka
    config = WorkerConfig(bootstrap="b:9092", model_dir="m", worker_id="w", kafka=settings)
    for role, client_config in {"consumer": worker_consumer_config(config), "replay_consumer": replay_consumer_config(config),
                                "reader": reader_consumer_config(config.cluster)}.items():
        assert client_config["fetch.wait.max.ms"] == 250, role
    assert worker_consumer_config(WorkerConfig(bootstrap="b:9092", model_dir="m", worker_id="w"))["fetch.wait.max.ms"] == 20


def test_every_client_keeps_librdkafkas_nagle_setting_unless_the_kafka_table_sets_it(tmp_path):
    """No client sets `socket.nagle.disable` itself (TCP_NODELAY everywhere raised the p99 on Apache Kafka: runs EG and
    EH in bench/README.md); a [kafka] setting reaches every client."""
    from typer.main import get_command

    from worker.cli.app import app

    def clients(config: WorkerConfig) -> dict:
        return {"consumer": worker_consumer_config(config), "replay_consumer": replay_consumer_config(config),
                "transactional_producer": transactional_producer_config(config), "admin": base_config(config.cluster),
                "reader": reader_consumer_config(config.cluster)}

    for role, client_config in clients(WorkerConfig(bootstrap="b:9092", model_dir="m", worker_id="w")).items():
        assert "socket.nagle.disable" not in client_config, role
    path = tmp_path / "nagle.toml"
    path.write_text('bootstrap = "b:9092"\n[kafka]\n"socket.nagle.disable" = true\n')
    settings = load_config_file(path, get_command(app)).kafka
    for role, client_config in clients(WorkerConfig(bootstrap="b:9092", model_dir="m", worker_id="w", kafka=settings)).items():
        assert client_config["socket.nagle.disable"] is True, role
