"""The Qwen3.5 hybrid forward, written for scoring against a cached prefix.

transformers' modules hold the weights (names match the checkpoint: `model.layers.N.linear_attn.in_proj_qkv`, ...) and
compute embeddings and the RoPE angles; norms (with the residual adds and RoPE fused in), the causal conv, the delta
rule, SwiGLU and the attention's merge and output gate come from the kernel table `engine.kernels.select_kernels`
picks (fla's and `engine.triton_kernels`' fused Triton kernels on CUDA, transformers' exact PyTorch formulas
elsewhere); the attention calls and layouts from `engine.attention`; this file owns the order of
operations, the fused projections and the layer states, so that:

- a *prefix pass* (one prefix, batch 1) returns each layer's state: K/V (after RoPE) for full-attention layers, the
  last K-1 conv inputs and the recurrent state for Gated DeltaNet layers (`PrefixState`);
- a *suffix pass* continues R x P rows from P shared prefixes without writing to them and without copying the prefix
  K/V into every row: all rows' queries attend to the one prefix K/V in a single fused attention call per layer,
  merged with the causal suffix attention by log-sum-exp.

Rows are ordered r * P + p: request r, prefix p (P = 1 packed, P = n_questions independent).  Rows are right-padded;
everything here is causal, so padding after a row's last real token never reaches that row's slots.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.attention import AttentionOut, prefix_major, row_major
from engine.kernels import select_kernels


@dataclass
class PrefixState:
    """Read-only layer states of P prefixes (right-padded to the longest, `tpmax` tokens)."""
    lengths: list[int]
    k: dict[int, torch.Tensor] = field(default_factory=dict)      # layer -> [P, Hkv, tpmax, D]
    v: dict[int, torch.Tensor] = field(default_factory=dict)      # layer -> [P, Hkv, tpmax, D]
    conv: dict[int, torch.Tensor] = field(default_factory=dict)   # layer -> [P, C, K-1]: the last K-1 inputs
    rec: dict[int, torch.Tensor] = field(default_factory=dict)    # layer -> [P, Hv, Dk, Dv]
    key_bias: torch.Tensor | None = None                          # [P, tpmax]: 0 on a prefix's tokens, -inf past its end

    @property
    def P(self) -> int:
        return len(self.lengths)

    @property
    def tpmax(self) -> int:
        return max(self.lengths)

    @property
    def nbytes(self) -> int:
        tensors = [*self.k.values(), *self.v.values(), *self.conv.values(), *self.rec.values(), self.key_bias]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    @staticmethod
    def stack(parts: list["PrefixState"]) -> "PrefixState":
        """One state for several single prefixes: K/V right-padded to the longest; the key bias hides the padding."""
        lengths = [p.lengths[0] for p in parts]
        tpmax = max(lengths)
        pad = lambda t: F.pad(t, (0, 0, 0, tpmax - t.shape[2]))
        out = PrefixState(lengths=lengths)
        for name in ("k", "v"):
            getattr(out, name).update({i: torch.cat([pad(getattr(p, name)[i]) for p in parts]) for i in parts[0].k})
        for name in ("conv", "rec"):
            getattr(out, name).update({i: torch.cat([getattr(p, name)[i] for p in parts]) for i in getattr(parts[0], name)})
        dev = next(iter(parts[0].rec.values())).device if parts[0].rec else "cpu"
        bias = torch.zeros(len(parts), tpmax, device=dev)
        for j, n in enumerate(lengths):
            bias[j, n:] = float("-inf")
        out.key_bias = bias
        return out


class CausalContext:
    """Context of a whole-prompt pass with no cache: plain causal attention, no state kept (the `full_fast` path)."""

    records = False   # whether the pass keeps the layer states (`keep`): only a prefix pass does

    def conv_prev(self, i):
        return None

    def rec_prev(self, i):
        return None

    def attend(self, i, q, k, v, scale, kernels) -> "AttentionOut":
        return AttentionOut(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True))


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
    """Context of a suffix pass over R * P rows continuing `prefix`; build it once per (R, T) shape (graphs keep it)."""

    records = False

    def __init__(self, prefix: PrefixState, R: int, T: int, device, lengths: list[int] | None = None):
        """lengths: each request's suffix length (<= T); given, attention runs one request at a time on its own length
        (`Kernels.attend_by_request`), so that no kernel sees the batch's padded length or row count."""
        self.prefix, self.R, self.P, self.T, self.lengths = prefix, R, prefix.P, T, lengths
        lengths = torch.tensor(prefix.lengths, device=device)
        self.positions = (lengths.repeat(R)[:, None] + torch.arange(T, device=device)[None, :]).contiguous()   # [B, T]
        # Prefixes of one length (always, packed) need no mask: the fused, merged path; so do unequal ones where the
        # table's attention takes key lengths (`Kernels.ragged_prefixes`). Else explicit scores.
        self.uniform_prefix = len(set(prefix.lengths)) == 1
        self.key_lengths = lengths.to(torch.int32)                                                        # [P]
        if not self.uniform_prefix:
            causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
            self.self_bias = torch.zeros(T, T, device=device).masked_fill(~causal, float("-inf"))            # [T, T]

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        # [P, ...] -> [R * P, ...] in row order r * P + p
        return t.expand(self.R, *t.shape[1:]) if self.P == 1 else t.repeat(self.R, *([1] * (t.dim() - 1)))

    def conv_prev(self, i):
        return self._rows(self.prefix.conv[i])                                             # [R*P, C, K-1]

    def rec_prev(self, i):
        # fla's recurrence reads the initial state as a dense [B, Hv, Dk, Dv] block; `_rows` may be a stride-0 view
        return self._rows(self.prefix.rec[i]).contiguous()                                 # [R*P, Hv, Dk, Dv]

    def attend(self, i, q, k, v, scale, kernels):
        """q: [B, Hq, T, D]; k, v: [B, Hkv, T, D] (this suffix). Softmax over [own prefix keys | causal suffix keys]."""
        if self.lengths is not None:
            return self._attend_by_request(i, q, k, v, scale, kernels.attention)
        if self.uniform_prefix:
            return self._attend_merged(i, q, k, v, scale, self.R, kernels.attention, None)
        if kernels.ragged_prefixes:
            return self._attend_merged(i, q, k, v, scale, self.R, kernels.attention, self.key_lengths)
        return self._attend_masked(i, q, k, v, scale, self.R)

    def _attend_merged(self, i, q, k, v, scale, R, attention, key_lengths):
        """Two fused attention calls, merged later by their log-sum-exps: the prefix part runs every row's queries
        against the one shared prefix K/V (no copies; prefixes of unequal lengths masked by `key_lengths`), the
        suffix part is plain causal attention."""
        B, Hq, T, D = q.shape
        Hkv = k.shape[1]
        G = Hq // Hkv
        qp = prefix_major(q.reshape(B, Hkv, G * T, D), R, self.P)                         # [P, Hkv, R*G*T, D]
        o_pre, lse_pre = attention(qp, self.prefix.k[i], self.prefix.v[i], False, scale, key_lengths)
        o_self, lse_self = attention(q, k, v, True, scale)                               # head h reads kv head h // G
        return AttentionOut(o_self, lse_self, o_pre, lse_pre, R, self.P)

    def _attend_masked(self, i, q, k, v, scale, R):
        """Prefixes of unequal lengths (independent mode): explicit scores, padded prefix keys masked out."""
        B, Hq, T, D = q.shape
        Hkv = k.shape[1]
        G = Hq // Hkv
        kp, vp = self.prefix.k[i], self.prefix.v[i]                                       # [P, Hkv, Tp, D]
        Tp = kp.shape[2]
        qs = q.reshape(B, Hkv, G * T, D)
        s_pre = (prefix_major(qs, R, self.P) @ kp.transpose(-1, -2)).float() * scale
        s_pre = row_major(s_pre + self.prefix.key_bias[:, None, None, :], R)              # [B, Hkv, G*T, Tp]
        s_self = (qs @ k.transpose(-1, -2)).float() * scale                                # [B, Hkv, G*T, T]
        s_self = (s_self.view(B, Hkv, G, T, T) + self.self_bias[:T, :T]).view(B, Hkv, G * T, T)
        a = torch.softmax(torch.cat([s_pre, s_self], -1), -1).to(q.dtype)
        a_pre, a_self = a.split([Tp, T], -1)
        o_pre = row_major(prefix_major(a_pre, R, self.P) @ vp, R)                         # [B, Hkv, G*T, D]
        return AttentionOut((o_pre + a_self @ v).reshape(B, Hq, T, D))

    def _attend_by_request(self, i, q, k, v, scale, attention):
        """Each request's P rows alone on their own L tokens (what the request computes when it is scored alone),
        written into zeroed batch-shaped outputs; padded positions get o = 0 and log-sum-exps 0."""
        B, Hq, T, D = q.shape
        Hkv, P, R = k.shape[1], self.P, self.R
        G = Hq // Hkv
        o = q.new_zeros(B, Hq, T, D)
        if not self.uniform_prefix:
            for r, L in enumerate(self.lengths):
                rows = slice(r * P, (r + 1) * P)
                o[rows, :, :L] = self._attend_masked(i, q[rows, :, :L], k[rows, :, :L], v[rows, :, :L], scale, 1).o
            return AttentionOut(o)
        lse = torch.zeros(B, Hq, T, device=q.device)
        o_pre = q.new_zeros(P, Hkv, R * G * T, D)                                          # prefix-major, as merged
        lse_pre = torch.zeros(P, Hkv, R * G * T, device=q.device)
        o_pre_r = o_pre.view(P, Hkv, R, G, T, D)
        lse_pre_r = lse_pre.view(P, Hkv, R, G, T)
        for r, L in enumerate(self.lengths):
            rows = slice(r * P, (r + 1) * P)
            a = self._attend_merged(i, q[rows, :, :L], k[rows, :, :L], v[rows, :, :L], scale, 1, attention, None)
            o[rows, :, :L], lse[rows, :, :L] = a.o, a.lse
            o_pre_r[:, :, r, :, :L] = a.o_pre.view(P, Hkv, G, L, D)
            lse_pre_r[:, :, r, :, :L] = a.lse_pre.view(P, Hkv, G, L)
        return AttentionOut(o, lse, o_pre, lse_pre, R, P)


