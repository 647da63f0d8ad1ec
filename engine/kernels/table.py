"""The kernel table behind the forward (`Kernels`) and its choice, once per engine (`select_kernels`).

On CUDA with flash-linear-attention (fla) installed: `engine.kernels.cuda_fast` (fla's Gated DeltaNet recurrence and the
fused Triton kernels of `engine.kernels.fused`). Elsewhere: `engine.kernels.pytorch`, PyTorch code that computes
exactly what transformers' modules compute (what CPU tests run). Deterministic (batch-invariant) scoring on the CPU:
`engine.kernels.cpu_deterministic`.

Deterministic on CUDA: the same table with the GEMMs of cuBLAS where a check at load shows them batch-invariant for
this model's shapes, else `engine.kernels.cuda_deterministic.matmul`; the one-kernel suffix attention at launches that
give a row the same bits at every batch size (`engine.kernels.suffix_attention.InvariantSuffixAttention`), and the
answers' attention as it is (one launch at every size); the forward then takes no path by the batch's size
(`Kernels.batch_invariant`). Every other CUDA kernel here (the label mass's fused vocabulary log-sum-exp among them)
computes a row from that row alone in a fixed order (checked by `bench/probes/invariance_probe.py` and the GPU tests).
"""
from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from engine.kernels import cpu_deterministic as inv_k
from engine.kernels import pytorch as torch_k
from engine.errors import KernelsUnavailableError
from engine.kernels.attention import sdpa_with_lse

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Kernels:
    """name;
    delta_rule(q, k, v, a, b, A_log, dt_bias, initial_state, output_final_state, initial_index) -> (out, final state |
        None): the Gated DeltaNet recurrence, q and k already L2-normalised, decay g = -exp(A_log) * softplus(a +
        dt_bias) and beta = sigmoid(b), for q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], a, b [B, T, Hv] and a
        [B, Hv, Dk, Dv] float32 initial state (or None: zeros), or with initial_index [B] int64 the prefix bank's
        [S, Hv, Dk, Dv], row b starting from entry initial_index[b];
    conv_qkv(x [B, T, C], weight [C, K], prev, key_dim, head_k_dim, head_v_dim, gates [B, T, 2H], prev_index) ->
        (q, k, v, b, a): silu(causal conv) split into q, k [B, T, Hk, Dk] (each head L2-normalised, transformers'
        `l2norm`) and v [B, T, Hv, Dv], and gates (the delta rule's b | a) split into b, a [B, T, H]; prev: the
        previous K-1 inputs, oldest first, [B, C, K-1] or None, or with prev_index [B] the prefix bank's [S, C, K-1],
        row b continuing entry prev_index[b];
    conv_decay(x, weight, prev, key_dim, head_k_dim, head_v_dim, gates, prev_index, A_log, dt_bias) -> (q, k, v,
        beta, g): `conv_qkv` with the delta rule's beta = sigmoid(b) and chunked log2 decay g ([B, T, H] float32) in
        place of its b and a, for `decayed_delta_rule`; None: `conv_qkv`, then `delta_rule`;
    decayed_delta_rule(q, k, v, g, beta, initial_state, initial_index) -> out: `delta_rule`'s output for rows starting
        from the bank's entries by index, with no final state (a suffix pass), from `conv_decay`'s beta and g;
    rms_norm(x, weight, eps), weight already 1 + w for Qwen3.5's zero-centred norms, float32;
    gated_rms_norm(x, gate, weight, eps) = norm(x) * weight * silu(gate);
    swiglu(gate, up) = silu(gate) * up;
    add_rms_norm(h, x, weight, eps) -> (rms_norm(h + x), h + x), the sum rounded to h's dtype before the norm as
        transformers does (h may be updated in place);
    qk_norm_rope(q [B, T, Hq, D], k [B, T, Hkv, D], q_weight, k_weight, cos, sin, eps, q_cos=None, q_sin=None) ->
        (q, k) as [B, H, T, D]: the attention's per-head RMSNorms, then transformers' `apply_rotary_pos_emb`; with
        q_cos, q_sin, q is rotated by those (q of other rows than k's: [S, 1, Hq, D] at the answer rows);
    gate_attention(engine.kernels.attention.AttentionOut, gate [B, T, Hq, D]) -> [B, T, Hq * D]: the merge of a
        prefix/suffix split attention (if any), then transformers' sigmoid output gate;
    linear(x [..., K], weight [N, K]) -> [..., N]: every projection (bias-free), the label read-out included;
    add_linear(h [..., N] contiguous, x [..., K], weight [N, K]) -> h + x @ weight^T, written into h, the sum rounded
        once (the projection's epilogue adds the residual); None: the table keeps transformers' two roundings, and
        `engine.model.FUSED_RESIDUAL` is ignored;
    attention(q [Z, H, M, D], k, v [Z, Hkv, N, D], causal, scale) -> (out [Z, H, M, D], lse [Z, H, M] float32): the
        suffix half of a suffix pass's attention (causal) and, by row, its prefix half;
    indexed_attention(q [Z, Hkv, M, D], k, v [S, Hkv, N, D], scale, key_lengths [S] int32, kv_index [Z] int64) ->
        (out, lse) as `attention`, non-causal, entry z reading K/V entry kv_index[z] up to its length: the prefix half
        read straight from the prefix bank (`engine.prefix_bank`); None: the prefix keys are gathered per row;
    suffix_attention(q [B, Hq, T, D], k, v [B, Hkv, T, D], bank_k, bank_v [S, Hkv, N, D], key_lengths [S] int32,
        slots [B] int64, gate [B, T, Hq, D], scale) -> [B, T, Hq * D]: a suffix pass's whole attention (row b's prefix
        keys from bank entry slots[b], then its causal suffix keys, one softmax) and the output gate, in one kernel;
        None: the split path (`indexed_attention` or gathered keys, `attention`, `gate_attention`);
    answer_attention(q [S, Hq, D], k, v [B, Hkv, T, D], bank_k, bank_v, key_lengths, slots, rows [S] int64, starts,
        counts [B] int64, gate [S, Hq, D], scale) -> [S, Hq * D]: `suffix_attention` for queries at S rows alone (row
        b's at rows[starts[b]:starts[b] + counts[b]]): the last layer's (`engine.model.ANSWER_QUERIES`); None: every
        token's queries, then the rows;
    row_logsumexp(x [S, N], n_cols, out=None) -> [S] float32: log(sum(exp(x[:, :n_cols]))) per row (into `out`, a
        [S] float32 view, when given): the full vocabulary's log-sum-exp behind the label mass (`engine.label_mass`);
        in a batch-invariant table a row's sum takes one order whatever the rows beside it;
    vocab_logsumexp(x [S, K], weight [V, K], n_valid) -> [S] float32: log(sum(exp(x @ weight[:n_valid]^T))) per row in
        one GEMM kernel, the logits never written (`engine.kernels.vocab_logsumexp`, batch-invariant by construction, so
        in both CUDA tables); None: `engine.label_mass.FullVocabulary` reads the vocabulary in chunks through `linear`
        and `row_logsumexp`;
    ordered_mass(share [S, N] float32) -> [S] float32: each row's columns summed left to right, clamped at 1, in one
        launch (the label mass's sum, `engine.label_mass.label_mass`); None: a loop of torch adds, a launch each;
    score_rows(z [S, N], inv_temp [S, 1], bias [S, N], mask [S, N], lse [S] or None) -> [S, 2N + 1] float32: the
        read-out's softmaxes and label mass in one launch (`engine.kernels.score_rows`, batch-invariant by
        construction, so in both CUDA tables); None: `engine.readout.read_rows`'s torch ops;
    attend_by_request: the suffix pass runs attention one row at a time on its own lengths (eager only: a graph
        cannot capture per-batch lengths), for tables whose attention kernel depends on the batch's padded length;
    batch_invariant: a row's result does not depend on the batch around it (its size, the row's position, its
        neighbours, the padded length), so the forward takes the same path at every batch size
        (`engine.model.ANSWER_QUERIES_MIN_ROWS` does not apply)."""
    name: str
    delta_rule: Callable
    conv_qkv: Callable
    rms_norm: Callable
    gated_rms_norm: Callable
    swiglu: Callable
    add_rms_norm: Callable
    qk_norm_rope: Callable
    gate_attention: Callable
    linear: Callable = F.linear
    add_linear: Callable | None = None
    attention: Callable = sdpa_with_lse
    indexed_attention: Callable | None = None
    suffix_attention: Callable | None = None
    answer_attention: Callable | None = None
    row_logsumexp: Callable = torch_k.torch_row_logsumexp
    vocab_logsumexp: Callable | None = None
    ordered_mass: Callable | None = None
    score_rows: Callable | None = None
    conv_decay: Callable | None = None
    decayed_delta_rule: Callable | None = None
    attend_by_request: bool = False
    batch_invariant: bool = False


