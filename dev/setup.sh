#!/usr/bin/env bash
# Everything a fresh machine needs, in a virtual environment at .venv: PyPI's torch 2.13.0 (a CUDA build that also
# runs on the CPU; pip caches it), then decider with its test tools, then the pinned Apache Kafka 4.4 broker's jars
# from Maven Central (kept in ~/.cache/decider/kafka-4.4.0, or $DECIDER_KAFKA_HOME) where Java 17+ and Maven are
# here. Without them the tests run on the embedded broker, which pytest's header says; CI never does. Safe to run
# again.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
if ! .venv/bin/python -m worker.devbroker.apache_kafka fetch; then
    if [ -n "${CI:-}" ]; then
        echo "dev/setup.sh: CI runs the tests on Apache Kafka, which cannot be fetched here (above)" >&2
        exit 1
    fi
    echo "dev/setup.sh: the tests will run on the embedded broker instead" >&2
fi
