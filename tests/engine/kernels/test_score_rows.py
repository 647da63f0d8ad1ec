"""engine.kernels.score_rows (the read-out's softmaxes and label mass in one launch) against
`engine.readout.read_rows`'s PyTorch ops, and a row's bits at any row count. Runs on the GPU; on a CPU through
Triton's interpreter (`TRITON_INTERPRET=1 pytest -m gpu tests/engine/kernels/test_score_rows.py`)."""

import pytest
import torch

from tests.engine.kernels.triton_device import require

ON_GPU, DEV = require()

from engine.kernels.score_rows import score_rows  # noqa: E402
from engine.prompt import MAX_OPTIONS  # noqa: E402
from engine.readout import MASS, PROBABILITIES, RAW, read_rows  # noqa: E402

pytestmark = pytest.mark.gpu


def _inputs(rows: int, seed: int, dtype=torch.bfloat16):
    """Labels' logits near the vocabulary's log-sum-exp (large shares, so a sum can round above 1), temperatures,
    biases on about half the rows, 2..MAX_OPTIONS options a row."""
    g = torch.Generator().manual_seed(seed)
    lse = torch.randn(rows, generator=g) * 3 + 8
    z = (lse[:, None] + torch.randn(rows, MAX_OPTIONS, generator=g) * 2 - 3).to(dtype)
    inv_temp = torch.rand(rows, 1, generator=g) + 0.5
    bias = torch.randn(rows, MAX_OPTIONS, generator=g) * (torch.rand(rows, 1, generator=g) > 0.5)
    n_options = torch.randint(2, MAX_OPTIONS + 1, (rows,), generator=g)
    mask = torch.arange(MAX_OPTIONS)[None, :] < n_options[:, None]
    return [t.to(DEV) for t in (z, inv_temp, bias, mask, lse)]


def _torch_rows(z, inv_temp, bias, mask, lse):
    """The read-out's PyTorch ops on the same logits (the identity as the norm and the labels' projection)."""
    return read_rows(z, lambda x: x, None, inv_temp, bias, mask, linear=lambda x, w: x,
                     vocab_lse=(lambda normed: lse) if lse is not None else None)


@pytest.mark.parametrize("rows", [1, 10, 129])
def test_score_rows_agrees_with_the_torch_read_out(rows):
    """Probabilities to float32 rounding, every option a question lacks exactly 0, each distribution summing to 1; the
    label mass to float32 rounding, a share above 1 clamped to exactly 1, a NaN logit's NaN kept."""
    z, inv_temp, bias, mask, lse = _inputs(rows, seed=rows)
    z[0, 0] = (lse[0] + 0.5).to(z.dtype)                                     # a share above 1: clamped
    if rows > 2:
        z[2, 1] = float("nan")
    got, want = score_rows(z, inv_temp, bias, mask, lse), _torch_rows(z, inv_temp, bias, mask, lse)
    ok = ~got[:, MASS].isnan()
    for cols in (PROBABILITIES, RAW):
        torch.testing.assert_close(got[ok, cols], want[ok, cols], rtol=2e-6, atol=1e-7)
        assert (got[ok, cols][~mask[ok]] == 0).all()
        torch.testing.assert_close(got[ok, cols].sum(-1), torch.ones(int(ok.sum()), device=DEV), rtol=0, atol=1e-6)
    torch.testing.assert_close(got[:, MASS], want[:, MASS], rtol=2e-6, atol=1e-7, equal_nan=True)
    assert got[0, MASS] == 1.0
    assert torch.equal(got[:, MASS].isnan(), want[:, MASS].isnan()) and int((~ok).sum()) == (rows > 2)


def test_without_the_vocabulary_the_mass_is_nan_and_a_zero_bias_gives_the_raw_bits():
    z, inv_temp, bias, mask, _ = _inputs(37, seed=3, dtype=torch.float32)
    got = score_rows(z, inv_temp, torch.zeros_like(bias), mask, None)
    assert got[:, MASS].isnan().all()
    assert torch.equal(got[:, PROBABILITIES], got[:, RAW])
    torch.testing.assert_close(got[:, RAW], _torch_rows(z, inv_temp, bias, mask, None)[:, RAW], rtol=2e-6, atol=1e-7)


def test_a_row_has_its_bits_at_any_row_count_and_position():
    """One thread a row, its columns in one order: a row scored alone, among 10 and among 300 rows (three programs)
    gives the same bits, including as a strided view of wider logits."""
    z, inv_temp, bias, mask, lse = _inputs(300, seed=7)
    everything = score_rows(z, inv_temp, bias, mask, lse)
    for at in (0, 5, 131, 299):
        alone = score_rows(z[at:at + 1], inv_temp[at:at + 1], bias[at:at + 1], mask[at:at + 1], lse[at:at + 1])
        assert torch.equal(alone[0], everything[at]), at
    start = 290
    ten = score_rows(z[start:], inv_temp[start:], bias[start:], mask[start:], lse[start:])
    assert torch.equal(ten, everything[start:])
    wide = torch.cat([z, z], -1)[:, :MAX_OPTIONS]
    assert not wide.is_contiguous()
    assert torch.equal(score_rows(wide, inv_temp, bias, mask, lse), everything)
