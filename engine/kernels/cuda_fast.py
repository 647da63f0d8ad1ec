"""The CUDA kernels (`engine.kernels.table.fla_kernels` is their table): fla's Triton kernels for the Gated DeltaNet
recurrence (a prefix pass runs fla's whole forward, with the decay gate and beta's sigmoid computed inside it; a suffix
pass's rows start from prefix states read from the bank by index, `engine.kernels.indexed_delta_rule`, and its decay,
beta and WY matrix come from `engine.kernels.delta_rule_inputs`, fla's kernels in fewer launches) and, from
`engine.kernels.fused` and `engine.kernels.causal_conv` (fixed launch configuration: no per-shape autotuning, 16-byte
loads), SwiGLU, the causal conv fused with the q/k L2 norms (continuing the prefix's conv state in place: no per-row
concatenation of the prefix's conv inputs, no copies of q, k, v), the RMS/gated norms, the residual adds fused into
them, q/k norm + RoPE, and the attention's merge with its output gate.

Importing this module imports fla and triton: ImportError where they are not installed.
"""
from __future__ import annotations

import torch
import triton
from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_kernel_h_blockdim64
from fla.ops.common.chunk_o import chunk_fwd_kernel_o, chunk_fwd_o
from fla.ops.common.gate import fused_beta_sigmoid
from fla.ops.gated_delta_rule import chunk_gated_delta_rule
from fla.ops.gated_delta_rule.chunk_fwd import (chunk_gated_delta_rule_fwd_intra,
                                                chunk_gated_delta_rule_fwd_kkt_solve_kernel)
from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd_kernel
from fla.ops.gated_delta_rule.gate import gdn_gate_chunk_cumsum, gdn_gate_chunk_cumsum_scalar_kernel
from fla.ops.utils.constant import RCP_LN2
from torch.nn.functional import linear

from engine.kernels import delta_rule_inputs
from engine.kernels.decay import decay_and_beta
from engine.kernels.indexed_delta_rule import CHUNK, chunk_outputs_indexed, chunk_states_indexed
from engine.kernels.pytorch import by_index
from engine.kernels.causal_conv import conv_qkv, conv_qkv_decay
from engine.kernels.fused import GATED, add_rms_norm, gate_attention, rms_norm_rope, row_norm, swiglu

__all__ = ["delta_rule", "delta_rule_indexed", "decayed_delta_rule", "conv_qkv", "conv_decay", "row_norm",
           "gated_rms_norm", "swiglu", "add_rms_norm", "qk_norm_rope", "gate_attention", "linear"]


def delta_rule(q, k, v, a, b, A_log, dt_bias, initial_state, output_final_state, initial_index=None):
    # fla reads grouped value heads (Hv > Hk) without repeating q and k; q and k come L2-normalised from conv_qkv
    # (fla's own L2 norm would be one more kernel, specialised on the row-block count per shape)
    if initial_index is not None and not output_final_state:
        # rows continuing prefixes of the bank: their states are read in place, not copied per row
        return delta_rule_indexed(q, k, v, a, b, A_log, dt_bias, initial_state, initial_index), None
    return chunk_gated_delta_rule(q, k, v, g=a, beta=b, initial_state=by_index(initial_state, initial_index),
                                  output_final_state=output_final_state, use_gate_in_kernel=True, A_log=A_log,
                                  dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)


FUSED_INPUTS = True
"""Whether a suffix pass makes the delta rule's decay and beta in one kernel and leaves the solve's matrix unfilled
above its diagonal (`engine.kernels.delta_rule_inputs`): two launches a layer fewer than fla's forward, and no 48 MB
zero-fill a layer at batch 128 (False: fla's kernels; read at each call, for `bench/probes/variant_ab.py`). The same
bits as fla's kernels (`tests/engine/kernels/test_delta_rule.py`). On the H200 in one process (run AS) batch 128 ran in
59.92 ms against 60.52, batch 32 in 15.47 against 15.59."""

MERGED_SOLVE = True
"""Whether a suffix pass solves for the WY matrix with `engine.kernels.delta_rule_inputs.solve_into` (fla's kernel with
its four forward substitutions in one loop) rather than fla's kernel (read at each call, for
`bench/probes/variant_ab.py`). The same bits as fla's at both of `WY_LAUNCH`'s launches
(`tests/engine/kernels/test_delta_rule.py`). On the H200 in one process (run AU, a noisy run: rounds of one variant
spread by up to 0.35 ms at batch 1) batch 1 ran in 2.184 ms against 2.428, batch 8 in 5.355 against 5.436 and batch 128
in 60.66 against 61.18; at 2 warps for large grids it was slower (61.76 ms at batch 128)."""

