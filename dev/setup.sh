#!/usr/bin/env bash
# Everything a fresh machine needs, in a virtual environment at .venv: PyPI's torch 2.13.0 (a CUDA build that also
# runs on the CPU; pip caches it), then decider with its test tools, then the pinned Apache Kafka 4.4 broker's jars
# from Maven Central (kept in ~/.cache/decider/kafka-4.4.0, or $DECIDER_KAFKA_HOME) where Java 17+ and Maven are
# here, and Apicurio Registry 3.3.3 (the tests' Schema Registry, ~/.cache/decider/apicurio-3.3.3) where a Java 21+
# is. Without them the tests run on the embedded broker and the registry test double, which pytest's header says;
# CI never does. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
# torch's CUDA libraries are a few GB from PyPI, and a connection cut mid-file once failed CI after pip's own resumes
# stalled at the same byte: a whole fresh attempt (what pip cached is kept) gets past what resuming could not.
pip_install() {
    local attempt
    for attempt in 1 2 3 4; do
        .venv/bin/python -m pip install -q "$@" && return 0
        echo "dev/setup.sh: pip install $* failed (attempt $attempt of 4)" >&2
        sleep $((attempt * 15))
    done
    return 1
}
python3 -m venv .venv
pip_install --upgrade pip
pip_install "torch==2.13.0"
pip_install -e ".[test]"
if ! .venv/bin/python -m worker.devbroker.apache_kafka fetch; then
    if [ -n "${CI:-}" ]; then
        echo "dev/setup.sh: CI runs the tests on Apache Kafka, which cannot be fetched here (above)" >&2
        exit 1
    fi
    echo "dev/setup.sh: the tests will run on the embedded broker instead" >&2
elif ! .venv/bin/python -c "import sys; from tests.registry_apicurio import registry_java; sys.exit(registry_java() is None)"; then
    [ -n "${CI:-}" ] && { echo "dev/setup.sh: CI runs the registry tests on Apicurio Registry, which needs Java 21+" >&2; exit 1; }
    echo "dev/setup.sh: no Java 21+ for Apicurio Registry: the registry tests will use the in-process test double" >&2
else
    .venv/bin/python -m tests.registry_apicurio fetch
fi
