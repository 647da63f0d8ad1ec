"""docker-compose.yml wires what DESIGN.md asks: a KRaft Kafka whose transaction log works on one node, a
Schema Registry, a topic-creation step before any worker, one worker per GPU (own GPU, own stable worker id,
the model mounted, registry-framed output, metrics served beyond localhost), Prometheus scraping every worker,
and Grafana provisioned with a dashboard whose every query names metrics and labels the worker exports."""

from __future__ import annotations

import json
import re

import yaml
from prometheus_client.metrics import MetricWrapperBase

from tests.worker.conftest import REPO

DEPLOY = REPO / "deploy"


def compose_services() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]


def option(command: list[str], name: str) -> str:
    assert name in command, f"{name} missing from {command}"
    return command[command.index(name) + 1]


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
        assert worker["command"][:2] == ["decider", "worker"]
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


def test_workers_write_registry_framed_output_and_serve_metrics():
    services = compose_services()
    registry = services["schema-registry"]
    assert registry["image"].startswith("confluentinc/cp-schema-registry:")
    assert registry["environment"]["SCHEMA_REGISTRY_KAFKASTORE_BOOTSTRAP_SERVERS"] == "PLAINTEXT://kafka:19092"
    assert registry["depends_on"]["kafka"]["condition"] == "service_healthy"
    for name in (n for n in services if n.startswith("worker-")):
        command = services[name]["command"]
        assert option(command, "--output-format") == "avro-registry"
        assert option(command, "--schema-registry-url") == "http://schema-registry:8081"
        assert option(command, "--metrics-host") == "0.0.0.0", "Prometheus scrapes from another container"
        assert services[name]["depends_on"]["schema-registry"]["condition"] == "service_healthy"


def test_prometheus_scrapes_every_worker_on_its_metrics_port():
    services = compose_services()
    prometheus = services["prometheus"]
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]
    config = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    workers = {f"{name}:{option(s['command'], '--metrics-port')}" for name, s in services.items() if name.startswith("worker-")}
    assert targets == workers


def test_grafana_provisions_the_prometheus_source_and_the_dashboard():
    services = compose_services()
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in services["grafana"]["volumes"])
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    datasources = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"]
    assert datasources[0]["type"] == "prometheus" and datasources[0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/decider.yml").read_text())["providers"][0]
    assert mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    assert (DEPLOY / "grafana/dashboards/decider.json").is_file()


def exported_metrics() -> dict[str, set[str]]:
    """Every series name worker/ops/metrics.py exports, with the labels it carries."""
    from worker.ops import metrics

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    series: dict[str, set[str]] = {}
    for metric in vars(metrics).values():
        if isinstance(metric, MetricWrapperBase):
            for suffix in suffixes[metric._type]:
                series[metric._name + suffix] = set(metric._labelnames) | ({"le"} if suffix == "_bucket" else set())
    return series


def test_every_dashboard_panel_queries_exported_metrics_and_labels():
    dashboard = json.loads((DEPLOY / "grafana/dashboards/decider.json").read_text())
    series = exported_metrics()
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("throughput", "lag per partition", "batch size", "engine", "commit", "dead letters by reason",
                  "label mass per schema"):
        assert topic in titles, f"the dashboard lacks a {topic} panel"
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            names = re.findall(r"\bdecider_[a-z_]+", expr)
            assert names, f"{panel['title']}: {expr} queries no decider metric"
            for name in names:
                assert name in series, f"{panel['title']}: {name} is not exported by worker/ops/metrics.py"
            labels = set(series[names[0]])
            for group in re.findall(r"by \(([^)]*)\)", expr):
                used = {label.strip() for label in group.split(",")}
                assert used <= labels, f"{panel['title']}: {expr} groups by {used - labels}, which {names[0]} lacks"
            for legend_label in re.findall(r"{{(\w+)}}", target.get("legendFormat", "")):
                assert legend_label in labels, f"{panel['title']}: legend names {legend_label}"
