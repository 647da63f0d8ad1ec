"""engine.kernels.vocab_logsumexp: the label mass's full-vocabulary log-sum-exp in one GEMM kernel (the logits reduced
in its epilogue, never written), then one kernel combining each row's vocabulary blocks.

It is torch's log-sum-exp of the float32 logits (columns past the valid vocabulary ignored), and a row's result is the
same bits alone, among other rows at any row count and at any position (one tile at every row count, no split over
K). Runs on the GPU (`pytest -m gpu`); on a CPU through Triton's interpreter, whose dot is numpy's (float32 only:
the interpreter's bfloat16 dot is not): `TRITON_INTERPRET=1 pytest -m gpu tests/engine/kernels/test_vocab_logsumexp.py`
with triton installed and fla not. The whole engine's label mass with it on CUDA:
tests/engine/test_gpu_label_mass.py."""
import random

import pytest
import torch

from tests.engine.kernels.triton_device import require

ON_GPU, DEV = require()

from engine.kernels import vocab_logsumexp as vl  # noqa: E402

pytestmark = pytest.mark.gpu
DTYPES = [torch.float32, torch.bfloat16] if ON_GPU else [torch.float32]
V, K = 1000, 128            # V a multiple of neither BN (256, 128) nor 16: a ragged last block and a padded table


def _inputs(S: int, dtype: torch.dtype, seed: int = 0, V: int = V, exact: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random rows and weight, giving logits of std ~4 (a model's). exact: multiples of 1/4 and 1/8 in -3/4..3/4 and
    -3/8..3/8 (logits of std ~1.4), whose dot products are exact in float32 whatever order they are summed in."""
    g = torch.Generator().manual_seed(seed)
    if exact:
        return (torch.randint(-3, 4, (S, K), generator=g) / 4).to(DEV, dtype), \
            (torch.randint(-3, 4, (V, K), generator=g) / 8).to(DEV, dtype)
    x = torch.randn(S, K, generator=g).to(DEV, dtype)
    w = (torch.randn(V, K, generator=g) * (4 / K ** 0.5)).to(DEV, dtype)
    return x, w


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(x.double() @ w.double().T, -1).float()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("S", [1, 37, 130])
def test_it_is_torchs_logsumexp_of_the_float32_logits(S, dtype):
    x, w = _inputs(S, dtype, seed=S)
    got = vl.vocab_logsumexp(x, w)
    assert got.shape == (S,) and got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), _reference(x, w).cpu(), rtol=1e-5, atol=1e-5)


def test_vocabulary_rows_past_n_valid_are_ignored():
    """The padded rows of a weight (here values that would dominate) add nothing."""
    x, w = _inputs(20, torch.float32, seed=1, V=1024)
    w[900:] = 10.0
    torch.testing.assert_close(vl.vocab_logsumexp(x, w, 900).cpu(), _reference(x, w[:900]).cpu(), rtol=1e-5,
                               atol=1e-5)


def test_another_tile_computes_the_same_values(monkeypatch):
    """`CONFIG` is read at each call (`bench/probes/variant_ab.py` times other tiles): a smaller one agrees to
    rounding."""
    x, w = _inputs(37, DTYPES[-1], seed=2)
    default = vl.vocab_logsumexp(x, w)
    monkeypatch.setattr(vl, "CONFIG", (64, 128, 4, 4))
    assert vl.vocab_config(V, K)[:2] == (64, 128)
    torch.testing.assert_close(vl.vocab_logsumexp(x, w), default, rtol=1e-5, atol=1e-5)


def test_the_tile_is_a_function_of_the_weight_alone():
    assert vl.vocab_config(248_320, 1024) == (*vl.CONFIG[:2], 64, *vl.CONFIG[2:])
    assert vl.vocab_config(248_320, 1024, itemsize=4)[2] == 32          # float32: 3 stages fit in shared memory
    assert vl.vocab_config(1000, 48)[2] == 16
    with pytest.raises(ValueError):
        vl.vocab_config(1000, 40)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_row_gets_the_same_bits_alone_and_among_any_rows_at_any_position(dtype):
    """What the batch-invariant table relies on: probe rows alone, then placed among random neighbours at row counts
    below, at and across the 128-row block (and inside the second block), give the same bits. In the interpreter the
    dot is the host BLAS's, which sums a row of a tile in an order that depends on its position in the tile (OpenBLAS's
    Haswell kernels did), so there the data are exact in any order: what is checked is the kernels' own part (tiles,
    masks, the epilogue's reductions, the combine), the dot's on the GPU."""
    probe, w = _inputs(3, dtype, seed=3, exact=not ON_GPU)
    alone = torch.cat([vl.vocab_logsumexp(probe[i:i + 1], w) for i in range(3)])
    positions = random.Random(4)
    for S in (3, 17, 128, 131, 300):
        block, _ = _inputs(S, dtype, seed=S + 10, exact=not ON_GPU)
        for at in {0, S - 3, positions.randrange(S - 2)}:
            block[at:at + 3] = probe
            assert torch.equal(vl.vocab_logsumexp(block, w)[at:at + 3], alone), (S, at)
    assert torch.equal(vl.vocab_logsumexp(torch.cat([probe] * 50), w), alone.repeat(50))


def test_no_rows_give_an_empty_result():
    x, w = _inputs(0, torch.float32)
    assert vl.vocab_logsumexp(x, w).shape == (0,)