def select_kernels(device_type: str, deterministic: bool = False, gemm_weights: Sequence[torch.Tensor] = (),
                   attention_heads: tuple[int, int, int] | None = None) -> Kernels:
    """The kernel table for a device type ("cuda", "cpu"); deterministic: a table whose result for a row does not
    depend on the batch around it (its size, the row's position, its neighbours, the padded length): on CUDA
    `batch_invariant_kernels` (`gemm_weights` are the weights whose cuBLAS GEMMs it checks, `attention_heads` the
    full-attention layers' (query heads, kv heads, head dim), at which it checks the suffix attention's launches), on
    the CPU `engine.kernels.cpu_deterministic`."""
    if device_type == "cuda":
        try:
            table = fla_kernels()
        except ImportError:
            if deterministic:
                # The PyTorch fallback's delta rule and attention take paths by the batch's size on CUDA: measured on
                # the H200, 40 of 120 probe states differed by up to 1.4e-2 between batches. Never claim what it
                # does not give.
                raise KernelsUnavailableError(
                    "deterministic scoring on CUDA needs flash-linear-attention: pip install 'decider[gpu]' (without "
                    "it a state's probabilities depend on the batch around it); or score with --no-deterministic"
                ) from None
            log.warning("flash-linear-attention is not installed: the Gated DeltaNet layers run PyTorch fallbacks, "
                        "several times slower (pip install 'decider[gpu]')")
            table = torch_kernels()
        return batch_invariant_kernels(table, gemm_weights, attention_heads) if deterministic else table
    return invariant_kernels() if deterministic else torch_kernels()


