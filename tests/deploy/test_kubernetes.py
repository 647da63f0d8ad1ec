"""deploy/kubernetes/: every manifest is valid for Kubernetes (kubernetes-validate's schemas, strict: an unknown field
is an error) or, for KEDA's two kinds, for the openAPI schema of KEDA's CRDs vendored in deploy/kubernetes/schemas;
kustomization.yaml lists them all; and the pieces agree with each other and with decider: the config file the pods
assemble loads through decider's own config loader, the worker id is the pod's name, the probes are decider's
endpoints, KEDA watches the group and topic the workers use, and its thresholds follow from the measured rate."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.worker.conftest import REPO

KUBERNETES = REPO / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.33.0"  # any release since the APIs used here went GA validates them the same way
KEDA_SCHEMAS = {kind: KUBERNETES / "schemas" / f"keda-{kind.lower()}-v1alpha1.json"
                for kind in ("ScaledObject", "TriggerAuthentication")}
GPU_STATES_PER_S = 2_000  # one H200, 0.8B-shaped model, 128-token states (bench/README.md)


def _documents() -> dict[str, dict]:
    """Every manifest but the kustomization, by kind (one of each)."""
    found = {}
    for path in sorted(KUBERNETES.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for document in yaml.safe_load_all(path.read_text()):
            assert document["kind"] not in found, f"two {document['kind']}s"
            found[document["kind"] if document["kind"] != "ConfigMap" else document["metadata"]["name"]] = document
    return found


DOCUMENTS = _documents()


@pytest.mark.parametrize("name", sorted(DOCUMENTS))
def test_every_manifest_is_valid_for_its_schema(name):
    document = DOCUMENTS[name]
    if document["apiVersion"].startswith("keda.sh/"):
        schema = json.loads(KEDA_SCHEMAS[document["kind"]].read_text())
        jsonschema.validate(document, schema, cls=jsonschema.Draft7Validator)
    else:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def test_the_schemas_catch_a_wrong_field():
    """The check can fail: a misspelled field of a Kubernetes kind and a wrong type in a KEDA one are refused."""
    pdb = {**DOCUMENTS["PodDisruptionBudget"], "spec": {**DOCUMENTS["PodDisruptionBudget"]["spec"], "maxUnavailabel": 1}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pdb, KUBERNETES_VERSION, strict=True)
    scaled = {**DOCUMENTS["ScaledObject"], "spec": {**DOCUMENTS["ScaledObject"]["spec"], "minReplicaCount": "one"}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(scaled, json.loads(KEDA_SCHEMAS["ScaledObject"].read_text()))


def test_the_kustomization_applies_every_manifest():
    listed = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in KUBERNETES.glob("*.yaml") if p.name != "kustomization.yaml")


def _worker_container() -> dict:
    [container] = DOCUMENTS["StatefulSet"]["spec"]["template"]["spec"]["containers"]
    return container


def test_the_config_file_the_pods_assemble_loads_in_decider(tmp_path):
    """The ConfigMap's decider.toml with the Secret's [kafka] table appended, as the container's command does."""
    import typer

    from worker.cli.app import app
    from worker.config_file import load_config_file

    secret = DOCUMENTS["Secret"]["stringData"]
    path = tmp_path / "decider.toml"
    path.write_text(DOCUMENTS["decider-config"]["data"]["decider.toml"] + secret["kafka.toml"])
    loaded = load_config_file(path, typer.main.get_command(app))
    worker = loaded.default_map["worker"]
    assert worker["metrics_host"] == "0.0.0.0" and worker["device"] == "cuda"
    assert loaded.kafka["sasl.username"] == secret["username"] and loaded.kafka["sasl.password"] == secret["password"]
    assert "cat /etc/decider/decider.toml /etc/decider-kafka/kafka.toml > /tmp/decider.toml" in _worker_container()["args"][0]


def test_each_worker_is_one_gpu_with_the_pods_name_as_its_id_and_decider_s_probes():
    spec = DOCUMENTS["StatefulSet"]["spec"]
    container = _worker_container()
    [worker_id] = [e for e in container["env"] if e["name"] == "DECIDER_WORKER_ID"]
    assert worker_id["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"   # decider-worker-<ordinal>
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    port = DOCUMENTS["decider-config"]["data"]["decider.toml"].split("metrics_port = ")[1].split()[0]
    assert container["ports"][0]["containerPort"] == int(port)
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # SIGTERM drains: longer than a commit that waits out the transaction timeout's half (30 s / 2) twice
    assert spec["template"]["spec"]["terminationGracePeriodSeconds"] >= 60
    labels = spec["selector"]["matchLabels"]
    assert DOCUMENTS["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == labels
    assert DOCUMENTS["Service"]["spec"]["selector"] == labels


def test_keda_scales_the_workers_on_their_group_s_lag_with_thresholds_from_the_gpu_rate():
    scaled = DOCUMENTS["ScaledObject"]["spec"]
    assert scaled["scaleTargetRef"]["kind"] == "StatefulSet" and scaled["scaleTargetRef"]["name"] == "decider-worker"
    config = DOCUMENTS["decider-config"]["data"]["decider.toml"]
    kafka = next(t for t in scaled["triggers"] if t["type"] == "kafka")
    assert f'group = "{kafka["metadata"]["consumerGroup"]}"' in config and kafka["metadata"]["topic"] == "decider.states"
    assert kafka["metadata"]["bootstrapServers"] in config
    assert kafka["authenticationRef"]["name"] == DOCUMENTS["TriggerAuthentication"]["metadata"]["name"]
    seconds_of_one_gpu = int(kafka["metadata"]["lagThreshold"]) / GPU_STATES_PER_S
    assert 5 <= seconds_of_one_gpu <= 30, "a lag threshold worth 5-30 s of one GPU's work"
    rate = next(t for t in scaled["triggers"] if t["type"] == "prometheus")
    assert "decider_states_scored_total" in rate["metadata"]["query"]
    assert 0.6 <= int(rate["metadata"]["threshold"]) / GPU_STATES_PER_S <= 0.9, "each GPU kept 60-90% busy"
    scrape = yaml.safe_load(DOCUMENTS["decider-prometheus-scrape"]["data"]["decider-scrape.yml"])
    assert [job["job_name"] for job in scrape["scrape_configs"]] == ["decider"]
