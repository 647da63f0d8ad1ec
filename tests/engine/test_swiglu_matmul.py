"""engine.batch_invariant's fused swiglu + down projection and small matmul tile: the same bits as the unfused kernels
and the large tile, and rows that do not depend on their launch's row count.

Runs on the GPU (`pytest -m gpu`), where it is the real check: whether two tile shapes add a BK step's products in the
same order is the MMA instructions' business, and the fused loop's swiglu is a second compilation of the swiglu
kernel's. On a CPU through Triton's interpreter, which checks the kernels' addressing, masking and rounding (its dot
is numpy's): `TRITON_INTERPRET=1 pytest -m gpu tests/engine/test_swiglu_matmul.py` with triton installed and fla not.
"""
import os
import random

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device: run with TRITON_INTERPRET=1 to use Triton's interpreter", allow_module_level=True)

from engine import batch_invariant as bi  # noqa: E402
from engine.triton_kernels import swiglu  # noqa: E402

pytestmark = pytest.mark.gpu
ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
# (rows, N, I): ragged tiles on the interpreter; on the GPU also the 0.8B model's down projection at batch 1 and
# past the small tile's row limit
SHAPES = [(37, 96, 128), (130, 80, 192)] + ([(184, 1024, 3584), (2100, 1024, 3584)] if ON_GPU else [])


def _mlp_inputs(M: int, N: int, I: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused gate|up projection output [M, 2I] and a down projection weight [N, I]."""
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(M, 2 * I, generator=g) * 3).to(DEV, dtype)
    weight = (torch.randn(N, I, generator=g) / I ** 0.5).to(DEV, dtype)
    return gate_up, weight


@pytest.mark.parametrize("tile", ["large", "small"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_matmul_gives_the_bits_of_swiglu_then_matmul(dtype, shape, tile):
    M, N, I = shape
    gate_up, weight = _mlp_inputs(M, N, I, dtype)
    config = bi.small_tile_config(N, I) if tile == "small" else None
    got = bi.swiglu_matmul(gate_up.view(1, M, 2 * I), weight, config)
    gate, up = gate_up.split(I, dim=-1)
    assert got.shape == (1, M, N) and got.dtype == dtype
    assert torch.equal(got[0], bi.matmul(swiglu(gate, up), weight, config))
    if dtype == torch.bfloat16 and not ON_GPU:
        return                  # the interpreter's dot multiplies bf16 operands as their uint16 bit patterns
    # and it is the MLP's down projection: against float32 PyTorch
    want = F.linear(F.silu(gate.float()) * up.float(), weight.float())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got[0].float(), want, atol=tol, rtol=tol)


def test_swiglu_matmul_rejects_a_weight_of_the_wrong_width():
    gate_up, weight = _mlp_inputs(4, 64, 64, torch.float32)
    with pytest.raises(ValueError, match="2 x 48"):
        bi.swiglu_matmul(gate_up, weight[:, :48])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_identity_checks_hold_for_the_tiles_this_device_compiles(dtype):
    """On the interpreter both tiles are numpy's dot, so the checks must pass; on the GPU the small tile's is the
    hardware's answer (printed), and the fused kernel must match the unfused one with the large tile."""
    M, N, I = SHAPES[-1]
    weight = _mlp_inputs(1, N, I, dtype)[1]
    small = bi.small_tile_config(N, I)
    counts = sorted({1, 37, M // 2, M})
    same_tiles = bi.small_tile_is_identical(weight, counts, small)
    print(f"{dtype} {N}x{I}: small tile {small} identical to {bi.matmul_config(N, I)}: {same_tiles}")
    assert bi.swiglu_matmul_is_identical(weight, [bi.matmul_config(N, I)], rows=M)
    if not ON_GPU:
        assert same_tiles and bi.swiglu_matmul_is_identical(weight, [small], rows=M)


class TritonOnly(bi.InvariantLinear):
    """No cuBLAS floor to try: every shape runs in Triton (the CPU's F.linear passes the check)."""
    MIN_ROWS = ()


@pytest.mark.parametrize("kind", [bi.InvariantLinear, TritonOnly], ids=["as-checked", "triton-only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_linear_gives_a_row_the_same_bits_at_every_row_count(dtype, kind):
    """A probe's rows at a random position among random neighbours, at row counts on both sides of the small tile's
    limit: `InvariantLinear` and its `swiglu_linear` give them the bits they get alone, whichever kernels and tiles
    its checks chose, and `swiglu_linear` the bits of swiglu then the linear."""
    N, I = SHAPES[-1][1:]
    gate_up, weight = _mlp_inputs(bi.SMALL_TILE_ROWS + 300, N, I, dtype, seed=1)
    counts = [16, 184, 1000, bi.SMALL_TILE_ROWS - 1, bi.SMALL_TILE_ROWS + 300]
    linear = kind([weight], counts)
    if kind is TritonOnly:
        assert linear.triton == {(N, I)} and linear.fused == {(N, I)}
        assert ON_GPU or (N, I) in linear.small                  # the interpreter's tiles share numpy's dot
    print(f"{dtype}: Triton {linear.triton}, small tile {linear.small}, fused {linear.fused}")
    probe = gate_up[:16].clone()
    act = swiglu(*probe.split(I, dim=-1))
    ref, ref_fused = linear(act, weight), linear.swiglu_linear(probe, weight)
    assert torch.equal(ref_fused, ref)
    positions = random.Random(0)
    for M in counts[1:]:
        at = positions.randrange(M - 15)
        block = gate_up[:M].clone()
        block[at:at + 16] = probe
        assert torch.equal(linear.swiglu_linear(block, weight)[at:at + 16], ref), M
        assert torch.equal(linear(swiglu(*block.split(I, dim=-1)), weight)[at:at + 16], ref), M


@pytest.mark.skipif(not ON_GPU, reason="the CUDA kernel table")
def test_the_deterministic_table_fuses_the_down_projection_only_with_the_same_bits():
    from engine.kernels import select_kernels
    torch.manual_seed(0)
    w_in = (torch.randn(7168, 1024, device=DEV) / 32).to(torch.bfloat16)
    w_down = (torch.randn(1024, 3584, device=DEV) / 60).to(torch.bfloat16)
    table = select_kernels("cuda", True, [w_in, w_down])
    print(table.name)
    if table.mlp_down is None:
        assert (1024, 3584) not in getattr(table.linear, "fused", set()) or table.swiglu is not swiglu
        pytest.skip("the down projection is not fused on this device (see the table's name)")
    for M in (184, 5888):
        x = torch.randn(M, 1024, device=DEV).to(torch.bfloat16)
        gate_up = table.linear(x, w_in)
        unfused = table.linear(table.swiglu(*gate_up.split(3584, dim=-1)), w_down)
        assert torch.equal(table.mlp_down(gate_up, w_down), unfused), M
