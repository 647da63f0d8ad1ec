"""engine.kernels.cuda_deterministic's small matmul tile for few rows: used only where it gives the large tile's bits,
so a row does not depend on its launch's row count whichever tile runs.

Runs on the GPU (`pytest -m gpu`), where it is the real check: whether two tile shapes add a BK step's products in the
same order is the MMA instructions' business. On a CPU through Triton's interpreter, which checks the kernels'
addressing and masking (its dot is numpy's): `TRITON_INTERPRET=1 pytest -m gpu tests/engine/kernels/test_small_tile.py`
with triton installed and fla not. bfloat16 only on the GPU: the large tile's float32 operands exceed the H200's shared
memory (the engine's float32 CUDA path runs cuBLAS, not this kernel).
"""
import random

import pytest
import torch

from tests.engine.kernels.triton_device import require

ON_GPU, DEV = require()

from engine.kernels import cuda_deterministic as bi  # noqa: E402
from engine.kernels import blocked_linear as blocked  # noqa: E402

pytestmark = pytest.mark.gpu
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
# the 0.8B model's down projection on the GPU; a ragged small shape on the interpreter
N, K = (1024, 3584) if ON_GPU else (80, 192)


def _rows_and_weight(M: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(M, K, generator=g) * 3).to(DEV, DTYPE), (torch.randn(N, K, generator=g) / K ** 0.5).to(DEV, DTYPE)


# in the interpreter both tiles are the host BLAS's matmul, which need not sum a tile of another shape in the same
# order (OpenBLAS on an AMD EPYC did not); on the GPU the answer is the hardware's
INTERPRETED_TILES_DIFFER = "the interpreter's tl.dot (numpy's matmul) summed the two tile shapes in different orders"


def test_the_small_tile_check_reports_the_devices_answer():
    """On the GPU the check is the hardware's answer (printed; the H200 gave the large tile's bits for the down
    projection: bench/probes/mlp_probe.py); in the interpreter it is the host BLAS's."""
    weight = _rows_and_weight(1)[1]
    small = bi.small_tile_config(N, K)
    same = bi.small_tile_is_identical(weight, [1, 37, 184, bi.SMALL_TILE_ROWS - 1], small)
    print(f"{DTYPE} {N}x{K}: small tile {small} identical to {bi.matmul_config(N, K)}: {same}")
    if not ON_GPU and not same:
        pytest.skip(INTERPRETED_TILES_DIFFER)
    assert small is not None


class NoFloor(bi.InvariantLinear):
    """No cuBLAS floor to try: every shape runs blocked or in Triton (the CPU's F.linear passes the floor check)."""
    MIN_ROWS = ()


@pytest.mark.parametrize("kind", ["as-checked", "triton-only", "blocked"])
def test_invariant_linear_gives_a_row_the_same_bits_at_every_row_count(kind, monkeypatch):
    """A probe's rows at a random position among random neighbours, at row counts on both sides of the small tile's
    limit and of the blocks' size, get the bits they get alone, whichever kernel and tile the checks chose (blocked:
    cuBLAS in blocks of `BLOCK_ROWS` rows, where its check holds)."""
    rows, weight = _rows_and_weight(bi.SMALL_TILE_ROWS + 300, seed=1)
    counts = [16, 184, 1000, bi.SMALL_TILE_ROWS - 1, bi.SMALL_TILE_ROWS + 300]
    linear = (bi.InvariantLinear if kind == "as-checked" else NoFloor)([weight], counts)
    if kind == "triton-only":
        monkeypatch.setattr(bi, "BLOCKED_CUBLAS", False)
    if kind != "as-checked":
        assert linear.triton == {(N, K)}
    if kind == "blocked" and not linear.blocked:
        pytest.skip(f"cuBLAS's batched GEMM in blocks of {blocked.BLOCK_ROWS} rows is not batch-invariant here "
                    f"({DEV}): the Triton matmul runs the shape")
    print(f"{DTYPE}: floors {linear.floors}, blocked {linear.blocked}, Triton {linear.triton}, "
          f"small tile {linear.small}")
    probe = rows[:16].clone()
    ref = linear(probe, weight)
    positions = random.Random(0)
    for M in counts[1:]:
        at = positions.randrange(M - 15)
        block = rows[:M].clone()
        block[at:at + 16] = probe
        got = linear(block, weight)[at:at + 16]
        # in the interpreter the host BLAS may sum a tile differently by its rows' content and count (float32 ulps)
        assert torch.equal(got, ref) if ON_GPU else torch.allclose(got, ref, rtol=1e-5, atol=1e-5), M


def test_blocked_linear_is_the_projection_in_blocks_of_a_fixed_row_count():
    """`blocked_linear`: whole blocks in one batched GEMM, the last partial block zero-padded, or read in place where
    the storage runs on (views of the first M rows of a longer tensor) (row counts below, at and past one block, with
    and without a partial block, rows of a strided view), against F.linear; and its check's answer on this device
    (printed: on the GPU cuBLAS's, for the down projection)."""
    rows, weight = _rows_and_weight(3 * blocked.BLOCK_ROWS + 45, seed=2)
    tol = dict(rtol=1e-5, atol=1e-5) if DTYPE == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for M in (16, blocked.BLOCK_ROWS, blocked.BLOCK_ROWS + 1, 3 * blocked.BLOCK_ROWS + 45):
        got = blocked.blocked_linear(rows[:M].view(1, M, K), weight)
        assert got.shape == (1, M, N)
        torch.testing.assert_close(got[0], torch.nn.functional.linear(rows[:M], weight), **tol)
    wide = torch.cat([rows, rows], -1)[:, :K]                                  # rows of stride 2K
    torch.testing.assert_close(blocked.blocked_linear(wide, weight), torch.nn.functional.linear(rows, weight), **tol)
    print(f"{DTYPE} {N}x{K}: blocked cuBLAS invariant: "
          f"{blocked.blocked_is_invariant(weight, [16, 184, 1000, 5888 if ON_GPU else 700])}")