def torch_kernels() -> Kernels:
    """`engine.kernels.pytorch`: transformers' PyTorch formulas (any device)."""
    t = torch_k
    return Kernels("torch", t.torch_delta_rule, t.torch_conv_qkv, t.torch_rms_norm, t.torch_gated_rms_norm,
                   t.torch_swiglu, t.torch_add_rms_norm, t.torch_qk_norm_rope, t.torch_gate_attention, t.torch_linear)


def invariant_kernels() -> Kernels:
    """`engine.kernels.cpu_deterministic`: the PyTorch table made batch-invariant (blocked GEMMs, exp-based activations,
    attention by request)."""
    i = inv_k
    return Kernels("torch-invariant", i.delta_rule, i.conv_qkv, i.rms_norm, i.gated_rms_norm, i.swiglu,
                   torch_k.torch_add_rms_norm, torch_k.torch_qk_norm_rope, i.gate_attention, i.linear,
                   row_logsumexp=i.row_logsumexp, attend_by_request=True, batch_invariant=True)


def fla_kernels() -> Kernels:
    """`engine.kernels.cuda_fast` (CUDA only): ImportError where fla or triton is not installed."""
    from engine.kernels import cuda_deterministic as bi
    from engine.kernels import cuda_fast as f      # imports fla and triton, which CPU machines may lack
    from engine.kernels.suffix_attention import answer_attention, suffix_attention
    from engine.kernels.fused import ordered_mass, row_logsumexp
    from engine.kernels.score_rows import score_rows
    from engine.kernels.vocab_logsumexp import vocab_logsumexp
    log.info("fla's autotuned kernels pinned to one launch each (the same in every process): %s",
             f.pin_autotuned_launches())
    # the prefix half, where the attention is split (`engine.model.FUSED_ATTENTION` off), by the Triton
    # kernel that reads the prefix bank by index (torch's flash op takes no index; on the H200 the Triton kernel
    # also ran a shared prefix faster than flash did: engine.kernels.cuda_deterministic)
    return Kernels("fla", f.delta_rule, f.conv_qkv, f.row_norm, f.gated_rms_norm, f.swiglu, f.add_rms_norm,
                   f.qk_norm_rope, f.gate_attention, f.linear, add_linear=torch_k.torch_add_linear,
                   indexed_attention=bi.indexed_attention, suffix_attention=suffix_attention,
                   answer_attention=answer_attention, row_logsumexp=row_logsumexp, vocab_logsumexp=vocab_logsumexp,
                   ordered_mass=ordered_mass, score_rows=score_rows, conv_decay=f.conv_decay,
                   decayed_delta_rule=f.decayed_delta_rule)


