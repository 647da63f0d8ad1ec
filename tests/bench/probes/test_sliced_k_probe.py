"""`bench/probes/sliced_k_probe.py`: its two kernels give one summation order at every row count, and its picture draws.

The kernels' test is marked gpu: on a CUDA device it checks the bits the probe's finding rests on; on a CPU through
Triton's interpreter (`TRITON_INTERPRET=1 pytest -m gpu tests/bench/probes/test_sliced_k_probe.py`) their addressing,
masking and slice order (float16 there: the interpreter misreads bfloat16 through a tensor descriptor).
"""
import json
from pathlib import Path

import pytest
import torch

RESULT = Path(__file__).resolve().parents[3] / "bench/results/2026-12-07-nvidia-h100-run-ej-sliced-k.json"


@pytest.mark.gpu
@pytest.mark.parametrize("slices", [1, 2, 4])
def test_split_at_few_rows_gives_sliced_bits_at_many(slices):
    from tests.engine.kernels.triton_device import require

    on_gpu, dev = require()
    from bench.probes import sliced_k_probe as probe

    N, K = (1024, 2048) if on_gpu else (96, 256)
    dtype = torch.bfloat16 if on_gpu else torch.float16
    g = torch.Generator().manual_seed(slices)
    x = torch.randn(300, K, generator=g).to(dev, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dev, dtype)
    # the interpreter's dot is the host BLAS's, whose order may follow the tile's shape: one tile there
    sliced_tile, split_tile = ((128, 128, 64, 8, 4), (64, 64, 64, 4, 4)) if on_gpu else ((32, 32, 32, 4, 2),) * 2
    many = probe.sliced(x, w, slices, sliced_tile)
    torch.testing.assert_close(many.float(), x.float() @ w.float().T, rtol=2e-2, atol=2e-2)
    for rows in (1, 37, 300):
        assert torch.equal(probe.split(x[:rows], w, slices, split_tile), many[:rows])


def test_plot_draws_a_run(tmp_path):
    from bench.probes.sliced_k_probe import plot

    path = plot(json.loads(RESULT.read_text()), tmp_path / "sliced.png")
    assert path.stat().st_size > 10_000
