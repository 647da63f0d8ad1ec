"""docker-compose.yml wires what DESIGN.md asks: a KRaft Kafka whose transaction log works on one node,
a topic-creation step before any worker, one worker per GPU (own GPU, own stable worker id), the model mounted."""

from __future__ import annotations

import yaml

from tests.worker.conftest import REPO


def test_compose_file_matches_the_deployment_contract():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    kafka = services["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    env = kafka["environment"]
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert str(env["KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"]) == "1"
    assert str(env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"]) == "1"
    assert services["topics"]["command"][:3] == ["decider", "topics", "create"]

    workers = {name: s for name, s in services.items() if name.startswith("worker-")}
    assert len(workers) >= 2
    gpus, ids = [], []
    for name, worker in workers.items():
        assert worker["command"] == ["decider", "worker"]
        assert worker["depends_on"]["topics"]["condition"] == "service_completed_successfully"
        assert worker["environment"]["DECIDER_DEVICE"] == "cuda"
        # scraped from other containers: the metrics server must listen beyond the container's loopback
        assert worker["environment"]["DECIDER_METRICS_HOST"] == "0.0.0.0" and worker["environment"]["DECIDER_METRICS_PORT"]
        assert any(v.endswith(":/models/model:ro") for v in worker["volumes"])
        devices = worker["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"] and len(devices[0]["device_ids"]) == 1
        gpus.append(devices[0]["device_ids"][0])
        ids.append(worker["environment"]["DECIDER_WORKER_ID"])
    assert len(set(gpus)) == len(gpus) and len(set(ids)) == len(ids), "one GPU and one stable id per worker"
    assert (REPO / "Dockerfile").is_file()