def batch_invariant_kernels(table: Kernels, gemm_weights: Sequence[torch.Tensor],
                            attention_heads: tuple[int, int, int] | None = None) -> Kernels:
    """`table` with batch-invariant attention, and GEMMs whose summation order is proven not to depend on M.

    The suffix attention is the fast table's one kernel, at launches checked at load (`InvariantSuffixAttention`:
    `attention_heads` None, the large launch at every size); the answers' attention is the fast table's kernel as it
    is, so with `engine.model.ANSWER_QUERIES` the last layer's queries run at the answer rows at every batch size
    (their projections through `InvariantLinear` like every other), and so is `vocab_logsumexp` (one tile at every row
    count by construction: `engine.kernels.vocab_logsumexp`). Not taken: `add_linear` (cuBLAS's GEMM with the
    residual in its epilogue, a kernel family whose row-count invariance is not checked; `engine.model.FUSED_RESIDUAL`
    is off in the fast table too: it gained nothing on the H200)."""
    from engine.kernels import cuda_deterministic as bi      # imports triton
    from engine.kernels import blocked_linear as blocked
    from engine.kernels.suffix_attention import InvariantSuffixAttention
    from engine.buckets import B_BUCKETS, TS_BUCKETS     # read at the call: bench/probes/variant_ab.py may set them

    # the row counts a suffix pass's GEMMs see: batch buckets x suffix lengths, and x answers per row (a power of 2:
    # the read-out, the last layer's MLP and its query and output projections run on the answer slots alone); below
    # 256 rows (the floors under it run such counts unpadded) every batch bucket x length bucket
    per_row = (1, 2, 4, 8, 10, 16, 32, 64, 128, 184, 256, 512, 1024)
    rows = sorted({r * t for r in B_BUCKETS for t in per_row}
                  | {r * t for r in B_BUCKETS for t in TS_BUCKETS if r * t < 256})
    started = time.perf_counter()
    linear = bi.InvariantLinear(list(gemm_weights), rows)
    log.info("deterministic: GEMMs by cuBLAS for weight shapes %s (rows padded up to the floor given; batch-invariant "
             "at %d row counts), by cuBLAS in blocks of %d rows for %s, else by the Triton matmul for %s; checked in "
             "%.1f s", linear.floors, len(rows), blocked.BLOCK_ROWS, sorted(linear.blocked) or "none",
             sorted(linear.triton) or "none", time.perf_counter() - started)
    log.info("deterministic: Triton small tile below %d rows for %s", bi.SMALL_TILE_ROWS, sorted(linear.small) or "none")
    weight = gemm_weights[0] if gemm_weights else None
    suffix = InvariantSuffixAttention(attention_heads if weight is not None else None,
                                      weight.dtype if weight is not None else torch.float32,
                                      weight.device if weight is not None else "cuda")
    log.info("deterministic: %r", suffix)
    floors = ", ".join(f"{n}x{k}>={f}" for (n, k), f in sorted(linear.floors.items()))
    # the MLP's SwiGLU feeds the down projection: where that runs in blocks, its output gets whole blocks' storage
    swiglu = table.swiglu
    if linear.blocked and "out" in inspect.signature(swiglu).parameters:
        swiglu = blocked.block_padded_output(swiglu)
    return replace(table, name=f"{table.name}+batch-invariant(cuBLAS {floors}; blocked {sorted(linear.blocked)}; "
                              f"Triton {sorted(linear.triton)}; small tile {sorted(linear.small)}; {suffix!r})",
                   linear=linear,
                   swiglu=swiglu,
                   add_linear=None,
                   attention=bi.attention,
                   indexed_attention=bi.indexed_attention,
                   suffix_attention=suffix,
                   batch_invariant=True)
