"""The Qwen3.5 hybrid forward, written for scoring against a cached prefix.

transformers' modules hold the weights (names match the checkpoint: `model.layers.N.linear_attn.in_proj_qkv`, ...) and
compute embeddings and the RoPE angles (once per position: `engine.rope_table`); norms (with the residual adds and RoPE
fused in), the causal conv, the delta rule, SwiGLU and the attention's merge and output gate come from the kernel table
`engine.kernels.table.select_kernels` picks (the fused Triton kernels of fla and `engine.kernels.fused` on CUDA,
transformers' exact PyTorch formulas elsewhere); the attention calls and layouts from `engine.kernels.attention`; this
file owns the order of operations, the fused projections and the layer states, so that:

- a *prefix pass* (one prefix, batch 1) returns each layer's state: K/V (after RoPE) for full-attention layers, the
  last K-1 conv inputs and the recurrent state for Gated DeltaNet layers (`PrefixState`);
- a *suffix pass* continues each row from its own prefix in the prefix bank (`engine.prefix_bank`, named by slot),
  without writing to it and without copying its K/V into the row: the prefix half of attention reads the bank by
  index (`Kernels.indexed_attention`), merged with the causal suffix half by log-sum-exp; the Gated DeltaNet layers
  start from the slot's conv and recurrent states.

A request is one row (packed) or one row per question (independent), each continuing one prefix; rows of any schemas
share a batch. Rows are right-padded; everything here is causal, so a row's padding never reaches its slots.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

from engine.kernels.attention import AttentionOut
from engine.kernels.table import select_kernels
from engine.rope_table import ROPE_TABLE_POSITIONS, RopeTable

ANSWER_ROWS_ONLY = True
"""With `layers(..., rows=)`, run the last layer's MLP and norms on those rows alone (False: on every token, then
select, as before; kept so that `bench/probes/variant_ab.py` can time the two in one process). Read when a step is
traced, so a CUDA graph keeps the setting it was captured under."""
FUSED_ATTENTION = True
"""Whether a suffix pass takes the kernel table's one-kernel attention (`Kernels.suffix_attention`) where it has one
(False: the split path; read when a step is traced, like `ANSWER_ROWS_ONLY`)."""
FUSED_RESIDUAL = False
"""Whether the residual adds go into the projections before them where the kernel table can (`Kernels.add_linear`:
cuBLAS adds the residual in its epilogue, in place), the norms after them then reading the residual alone: at batch
128 each of the 48 adds a step reads and writes 96 MB fewer (about 1 ms of a 60 ms step on the H200, from bytes). The
sum is rounded once, where transformers rounds the projection, then the sum: not the bits of the path without it, and
so never in a deterministic table. Off: on the H200 it saved nothing (run BC, `bench/probes/variant_ab.py --variant
"residual:engine.model.FUSED_RESIDUAL=True"`: 59.55 against 59.58 ms at batch 128, 2.40 against 2.43 at batch 1, within
the rounds' spread), though it matches the oracle as the default path does (`tests/engine/test_gpu.py -k residual`).
Read when a step is traced, like `ANSWER_ROWS_ONLY`."""
ANSWER_QUERIES = True
"""With `layers(..., rows=)` in a suffix pass whose kernel table has `answer_attention`, compute the last layer's
queries, attention, output gate and output projection at those rows alone (its keys and values still at every token):
where the last layer is a full-attention layer (Qwen3.5's are), no later layer reads another token's output. At
batch 128 that leaves out, from the FLOP counts and run AX's profile, about 0.27 ms of the q|gate projection (4,096 of
its 5,120 columns), 0.4 ms of attention and 0.13 ms of the output projection, of a 60 ms step. Not the bits of the
path without it (the projections of fewer rows round as the GEMM does for that row count, the attention runs another
launch). The deterministic table takes it at every batch size (`Kernels.batch_invariant`), its projections through
the invariant linear. On the H200 (`bench/probes/variant_ab.py --variant
"answers:engine.model.ANSWER_QUERIES=True"`, batch 128): 59.39 against 59.97 ms, faster in each of 8 rounds (run BL),
the same probabilities as without it; at batch 1 and 32 within the rounds' spread (run BK). Read when a step is traced,
like `ANSWER_ROWS_ONLY`."""
ANSWER_QUERIES_MIN_ROWS = 2
"""`ANSWER_QUERIES` only in steps of at least this many rows: `answer_attention` runs one program per (row, kv head),
so at batch 1 two programs walk the row's ~600 keys where the whole-row kernel spreads them over 92. On the H200
(`bench/probes/variant_ab.py`, 4 rounds, run BQ): batch 1 2.178 ms at 2 against 2.264 at 1 (the answers' kernel took 52
us of the step, the whole row's 23); batch 8 5.077 against 5.139 and batch 32 15.59 against 15.52, within the spread; 16
no better than 2. Not in a batch-invariant table (`Kernels.batch_invariant`): a row scored alone would take another path
than in a batch, and get other bits."""


@dataclass
class PrefixState:
    """The layer states a prefix pass leaves (one prefix: batch 1), what `engine.prefix_bank.PrefixBank.add` stores."""
    lengths: list[int]
    k: dict[int, torch.Tensor] = field(default_factory=dict)      # layer -> [1, Hkv, length, D]
    v: dict[int, torch.Tensor] = field(default_factory=dict)      # layer -> [1, Hkv, length, D]
    conv: dict[int, torch.Tensor] = field(default_factory=dict)   # layer -> [1, C, K-1]: the last K-1 inputs
    rec: dict[int, torch.Tensor] = field(default_factory=dict)    # layer -> [1, Hv, Dk, Dv]


class CausalContext:
    """Context of a whole-prompt pass with no cache: plain causal attention, no state kept (the `full_fast` path)."""

    records = False   # whether the pass keeps the layer states (`keep`): only a prefix pass does
    answers = None    # (starts, counts) of each row's answer rows, where attention can run at them alone

    def conv_prev(self, i):
        """(the previous conv inputs, an index into them per row or None), as `Kernels.conv_qkv` takes them."""
        return None, None

    def rec_prev(self, i):
        """(the initial recurrent states, an index into them per row or None), as `Kernels.delta_rule` takes them."""
        return None, None

    def attend(self, i, q, k, v, scale, kernels) -> "AttentionOut":
        return AttentionOut(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True))

    def attend_gated(self, i, q, k, v, scale, kernels, gate) -> torch.Tensor:
        """`attend`, then the output gate [B, T, Hq, D]: -> [B, T, Hq * D]."""
        return kernels.gate_attention(self.attend(i, q, k, v, scale, kernels), gate)


class _PrefixRecorder(CausalContext):
    """Context of a prefix pass: a causal pass that keeps every layer's final state."""

    records = True

    def __init__(self, length: int):
        self.state = PrefixState(lengths=[length])

    def keep(self, kind: str, i: int, t: torch.Tensor) -> None:
        getattr(self.state, kind)[i] = t.detach().clone()

    def attend(self, i, q, k, v, scale, kernels):
        self.keep("k", i, k)
        self.keep("v", i, v)
        return super().attend(i, q, k, v, scale, kernels)


class SuffixContext:
    """Context of a suffix pass: row b continues the prefix in bank slot `slots[b]`, at positions after it.

    slots: [B] int64 on the device (a graph's input buffer: captured work never depends on which prefixes a batch
    reads). key_span: how many of the bank's token columns the gathered-keys attention reads (the bank's capacity
    under a graph; the longest prefix in the batch when eager). lengths, host_slots: each row's suffix length and
    slot on the host; given, attention runs one row at a time on its own lengths (`Kernels.attend_by_request`), so
    that no kernel sees the batch's padded length or row count (eager only).
    """

    records = False

    def __init__(self, bank, slots: torch.Tensor, T: int, key_span: int, lengths: list[int] | None = None,
                 host_slots: list[int] | None = None, answers: tuple[torch.Tensor, torch.Tensor] | None = None):
        """answers: ([B] int64 each) where row b's answer rows start among `layers`' rows, and how many it has."""
        self.bank, self.slots, self.T, self.key_span = bank, slots, T, key_span
        self.lengths, self.host_slots, self.answers = lengths, host_slots, answers
        self.prefix_lengths = bank.lengths.index_select(0, slots)                               # [B] int32
        self.positions = self.prefix_lengths[:, None].long() + torch.arange(T, device=slots.device)[None, :]  # [B, T]

    def conv_prev(self, i):
        return self.bank.conv[i], self.slots              # the bank's [S, C, K-1], read by slot inside the conv kernel

    def rec_prev(self, i):
        return self.bank.rec[i], self.slots        # the bank's [S, Hv, Dk, Dv], read by slot inside the delta rule

    def attend_gated(self, i, q, k, v, scale, kernels, gate) -> torch.Tensor:
        """`attend`, then the output gate [B, T, Hq, D]: -> [B, T, Hq * D]; in one kernel where the table has it."""
        if kernels.suffix_attention is not None and self.lengths is None and FUSED_ATTENTION:
            return kernels.suffix_attention(q, k, v, self.bank.k[i], self.bank.v[i], self.bank.lengths, self.slots,
                                            gate, scale)
        return kernels.gate_attention(self.attend(i, q, k, v, scale, kernels), gate)

    def attend_answers(self, i, q, k, v, scale, kernels, gate, rows) -> torch.Tensor:
        """`attend_gated` for the queries at the answer rows alone: q, gate [S, Hq, D] at rows ([S] tokens b * T + t);
        k, v: [B, Hkv, T, D] -> [S, Hq * D]."""
        starts, counts = self.answers
        return kernels.answer_attention(q, k, v, self.bank.k[i], self.bank.v[i], self.bank.lengths, self.slots, rows,
                                        starts, counts, gate, scale)

    def attend(self, i, q, k, v, scale, kernels):
        """q: [B, Hq, T, D]; k, v: [B, Hkv, T, D] (this suffix). Softmax over [own prefix keys | causal suffix keys],
        as two halves merged by their log-sum-exps (`AttentionOut` with P = B: row b's prefix half is entry b)."""
        if self.lengths is not None:
            return self._attend_by_row(i, q, k, v, scale, kernels.attention)
        if kernels.indexed_attention is None:
            return self._attend_gathered(i, q, k, v, scale)
        B, Hq, T, D = q.shape
        Hkv = k.shape[1]
        # a row's G query heads per kv head read the same prefix keys: one [G*T, D] query block per (row, kv head)
        o_pre, lse_pre = kernels.indexed_attention(q.reshape(B, Hkv, Hq // Hkv * T, D), self.bank.k[i],
                                                   self.bank.v[i], scale, self.bank.lengths, self.slots)
        o_self, lse_self = kernels.attention(q, k, v, True, scale)                         # head h reads kv head h // G
        return AttentionOut(o_self, lse_self, o_pre, lse_pre, 1, B)

    def _attend_gathered(self, i, q, k, v, scale):
        """Each row's prefix keys gathered from the bank, padding masked; explicit scores over both halves."""
        B, Hq, T, D = q.shape
        Hkv = k.shape[1]
        G = Hq // Hkv
        span = self.key_span
        kp = self.bank.k[i][:, :, :span].index_select(0, self.slots)                      # [B, Hkv, span, D]
        vp = self.bank.v[i][:, :, :span].index_select(0, self.slots)
        past_end = torch.arange(span, device=q.device)[None, :] >= self.prefix_lengths[:, None]
        qs = q.reshape(B, Hkv, G * T, D)
        s_pre = (qs @ kp.transpose(-1, -2)).float() * scale                                 # [B, Hkv, G*T, span]
        s_pre = s_pre.masked_fill(past_end[:, None, None, :], float("-inf"))
        s_self = (qs @ k.transpose(-1, -2)).float() * scale                                # [B, Hkv, G*T, T]
        future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        s_self = s_self.view(B, Hkv, G, T, T).masked_fill(future, float("-inf")).view(B, Hkv, G * T, T)
        a = torch.softmax(torch.cat([s_pre, s_self], -1), -1).to(q.dtype)
        a_pre, a_self = a.split([span, T], -1)
        return AttentionOut((a_pre @ vp + a_self @ v).reshape(B, Hq, T, D))

    def _attend_by_row(self, i, q, k, v, scale, attention):
        """Each row alone on its own suffix length and its own prefix's length (what it computes when scored alone),
        written into zeroed batch-shaped outputs; padded positions get o = 0 and log-sum-exps 0."""
        B, Hq, T, D = q.shape
        Hkv = k.shape[1]
        G = Hq // Hkv
        o, lse = q.new_zeros(B, Hq, T, D), torch.zeros(B, Hq, T, device=q.device)
        o_pre, lse_pre = q.new_zeros(B, Hkv, G, T, D), torch.zeros(B, Hkv, G, T, device=q.device)
        for b, (L, slot) in enumerate(zip(self.lengths, self.host_slots)):
            n = self.bank.host_lengths[slot]
            kp, vp = self.bank.k[i][slot:slot + 1, :, :n], self.bank.v[i][slot:slot + 1, :, :n]
            pre = attention(q[b:b + 1, :, :L].reshape(1, Hkv, G * L, D), kp, vp, False, scale)
            o_pre[b, :, :, :L], lse_pre[b, :, :, :L] = pre[0].view(Hkv, G, L, D), pre[1].view(Hkv, G, L)
            o[b:b + 1, :, :L], lse[b:b + 1, :, :L] = attention(q[b:b + 1, :, :L], k[b:b + 1, :, :L],
                                                               v[b:b + 1, :, :L], True, scale)
        return AttentionOut(o, lse, o_pre.view(B, Hkv, G * T, D), lse_pre.view(B, Hkv, G * T), 1, B)


class HybridForward:
    """Runs the decoder layers of a transformers `Qwen3_5ForCausalLM` with explicit layer states.

    At construction the projections that read the same input are fused into one GEMM each (attention q|k|v, Gated
    DeltaNet qkv|z|b|a, MLP gate|up); the modules' own weights become views into the fused matrices, so memory is
    not doubled and transformers' forward (the oracle) still runs on the same numbers.
    """

    def __init__(self, causal_lm, deterministic: bool = False, readout_weights: Sequence[torch.Tensor] = ()):
        """deterministic: batch-invariant kernels (`engine.kernels.table.select_kernels`); readout_weights: the
        read-out's matrices (the labels' [MAX_OPTIONS, hidden], a vocabulary chunk of the label mass), whose GEMMs the
        deterministic check covers too."""
        self.core = causal_lm.model
        self.cfg = causal_lm.config
        self.eps = self.cfg.rms_norm_eps
        dev = next(causal_lm.parameters()).device
        self.w = [self._layer_weights(layer) for layer in self.core.layers]
        heads = (self.cfg.num_attention_heads, self.cfg.num_key_value_heads,
                 getattr(self.cfg, "head_dim", None) or self.cfg.hidden_size // self.cfg.num_attention_heads)
        self.kernels = select_kernels(dev.type, deterministic, self._gemm_weights(readout_weights), heads)
        self.final_norm_w = 1.0 + self.core.norm.weight.float()
        self.rope = RopeTable(self.core.rotary_emb, min(self.cfg.max_position_embeddings, ROPE_TABLE_POSITIONS),
                              self.core.embed_tokens.weight.dtype, dev)

    @staticmethod
    def _layer_weights(layer) -> dict:
        w = {"in_norm": 1.0 + layer.input_layernorm.weight.float(),
             "post_norm": 1.0 + layer.post_attention_layernorm.weight.float(),
             "mlp_in": _fuse([layer.mlp.gate_proj, layer.mlp.up_proj])}
        if layer.block_type == "linear_attention":
            lin = layer.linear_attn
            w["in_proj"] = _fuse([lin.in_proj_qkv, lin.in_proj_z, lin.in_proj_b, lin.in_proj_a])
            # [C, K] stored tap-major (a K x C matrix, transposed view): the conv kernel loads one tap for all channels
            w["conv"] = lin.conv1d.weight.detach()[:, 0, :].t().contiguous().t()
        else:
            attn = layer.self_attn
            w["qkv"] = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
            w["q_proj"], w["kv_proj"] = w["qkv"].split([attn.q_proj.out_features, 2 * attn.k_proj.out_features])
            w["q_norm"] = 1.0 + attn.q_norm.weight.float()
            w["k_norm"] = 1.0 + attn.k_norm.weight.float()
        return w

    def _gemm_weights(self, readout_weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        # the attention's q|gate and k|v parts too: the answer rows' queries project alone (`ANSWER_QUERIES`)
        fused = [w[name] for w in self.w for name in ("mlp_in", "in_proj", "qkv", "q_proj", "kv_proj") if name in w]
        projections = [m.weight for layer in self.core.layers for m in (layer.mlp.down_proj, self._out_proj(layer))]
        return fused + projections + list(readout_weights)

    @staticmethod
    def _out_proj(layer):
        return layer.linear_attn.out_proj if layer.block_type == "linear_attention" else layer.self_attn.o_proj

    @torch.no_grad()
    def prefix(self, ids: list[int]) -> PrefixState:
        """Run one prefix (batch 1) and return its layer states."""
        dev = self.core.embed_tokens.weight.device
        x = torch.tensor([ids], device=dev)
        rec = _PrefixRecorder(len(ids))
        self.layers(x, torch.arange(len(ids), device=dev)[None], rec)
        return rec.state

    def final_norm(self, hs: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(hs, self.final_norm_w, self.eps)

    def layers(self, ids: torch.Tensor, positions: torch.Tensor, ctx, rows: torch.Tensor | None = None
               ) -> torch.Tensor:
        """ids, positions: [B, T] -> hidden states [B, T, hidden] before the final norm; with rows ([S] int64 indices
        into the B * T tokens, e.g. the answer slots), only those tokens' [S, hidden]. The last layer's MLP, and the
        norms around it, then run on those S rows alone: no later layer reads the other tokens (its token mixing,
        attention or the recurrence, still runs on all of them)."""
        h = self.core.embed_tokens(ids)
        cos, sin = self.rope(h, positions, ids.shape[1] + getattr(ctx, "key_span", 0))   # positions below that
        x = self.kernels.rms_norm(h, self.w[0]["in_norm"], self.eps)
        last = len(self.core.layers) - 1
        fused = FUSED_RESIDUAL and self.kernels.add_linear is not None
        # a batch-invariant table takes one path at every batch size
        min_rows = 1 if self.kernels.batch_invariant else ANSWER_QUERIES_MIN_ROWS
        for i, layer in enumerate(self.core.layers):
            w = self.w[i]
            answer_rows = rows if i == last and rows is not None and ANSWER_ROWS_ONLY else None
            # the token mixer's output before its projection; at the answer rows alone where it can be
            at_rows = (answer_rows is not None and ANSWER_QUERIES and ids.shape[0] >= min_rows
                       and layer.block_type != "linear_attention" and ctx.answers is not None
                       and self.kernels.answer_attention is not None)
            if layer.block_type == "linear_attention":
                y, projection = self._gated_delta_net(layer.linear_attn, w, x, i, ctx)
            else:
                y, projection = self._attention(layer.self_attn, w, x, cos, sin, i, ctx,
                                                answer_rows if at_rows else None)
            x, h = self._add_projected(h, y, projection, w["post_norm"], fused, answer_rows, y_at_rows=at_rows)
            y = self._mlp(layer.mlp, w, x)
            if i == last:
                out = self._add_projected(h, y, layer.mlp.down_proj.weight, None, fused)[1]
                return out if rows is None or ANSWER_ROWS_ONLY else _at_rows(out, rows)
            x, h = self._add_projected(h, y, layer.mlp.down_proj.weight, self.w[i + 1]["in_norm"], fused)

    def _add_projected(self, h, y, projection, norm_w, fused: bool, rows: torch.Tensor | None = None,
                       y_at_rows: bool = False):
        """(the norm with norm_w, the sum) of the residual stream h plus y's projection; norm_w None: (None, the sum);
        rows: of those token rows alone ([S, hidden] each), selected after the projection, or y_at_rows: y is
        already [S, ...], at those rows. Each residual add is fused with the norm that reads its result (one pass over
        the stream, not two), or, fused, with the projection (`FUSED_RESIDUAL`)."""
        if rows is not None and y_at_rows:
            h, rows = _at_rows(h, rows), None
        if fused:
            h = self.kernels.add_linear(h, y, projection)
            h = h if rows is None else _at_rows(h, rows)
            return (None if norm_w is None else self.kernels.rms_norm(h, norm_w, self.eps)), h
        x = self.kernels.linear(y, projection)
        if rows is not None:
            x, h = _at_rows(x, rows), _at_rows(h, rows)
        if norm_w is None:
            return None, h + x
        return self.kernels.add_rms_norm(h, x, norm_w, self.eps)

    def _mlp(self, mlp, w, x):
        """The MLP before its down projection (which `_add_projected` runs)."""
        gate, up = self.kernels.linear(x, w["mlp_in"]).split(mlp.intermediate_size, dim=-1)
        return self.kernels.swiglu(gate, up)

    def _attention(self, attn, w, x, cos, sin, i, ctx, rows: torch.Tensor | None = None):
        """-> (the gated attention output [B, T, Hq * D], the output projection); with rows ([S] tokens), the queries
        and their gate at those rows alone, from their own projection (keys and values still at every token), and the
        output [S, Hq * D] (`ANSWER_QUERIES`)."""
        B, T, _ = x.shape
        D = attn.head_dim
        kv_dim = attn.k_proj.out_features
        if rows is None:
            qg, kv = self.kernels.linear(x, w["qkv"]).split([attn.q_proj.out_features, 2 * kv_dim], dim=-1)
            q_cos = q_sin = None
        else:
            kv = self.kernels.linear(x, w["kv_proj"])
            qg = self.kernels.linear(_at_rows(x, rows), w["q_proj"])[:, None]             # [S, 1, Hq * 2D]
            q_cos, q_sin = _at_rows(cos, rows)[:, None], _at_rows(sin, rows)[:, None]
        k, v = kv.split([kv_dim, kv_dim], dim=-1)
        q, gate = torch.chunk(qg.view(*qg.shape[:2], -1, 2 * D), 2, dim=-1)               # [B, T, Hq, D] each
        q, k = self.kernels.qk_norm_rope(q, k.view(B, T, -1, D), w["q_norm"], w["k_norm"], cos, sin, self.eps,
                                         q_cos=q_cos, q_sin=q_sin)
        v = v.reshape(B, T, -1, D).transpose(1, 2)                                         # q, k, v: [B, H, T, D]
        if rows is None:
            out = ctx.attend_gated(i, q, k, v, attn.scaling, self.kernels, gate)          # [B, T, Hq * D]
        else:
            out = ctx.attend_answers(i, q[:, :, 0], k, v, attn.scaling, self.kernels, gate[:, 0], rows)
        return out, attn.o_proj.weight                                                     # o_proj: `_add_projected`

    def _gated_delta_net(self, lin, w, x, i, ctx):
        B, T, _ = x.shape                                                                  # x: [B, T, hidden]
        K, H = lin.conv_kernel_size, lin.num_v_heads
        # qkv: [B, T, 2 * key_dim + value_dim] (conv channels C); z: [B, T, value_dim]; b, a: [B, T, Hv]
        qkv, z, gates = self.kernels.linear(x, w["in_proj"]).split([lin.conv_dim, lin.value_dim, 2 * H], dim=-1)
        if ctx.records:
            ctx.keep("conv", i, _last_inputs(qkv, K - 1))                                  # [B, C, K-1]
        # q, k: [B, T, Hk, Dk] L2-normalised per head; v: [B, T, Hv, Dv]; b, a: [B, T, Hv], out of the same pass
        (prev, prev_index), (rec, rec_index) = ctx.conv_prev(i), ctx.rec_prev(i)
        conv_args = (qkv, w["conv"], prev, lin.key_dim, lin.head_k_dim, lin.head_v_dim, gates, prev_index)
        if self.kernels.conv_decay is not None and rec_index is not None and not ctx.records:
            # a suffix pass from the bank: beta and the decay (for a, b) out of the conv's pass (`Kernels.conv_decay`)
            q, k, v, beta, g = self.kernels.conv_decay(*conv_args, lin.A_log, lin.dt_bias)
            out, final = self.kernels.decayed_delta_rule(q, k, v, g, beta, rec, rec_index), None
        else:
            q, k, v, b, a = self.kernels.conv_qkv(*conv_args)
            out, final = self.kernels.delta_rule(q, k, v, a, b, lin.A_log, lin.dt_bias, rec, ctx.records, rec_index)
        if final is not None:        # out: [B, T, Hv, Dv]; final: [B, Hv, Dk, Dv] float32 when the context records it
            ctx.keep("rec", i, final)
        out = self.kernels.gated_rms_norm(out, z.view(B, T, H, lin.head_v_dim), lin.norm.weight,
                                          lin.norm.variance_epsilon)                       # [B, T, Hv, Dv]
        return out.reshape(B, T, -1), lin.out_proj.weight                                  # out_proj: `_add_projected`


def _fuse(linears) -> torch.Tensor:
    """One weight matrix for several bias-free Linears reading the same input; each module's weight becomes a view."""
    fused = torch.cat([m.weight.detach() for m in linears])
    row = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = fused[row:row + n]
        row += n
    return fused


def _last_inputs(x: torch.Tensor, n: int) -> torch.Tensor:
    """[B, T, C] -> [B, C, n]: the last n time steps (zero-padded on the left when T < n), the conv's carried state."""
    tail = x[:, -n:, :].transpose(1, 2)
    return F.pad(tail, (n - tail.shape[-1], 0))


def _at_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[B, T, C] -> [S, C]: the tokens at rows ([S] indices into the B * T tokens)."""
    # indexing, not `index_select`: on CUDA the latter's kernel for up to 16 indices (a batch of 1's answer rows) took
    # 7-10 us a call where indexing's gather takes ~2 (bench/README.md, run EN: batch 1 2.278 -> 2.230 ms, same bits)
    return x.reshape(-1, x.shape[-1])[rows]
