"""Where the Triton kernel tests run: on a CUDA device, or on the CPU through Triton's interpreter
(``TRITON_INTERPRET=1``); anywhere else a test module calling ``require()`` at import is skipped."""
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