FUSED_OUTPUT = True
"""Whether a suffix pass's delta rule computes its output in the state kernel's pass (`chunk_outputs_indexed`) rather
than by fla's output kernel over stored states (read at each call: `bench/probes/variant_ab.py` can time both)."""


def delta_rule_indexed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       A_log: torch.Tensor, dt_bias: torch.Tensor, bank: torch.Tensor, index: torch.Tensor
                       ) -> torch.Tensor:
    """The output of fla's `chunk_gated_delta_rule(q, k, v, a, b, initial_state=bank[index], use_gate_in_kernel=True,
    A_log, dt_bias, use_beta_sigmoid_in_kernel=True)` without forming bank[index]: q, k [B, T, H, K] (contiguous,
    L2-normalised), v [B, T, Hv, V], a, b [B, T, Hv] (contiguous) -> o [B, T, Hv, V]. fla's forward
    (`chunk_gated_delta_rule_fwd`) step by step, its state kernel replaced by `chunk_states_indexed`, or with
    `FUSED_OUTPUT` its state and output kernels by `chunk_outputs_indexed`."""
    g, beta = _decay(a, b, A_log, dt_bias)
    return decayed_delta_rule(q, k, v, g, beta, bank, index)


def _decay(a, b, A_log, dt_bias):
    # (g, beta): the chunked log2 decay and sigmoid(b), by one kernel or (FUSED_INPUTS off) fla's two
    if FUSED_INPUTS:
        return decay_and_beta(a, b, A_log, dt_bias, CHUNK, RCP_LN2)
    return (gdn_gate_chunk_cumsum(g=a, A_log=A_log, chunk_size=CHUNK, scale=RCP_LN2, dt_bias=dt_bias),
            fused_beta_sigmoid(b))


def decayed_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       bank: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`delta_rule_indexed` from its decay and beta already made: g, beta [B, T, Hv] float32 (`conv_decay`'s)."""
    w, u = _wy_representation(k, v, g, beta)
    scale = k.shape[-1] ** -0.5
    if FUSED_OUTPUT:
        return chunk_outputs_indexed(q, k, w, u, g, bank, index, scale)
    h, v_new = chunk_states_indexed(k, w, u, g, bank, index)
    return chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=g, scale=scale, chunk_size=CHUNK)


CONV_DECAY = False
"""Whether `conv_decay` makes the delta rule's decay and beta in the conv's launch where that launch is its small one
(batch 1: `engine.kernels.causal_conv.conv_qkv_decay`), one launch a layer fewer, meant to give the same bits; False:
the conv (copying b and a), then the decay's kernel, as before it. Off until the GPU has run its tests and timed it
(no device could be started in the session that wrote it; `bench/README.md`'s queue). Read at each call, for
`bench/probes/variant_ab.py` (`--variant "conv-decay:engine.kernels.cuda_fast.CONV_DECAY=True"`)."""


def conv_decay(x, weight, prev, key_dim, head_k_dim, head_v_dim, gates, prev_index, A_log, dt_bias):
    """`Kernels.conv_decay`: the conv's q, k, v, and the delta rule's beta and g, for `decayed_delta_rule`."""
    if CONV_DECAY and FUSED_INPUTS:
        return conv_qkv_decay(x, weight, prev, key_dim, head_k_dim, head_v_dim, gates, prev_index, A_log, dt_bias,
                              CHUNK, RCP_LN2)
    q, k, v, b, a = conv_qkv(x, weight, prev, key_dim, head_k_dim, head_v_dim, gates, prev_index)
    g, beta = _decay(a, b, A_log, dt_bias)
    return q, k, v, beta, g


WY_LAUNCH: tuple[tuple[int, int], tuple[int, int]] | None = ((64, 1), (4, 3))
"""Fixed launches of fla's two WY kernels in a suffix pass: ((BK, warps) of the fused K K^T + triangular solve,
(warps, stages) of w/u); None: through fla's entry point, at the launches its autotuner holds (one each once
`pin_autotuned_launches` ran). Autotuned, fla's key holds neither the batch nor the length, so it keeps, for every
batch, the launch it timed best at the process's first call (a prefix pass). On the H200 (run AL in bench/README.md:
`bench/probes/kernel_probe.py --only wy`, batch 128, 184 tokens) the solve took 0.145 ms a layer at this launch against
0.246 at the (64, 2) fla had tuned, and whole batch-128 steps 60.5 ms against 65.6 (`bench/probes/variant_ab.py`). Read
at each call, for `bench/probes/variant_ab.py`."""

