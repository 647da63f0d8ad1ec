#!/usr/bin/env bash
# Everything a fresh machine needs, in a virtual environment at .venv: the CPU build of PyTorch (never a
# multi-GB CUDA build), then decider with its test tools.  Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
