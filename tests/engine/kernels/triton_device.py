"""Where the Triton kernel tests run: on a CUDA device, or on the CPU through Triton's interpreter
(``TRITON_INTERPRET=1``); anywhere else a test module calling ``require()`` at import is skipped. And what the kernel
test modules share: inputs on that device, and how two tile shapes' results compare there."""
import os

import pytest
import torch


def require() -> tuple[bool, str]:
    """Skip the calling module unless triton is installed and a CUDA device or the interpreter can run its kernels;
    returns (on the GPU, the device to allocate on)."""
    pytest.importorskip("triton")
    on_gpu = torch.cuda.is_available()
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA device: run with TRITON_INTERPRET=1 to use Triton's interpreter", allow_module_level=True)
    return on_gpu, "cuda" if on_gpu else "cpu"


def fused_pieces(tokens, widths, dtype, seed=0):
    """Pieces of one fused projection output [tokens, sum(widths)]: strided views, as the forward sees them, on the
    device `require()` gives."""
    g = torch.Generator().manual_seed(seed)
    full = (torch.randn(tokens, sum(widths), generator=g) * 3).to("cuda" if torch.cuda.is_available() else "cpu", dtype)
    return full.split(widths, dim=-1)


def same_across_tiles(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Results of one kernel at two tile shapes. On the GPU: the same bits (each tile sums in the same order). In the
    interpreter `tl.dot` is numpy's matmul of the tile, and the host BLAS may sum a tile of another shape in another
    order (OpenBLAS on an AMD EPYC did, by 1 float32 ulp): there, equal to float32 rounding."""
    if a.is_cuda:
        return torch.equal(a, b)
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)