WY_SMALL_LAUNCH: tuple[tuple[int, int], tuple[int, int]] = ((64, 2), (2, 4))
"""The launch where the solve would start fewer than `WY_FILL_PROGRAMS` programs (batch 1: 3 chunks x 16 heads): with
so few programs, 2 warps a program ran the solve in 18.9 us a layer against 20.9 at 1 warp (H200, batch 1)."""
WY_FILL_PROGRAMS = 264                  # two programs an SM on the H200's 132

FUSED_WY_SMALL_LAUNCH: tuple[int, int, int] | None = (64, 2, 4)
"""Where the solve would start fewer than `WY_FILL_PROGRAMS` programs (batches 1 to 4): None, its two kernels at
`WY_SMALL_LAUNCH`; or (BK, warps, stages) of one launch doing both, each program solving its chunk and then computing
its w and u (`engine.kernels.delta_rule_inputs.solve_w_u_into`: the same bits, `tests/engine/kernels/test_delta_rule.py`).
At batch 1 the w/u kernel is 18 launches of ~5.7 us a step, each behind a ~0.7 us gap (run CI's timeline); one launch
saves the launches and the gaps. Run CX (H100, `bench/probes/variant_ab.py`, one process, 4 rounds, rounds' spread
<= 0.013 ms, bits equal): batch 1 2.310 -> 2.244 ms at 2 warps (2.217 at 4), batch 2 2.598 -> 2.530 (2.511), batch 4
3.395 -> 3.332 (3.389: 4 warps lose their gain where the grid is 192 programs), batch 8 unchanged (not small). 2 warps
win at each small batch, so they are the default. Read at each call, for `bench/probes/variant_ab.py`
(`--variant "two-kernels:engine.kernels.cuda_fast.FUSED_WY_SMALL_LAUNCH=None"`)."""


def _wy_representation(k, v, g, beta):
    """fla's `chunk_gated_delta_rule_fwd_intra` -> (w, u), its two kernels launched at `WY_LAUNCH` (or
    `WY_SMALL_LAUNCH` for a small grid) unless it is None."""
    if WY_LAUNCH is None:
        w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g, beta=beta, chunk_size=CHUNK)
        return w, u
    B, T, _, K = k.shape
    HV = v.shape[2]
    programs = triton.cdiv(T, CHUNK) * B * HV          # the solve's: one a chunk of a row's value head
    small = programs < WY_FILL_PROGRAMS
    solve, w_u = WY_SMALL_LAUNCH if small else WY_LAUNCH
    if small and FUSED_WY_SMALL_LAUNCH is not None and FUSED_INPUTS and MERGED_SOLVE:
        w, u = k.new_empty(B, T, HV, K), torch.empty_like(v)
        parts = delta_rule_inputs.w_u_parts(programs, delta_rule_inputs.w_u_blocks(k, v))
        A = torch.empty(parts * B, T, HV, CHUNK, device=k.device, dtype=k.dtype)
        delta_rule_inputs.solve_w_u_into(w, u, A, k, v, g, beta, CHUNK, FUSED_WY_SMALL_LAUNCH, parts)
        return w, u
    # the solve writes A's lower blocks only: fla's w/u kernel reads the whole of A, which must then be zero above
    A = (torch.empty if FUSED_INPUTS else torch.zeros)(B, T, HV, CHUNK, device=k.device, dtype=k.dtype)
    if MERGED_SOLVE:
        delta_rule_inputs.solve_into(A, k, g, beta, CHUNK, solve)
    else:
        solve_into(A, k, g, beta, solve)
    w, u = k.new_empty(B, T, HV, K), torch.empty_like(v)
    if FUSED_INPUTS:
        delta_rule_inputs.w_u_into(w, u, k, v, beta, A, g, CHUNK, w_u)
    else:
        w_u_into(w, u, k, v, beta, A, g, w_u)
    return w, u


def solve_into(A: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, launch: tuple[int, int]) -> None:
    """fla's fused K K^T + triangular solve into A [B, T, Hv, CHUNK] (its lower blocks; the rest must be zeros) at
    launch (BK, warps): k [B, T, H, K], g and beta [B, T, Hv]. (`.fn.fn`, here and in `w_u_into`: the jitted kernel
    under fla's heuristics and autotuner, which would pick the launch themselves.)"""
    B, T, H, K = k.shape
    HV = beta.shape[2]
    chunk_gated_delta_rule_fwd_kkt_solve_kernel.fn.fn[(triton.cdiv(T, CHUNK), B * HV)](
        k=k, g=g, beta=beta, A=A, cu_seqlens=None, chunk_indices=None, T=T, H=H, HV=HV, K=K, BT=CHUNK, BC=16,
        BK=launch[0], USE_G=True, IS_VARLEN=False, num_warps=launch[1])