class HybridForward:
    """Runs the decoder layers of a transformers `Qwen3_5ForCausalLM` with explicit layer states.

    At construction the projections that read the same input are fused into one GEMM each (attention q|k|v, Gated
    DeltaNet qkv|z|b|a, MLP gate|up); the modules' own weights become views into the fused matrices, so memory is
    not doubled and transformers' forward (the oracle) still runs on the same numbers.
    """

    def __init__(self, causal_lm, deterministic: bool = False, label_weight: torch.Tensor | None = None):
        """deterministic: batch-invariant kernels (`engine.kernels.select_kernels`); label_weight: the read-out's
        [MAX_OPTIONS, hidden] matrix, whose GEMM the deterministic check covers too."""
        self.core = causal_lm.model
        self.cfg = causal_lm.config
        self.eps = self.cfg.rms_norm_eps
        dev = next(causal_lm.parameters()).device
        self.w = [self._layer_weights(layer) for layer in self.core.layers]
        self.kernels = select_kernels(dev.type, deterministic, self._gemm_weights(label_weight))
        self.final_norm_w = 1.0 + self.core.norm.weight.float()

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
            w["q_norm"] = 1.0 + attn.q_norm.weight.float()
            w["k_norm"] = 1.0 + attn.k_norm.weight.float()
        return w

    def _gemm_weights(self, label_weight: torch.Tensor | None) -> list[torch.Tensor]:
        fused = [w[name] for w in self.w for name in ("mlp_in", "in_proj", "qkv") if name in w]
        projections = [m.weight for layer in self.core.layers for m in (layer.mlp.down_proj, self._out_proj(layer))]
        return fused + projections + ([label_weight] if label_weight is not None else [])

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

    def layers(self, ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """ids, positions: [B, T] -> hidden states [B, T, hidden] before the final norm."""
        h = self.core.embed_tokens(ids)
        cos, sin = self.core.rotary_emb(h, positions[None].expand(3, -1, -1))
        x = self.kernels.rms_norm(h, self.w[0]["in_norm"], self.eps)
        last = len(self.core.layers) - 1
        # Each residual add is fused with the norm that reads its result (one pass over the stream, not two).
        for i, layer in enumerate(self.core.layers):
            w = self.w[i]
            if layer.block_type == "linear_attention":
                x = self._gated_delta_net(layer.linear_attn, w, x, i, ctx)
            else:
                x = self._attention(layer.self_attn, w, x, cos, sin, i, ctx)
            x, h = self.kernels.add_rms_norm(h, x, w["post_norm"], self.eps)
            x = self._mlp(layer.mlp, w, x)
            if i == last:
                return h + x
            x, h = self.kernels.add_rms_norm(h, x, self.w[i + 1]["in_norm"], self.eps)

    def _mlp(self, mlp, w, x):
        gate_up = self.kernels.linear(x, w["mlp_in"])
        if self.kernels.mlp_down is not None:
            return self.kernels.mlp_down(gate_up, mlp.down_proj.weight)
        gate, up = gate_up.split(mlp.intermediate_size, dim=-1)
        return self.kernels.linear(self.kernels.swiglu(gate, up), mlp.down_proj.weight)

    def _attention(self, attn, w, x, cos, sin, i, ctx):
        B, T, _ = x.shape
        D = attn.head_dim
        q_dim, kv_dim = attn.q_proj.out_features, attn.k_proj.out_features
        qg, k, v = self.kernels.linear(x, w["qkv"]).split([q_dim, kv_dim, kv_dim], dim=-1)
        q, gate = torch.chunk(qg.view(B, T, -1, 2 * D), 2, dim=-1)                         # [B, T, Hq, D] each
        q, k = self.kernels.qk_norm_rope(q, k.view(B, T, -1, D), w["q_norm"], w["k_norm"], cos, sin, self.eps)
        v = v.reshape(B, T, -1, D).transpose(1, 2)                                         # q, k, v: [B, H, T, D]
        out = self.kernels.gate_attention(ctx.attend(i, q, k, v, attn.scaling, self.kernels), gate)       # [B, T, Hq * D]
        return self.kernels.linear(out, attn.o_proj.weight)

    def _gated_delta_net(self, lin, w, x, i, ctx):
        B, T, _ = x.shape                                                                  # x: [B, T, hidden]
        K = lin.conv_kernel_size
        H = lin.num_v_heads
        # qkv: [B, T, 2 * key_dim + value_dim] (conv channels C); z: [B, T, value_dim]; b, a: [B, T, Hv]
        qkv, z, b, a = self.kernels.linear(x, w["in_proj"]).split([lin.conv_dim, lin.value_dim, H, H], dim=-1)
        if ctx.records:
            ctx.keep("conv", i, _last_inputs(qkv, K - 1))                                  # [B, C, K-1]
        # q, k: [B, T, Hk, Dk] L2-normalised per head; v: [B, T, Hv, Dv]
        q, k, v = self.kernels.conv_qkv(qkv, w["conv"], ctx.conv_prev(i), lin.key_dim, lin.head_k_dim,
                                        lin.head_v_dim)
        # out: [B, T, Hv, Dv]; final: [B, Hv, Dk, Dv] float32 when the context records it, else None
        out, final = self.kernels.delta_rule(q, k, v, a, b, lin.A_log, lin.dt_bias, ctx.rec_prev(i), ctx.records)
        if final is not None:
            ctx.keep("rec", i, final)
        out = self.kernels.gated_rms_norm(out, z.view(B, T, H, lin.head_v_dim), lin.norm.weight,
                                          lin.norm.variance_epsilon)                       # [B, T, Hv, Dv]
        return self.kernels.linear(out.reshape(B, T, -1), lin.out_proj.weight)            # [B, T, hidden]


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
