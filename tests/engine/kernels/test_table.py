"""The kernel table's choice: deterministic scoring on CUDA without flash-linear-attention is refused in one line
naming the fix, never run on a fallback that is not batch-invariant; the fast mode falls back with a warning.

Runs where fla is absent (this CPU machine, CI); the GPU machine runs the same check with fla hidden
(``bench/gpu_session.sh``)."""

from __future__ import annotations

import importlib.util
import logging

import pytest

from engine import KernelsUnavailableError
from engine.kernels.table import select_kernels

pytestmark = pytest.mark.skipif(importlib.util.find_spec("fla") is not None, reason="fla is installed here")


def test_deterministic_on_cuda_without_fla_is_refused_with_the_fix():
    with pytest.raises(KernelsUnavailableError) as refused:
        select_kernels("cuda", deterministic=True)
    message = str(refused.value)
    assert "\n" not in message and "pip install 'decider[gpu]'" in message and "--no-deterministic" in message


def test_fast_on_cuda_without_fla_falls_back_and_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="engine.kernels.table"):
        table = select_kernels("cuda", deterministic=False)
    assert table.name == "torch" and not table.batch_invariant
    assert "flash-linear-attention is not installed" in caplog.text