def w_u_into(w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, A: torch.Tensor,
             g: torch.Tensor, launch: tuple[int, int]) -> None:
    """fla's w/u kernel into w [B, T, Hv, K] and u [B, T, Hv, V] at launch (warps, stages), from `solve_into`'s A."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    recompute_w_u_fwd_kernel.fn.fn[(triton.cdiv(T, CHUNK), B * HV)](
        k=k, v=v, beta=beta, w=w, u=u, A=A, g=g, cu_seqlens=None, chunk_indices=None, T=T, H=H, HV=HV, K=K, V=V,
        BT=CHUNK, BK=64, BV=64, USE_G=True, IS_VARLEN=False, num_warps=launch[0], num_stages=launch[1])


_SOLVE, _W_U = WY_LAUNCH      # pinned for fla's own entry points too (a prefix pass, `WY_LAUNCH` None)
PINNED_LAUNCHES = (
    (chunk_gated_delta_rule_fwd_kkt_solve_kernel, {"BK": _SOLVE[0], "num_warps": _SOLVE[1]}),
    (recompute_w_u_fwd_kernel, {"num_warps": _W_U[0], "num_stages": _W_U[1]}),
    (chunk_fwd_kernel_o, {"BK": 64, "BV": 64, "num_warps": 4, "num_stages": 3}),
    (chunk_gated_delta_rule_fwd_kernel_h_blockdim64, {"BV": 64, "num_warps": 4, "num_stages": 2}),
    (gdn_gate_chunk_cumsum_scalar_kernel, {}),
)
"""fla's autotuned kernels on the engine's paths (a prefix pass runs fla's whole forward; a suffix pass its gate and,
with `WY_LAUNCH` None or `FUSED_OUTPUT` False, its WY and output kernels), each with the launch it is pinned to: the
candidate of fla's own list with these settings, else its first. fla picks a launch by timing its candidates at the
first call of a process, and the block over the key dimension (BK) splits the kernel's sums: two processes could
then compute a schema's prefix, and every answer read from it, with different bits, and a replay would not reproduce
the live records (DESIGN.md, determinism). Pinned, every process runs the same launches, and none is timed. The
settings are the launches fla's autotuner picked on the H200 at 32 rows of 582 tokens (`full_fast`'s shape;
`bench/probes/kernel_probe.py --only fla_launches`, run AQ); the state kernel's BV splits no sum (its first candidate,
BV 32, gave the same bits there)."""


_CANDIDATES: dict = {}      # kernel -> fla's candidate launches, as its autotuner held them before pinning


def pinned_launch(kernel, settings: dict) -> triton.Config:
    """The candidate of fla's list for `kernel` with `settings` (num_warps, num_stages or a block size), else its
    first."""
    candidates = _CANDIDATES.setdefault(kernel, list(kernel.fn.configs))

    def matches(config: triton.Config) -> bool:
        return all((getattr(config, k) if k.startswith("num_") else config.kwargs.get(k)) == v
                   for k, v in settings.items())

    return next((c for c in candidates if matches(c)), candidates[0])


def _pin(kernel, settings: dict) -> triton.Config:
    """Restrict `kernel`'s autotuner (under fla's heuristics) to one candidate: Triton's autotuner runs a single
    candidate without timing it."""
    tuner, chosen = kernel.fn, pinned_launch(kernel, settings)
    tuner.configs = [chosen]
    tuner.cache.clear()
    return chosen


def pin_autotuned_launches() -> dict[str, str]:
    """Pin `PINNED_LAUNCHES` (idempotent) -> each kernel's launch, for the log."""
    return {kernel.fn.base_fn.__name__: str(_pin(kernel, settings)) for kernel, settings in PINNED_LAUNCHES}


def gated_rms_norm(x, gate, weight, eps):
    return row_norm(x, weight, eps, GATED, gate)


def qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps, q_cos=None, q_sin=None):
    q_cos, q_sin = (cos, sin) if q_cos is None else (q_cos, q_sin)
    return rms_norm_rope(q, q_weight, q_cos, q_sin, eps), rms_norm_rope(k, k_weight, cos, sin, eps)
