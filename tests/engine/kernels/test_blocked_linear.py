"""engine.kernels.blocked_linear on the CPU: a partial last block's padding read in place where its input's storage runs
on to a whole block (the deterministic table's SwiGLU writes such storage), the same numbers as a zero-padded copy, and
nothing of the padding reaching a real row. (Whether cuBLAS sums a row in the same order in every batched GEMM is the
GPU's question: tests/engine/kernels/test_small_tile.py.)"""
import pytest
import torch

from engine.kernels import blocked_linear as blocked

K, N, ROWS = 48, 40, 16


def _padded_rows(M: int, seed: int = 0) -> torch.Tensor:
    """M random rows in `block_padded` storage whose padding holds NaN (what uninitialised memory may hold)."""
    x = blocked.block_padded(torch.Size([M, K]), torch.float32, torch.device("cpu"), rows=ROWS)
    storage = torch.tensor([], dtype=torch.float32).set_(x.untyped_storage())     # the whole storage, flat
    storage.fill_(float("nan"))
    x.copy_(torch.randn(M, K, generator=torch.Generator().manual_seed(seed)))
    assert storage[M * K:].isnan().all() and storage.numel() > M * K or M % ROWS == 0
    return x


def test_block_padded_storage_runs_on_to_a_whole_block():
    for M, blocks in ((1, 1), (ROWS, 1), (ROWS + 1, 2), (3 * ROWS - 5, 3)):
        x = blocked.block_padded(torch.Size([1, M, K]), torch.bfloat16, torch.device("cpu"), rows=ROWS)
        assert x.shape == (1, M, K) and x.is_contiguous()
        assert x.untyped_storage().nbytes() == blocks * ROWS * K * 2


@pytest.mark.parametrize("M", [5, ROWS, ROWS + 3, 3 * ROWS - 1])
def test_padding_read_in_place_gives_the_zero_padded_result(M, monkeypatch):
    x = _padded_rows(M)
    weight = torch.randn(N, K, generator=torch.Generator().manual_seed(1))
    in_place = blocked.blocked_linear(x, weight, rows=ROWS)
    monkeypatch.setattr(blocked, "PADDING_IN_PLACE", False)
    copied = blocked.blocked_linear(x, weight, rows=ROWS)
    assert in_place.shape == copied.shape == (M, N)
    assert torch.isfinite(in_place).all(), "the NaN padding reached a real row"
    torch.testing.assert_close(in_place, copied, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(in_place, torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_a_producer_writes_into_block_padded_storage_unless_switched_off(monkeypatch):
    def product(a, b, out=None):
        return torch.mul(a, b, out=out) if out is not None else a * b

    a, b = torch.randn(2, 9, K), torch.randn(2, 9, K)
    padded = blocked.block_padded_output(product)(a, b)
    assert torch.equal(padded, a * b)
    assert padded.untyped_storage().nbytes() == blocked.BLOCK_ROWS * K * 4       # 18 rows, one block of 256
    monkeypatch.setattr(blocked, "PADDING_IN_PLACE", False)
    assert blocked.block_padded_output(product)(a, b).untyped_storage().nbytes() == 18 * K * 4
