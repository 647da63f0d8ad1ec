"""Which kernel runs the Gated DeltaNet recurrence: flash-linear-attention's Triton kernels on CUDA when installed,
else transformers' reference PyTorch implementation (exact, slow; what CPU tests run)."""
from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger(__name__)


def gated_delta_rule(device_type: str) -> tuple[Callable, str]:
    """-> (chunk_gated_delta_rule(q, k, v, g=, beta=, initial_state=, output_final_state=, use_qk_l2norm_in_kernel=),
    its name).  q, k, v: [B, T, H, D]; the state: [B, H, Dk, Dv] float32."""
    if device_type == "cuda":
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
            return chunk_gated_delta_rule, "fla"
        except ImportError:
            log.warning("flash-linear-attention is not installed: the Gated DeltaNet layers run transformers' PyTorch "
                        "fallback, several times slower (pip install 'decider[gpu]')")
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule
    return torch_chunk_gated_delta_rule, "torch"
