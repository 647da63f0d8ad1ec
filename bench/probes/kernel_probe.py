"""Kernel-level probes on the GPU for the choices the engine profile raises (not a benchmark of the product).

For the 0.8B shape at one batch (default 32 rows of a 144-token suffix), times in isolation:
- `conv_qkv` at several (tokens per program, warps) launch configurations, against the memory-speed floor of the
  same bytes (one contiguous copy of the conv channels);
- the suffix attention's fused flash call on grouped K/V heads directly against `repeat_interleave`d heads
  (does the CUDA op accept Hkv < Hq, and does it give the same numbers);
- the copy of a prefix's recurrent state expanded to every row (what fla's contiguity check forces);
- the suffix pass's delta rule: fla's `chunk_gated_delta_rule` from per-row copies of the bank's states (the copy
  included) against `delta_rule_indexed` at each of fla's candidate state-kernel configurations, with its max |diff|,
  and with its output computed by fla's kernel or in the state kernel's pass (`FUSED_OUTPUT`);
- the prefix half of the attention (`indexed_attention`) at each query-block size, with the block count;
- the suffix pass's whole attention: the split path's three launches against the one-kernel `suffix_attention`;
- fla's autotuned WY kernels (K K^T + solve, w/u) at each candidate configuration, beside the one fla tuned, then
  this tree's (the merged solve, w/u, and the two in one launch) at the engine's launches.

    python bench/probes/kernel_probe.py [--batch 32] [--tokens 144] [--only delta,prefix] > probe.txt
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))      # this checkout's engine, whatever PYTHONPATH says
from bench.probes.variant_ab import patched  # noqa: E402
from engine.kernels import causal_conv  # noqa: E402
from engine.kernels import fused as tk  # noqa: E402

# Qwen3.5-0.8B: Gated DeltaNet 16 k heads x 128, 16 v heads x 128, conv width 4; attention 8 q heads, 2 kv heads, 256
HK, DK, HV, DV, KW = 16, 128, 16, 128, 4
FUSED = 2 * HK * DK + 2 * HV * DV + 2 * HV          # qkv | z | b | a: the in_proj row the conv reads a view of
HQ, HKV, DA = 8, 2, 256


def gpu_ms(fn, iters: int = 50, warmup: int = 3, flush: torch.Tensor | None = None, graph: bool = False) -> float:
    """Median GPU milliseconds of fn() over `iters` runs, after `warmup` calls (compilation); flush: a buffer zeroed
    before each run (one larger than L2 evicts what the last run left there). graph: fn captured in a CUDA graph and
    its replays timed, so that the launches' CPU time (tens of microseconds each, from Python) is not counted where
    the kernels are shorter, as a scoring step's replay does not count it."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
        fn()
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def conv_launch(x, weight, prev, slots, gates, BT: int, warps: int):
    B, T, C = x.shape
    q, k, v = (torch.empty(B, T, H, D, dtype=x.dtype, device=x.device) for H, D in ((HK, DK), (HK, DK), (HV, DV)))
    beta, alpha = (torch.empty(B, T, HV, dtype=x.dtype, device=x.device) for _ in range(2))
    causal_conv._conv_qkv_kernel[(triton.cdiv(T, BT), 2 * HK + HV, B)](
        x, weight, prev, slots, gates, q, k, v, beta, alpha, T, x.stride(0), x.stride(1), weight.stride(0),
        weight.stride(1), *prev.stride(), gates.stride(0), gates.stride(1), 1e-6, HK=HK, HV=HV, DK=DK, DV=DV, KW=KW,
        BT=BT, BD=128, NG=HV, BG=2 * HV, HAS_PREV=True, HAS_INDEX=True, num_warps=warps)
    return q, k, v, beta, alpha


def probe_conv(B: int, T: int) -> dict:
    dev = "cuda"
    proj = torch.randn(B, T, FUSED, device=dev, dtype=torch.bfloat16)
    x = proj[..., :2 * HK * DK + HV * DV]
    weight = torch.randn(x.shape[-1], KW, device=dev, dtype=torch.bfloat16).t().contiguous().t()
    gates = proj[..., FUSED - 2 * HV:]
    # the prefix bank's conv states, one live slot read by every row (the suffix pass's case), stored time-major as
    # the bank stores them (`engine.prefix_bank.CONV_TIME_MAJOR`)
    prev = torch.randn(4, KW - 1, x.shape[-1], device=dev, dtype=torch.bfloat16).transpose(1, 2)
    slots = torch.full((B,), 1, dtype=torch.int64, device=dev)
    conv = lambda: causal_conv.conv_qkv(x, weight, prev, HK * DK, DK, DV, gates, slots)  # noqa: E731
    ref = conv()
    dense = torch.empty(x.shape, dtype=x.dtype, device=dev)
    out = {"shape": [B, T, x.shape[-1]], "bytes_moved_mb": 2 * x.numel() * 2 / 1e6,
           "copy_floor_ms": gpu_ms(lambda: dense.copy_(x)), "default_ms": gpu_ms(conv), "configs": []}
    for BT, warps in itertools.product((4, 8, 16, 32, 64, 128), (1, 2, 4, 8)):
        if BT * 128 // (32 * warps) > 512:      # too many elements per thread to be worth compiling
            continue
        try:
            got = conv_launch(x, weight, prev, slots, gates, BT, warps)
            same = all(torch.equal(a, b) for a, b in zip(got, ref))
            ms = gpu_ms(lambda: conv_launch(x, weight, prev, slots, gates, BT, warps))
            out["configs"].append(dict(BT=BT, warps=warps, ms=round(ms, 4), same=same))
        except Exception as exc:  # report and go on: a config the compiler rejects is an answer too
            out["configs"].append(dict(BT=BT, warps=warps, error=repr(exc)[:200]))
    return out


def probe_gqa(B: int, T: int) -> dict:
    op = torch.ops.aten._scaled_dot_product_flash_attention
    q = torch.randn(B, HQ, T, DA, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, HKV, T, DA, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    G = HQ // HKV

    def repeated():
        return op(q, k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1), 0.0, True, False, scale=DA ** -0.5)

    def grouped():
        return op(q, k, v, 0.0, True, False, scale=DA ** -0.5)

    out = {"repeated_ms": gpu_ms(repeated)}
    try:
        (o1, l1), (o2, l2) = repeated()[:2], grouped()[:2]
        out.update(grouped_ms=gpu_ms(grouped), out_max_diff=(o1.float() - o2.float()).abs().max().item(),
                   lse_max_diff=(l1 - l2).abs().max().item())
    except Exception as exc:
        out["grouped_error"] = repr(exc)[:300]
    return out


def probe_state_copy(B: int) -> dict:
    state = torch.randn(1, HV, DK, DV, device="cuda", dtype=torch.float32)
    return {"rows": B, "mb_written": B * state.numel() * 4 / 1e6,
            "expand_contiguous_ms": gpu_ms(lambda: state.expand(B, -1, -1, -1).contiguous())}


def _delta_rule_inputs(B: int, T: int) -> tuple[torch.Tensor, ...]:
    """Random inputs of a Gated DeltaNet layer at the 0.8B shape, on CUDA: q, k (L2-normalised), v, a, b, A_log,
    dt_bias."""
    dev, dt = "cuda", torch.bfloat16
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, HK, DK, device=dev), dim=-1).to(dt) for _ in range(2))
    v = torch.randn(B, T, HV, DV, device=dev, dtype=dt)
    a, b = (torch.randn(B, T, HV, device=dev, dtype=dt) for _ in range(2))
    return q, k, v, a, b, torch.randn(HV, device=dev), torch.randn(HV, device=dev)


def probe_delta_rule(B: int, T: int, slots_live: int = 4) -> dict:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from engine.kernels.cuda_fast import delta_rule_indexed

    dev = "cuda"
    q, k, v, a, b, A_log, dt_bias = _delta_rule_inputs(B, T)
    bank = torch.randn(slots_live, HV, DK, DV, device=dev) * 0.5
    slots = torch.full((B,), 1, dtype=torch.int64, device=dev)     # one schema: every row continues slot 1

    def copied():
        return chunk_gated_delta_rule(q, k, v, g=a, beta=b, initial_state=bank.index_select(0, slots),
                                      use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                      use_beta_sigmoid_in_kernel=True)[0]

    ref = copied()
    out = {"rows": B, "tokens": T, "fla_copied_ms": round(gpu_ms(copied), 4), "indexed": []}
    run = lambda: delta_rule_indexed(q, k, v, a, b, A_log, dt_bias, bank, slots)  # noqa: E731
    for cfg in itertools.product((32, 64), (2, 4), (2, 3, 4)):
        # the sweep is of the separate state kernel
        settings = [("engine.kernels.cuda_fast", "FUSED_OUTPUT", False),
                    ("engine.kernels.indexed_delta_rule", "FWD_H_CONFIG", cfg)]
        with patched(settings):
            try:
                got = run()
                out["indexed"].append(dict(config=cfg, ms=round(gpu_ms(run), 4), exact=torch.equal(got, ref),
                                           max_diff=(got.float() - ref.float()).abs().max().item()))
            except Exception as exc:  # a config the compiler rejects is an answer too
                out["indexed"].append(dict(config=cfg, error=repr(exc)[:200]))
    for on in (False, True):
        with patched([("engine.kernels.cuda_fast", "FUSED_OUTPUT", on)]):
            got = run()
            out["fused_output" if on else "separate_output"] = dict(
                ms=round(gpu_ms(run), 4), max_diff=(got.float() - ref.float()).abs().max().item())
    return out


def probe_prefix_attention(B: int, T: int, prefix: int = 400) -> dict:
    from engine.kernels import cuda_deterministic as bi

    dev, dt = "cuda", torch.bfloat16
    G = HQ // HKV
    q = torch.randn(B, HKV, G * T, DA, device=dev, dtype=dt)
    bank_k, bank_v = (torch.randn(4, HKV, 512, DA, device=dev, dtype=dt) for _ in range(2))
    lengths = torch.full((4,), prefix, dtype=torch.int32, device=dev)
    slots = torch.full((B,), 1, dtype=torch.int64, device=dev)
    ref = bi.indexed_attention(q, bank_k, bank_v, DA ** -0.5, lengths, slots)
    out = {"rows": B, "query_rows": G * T, "prefix": prefix, "configs": []}
    for block_m, warps in ((128, 8), (64, 4), (32, 4), (32, 2)):
        run = lambda: bi.attention(q, bank_k, bank_v, False, DA ** -0.5, lengths, slots,  # noqa: E731
                                   block_m=block_m, warps=warps)
        got = run()
        out["configs"].append(dict(block_m=block_m, warps=warps, blocks=triton.cdiv(G * T, block_m) * B * HKV,
                                   ms=round(gpu_ms(run), 4), same=torch.equal(got[0], ref[0])))
    return out


def probe_suffix_attention(B: int, T: int, prefix: int = 400) -> dict:
    """The suffix pass's attention: the split path's three launches (prefix half from the bank, causal half by torch's
    flash op, their merge with the output gate) against `engine.kernels.suffix_attention` at several launch
    configurations, each with its max |diff| from the split path and whether it gives `CONFIG`'s bits."""
    from engine.kernels import cuda_deterministic as bi
    from engine.kernels import suffix_attention as sa
    from engine.kernels.attention import AttentionOut, sdpa_with_lse

    dev, dt = "cuda", torch.bfloat16
    G = HQ // HKV
    scale = DA ** -0.5
    q = torch.randn(B, HQ, T, DA, device=dev, dtype=dt)
    k = torch.randn(B, HKV, T, DA, device=dev, dtype=dt)
    v = torch.randn(B, T, HKV, 2 * DA, device=dev, dtype=dt)[..., DA:].transpose(1, 2)     # a strided view
    gate = torch.chunk(torch.randn(B, T, HQ, 2 * DA, device=dev, dtype=dt), 2, dim=-1)[1]
    bank_k, bank_v = (torch.randn(4, HKV, 512, DA, device=dev, dtype=dt) for _ in range(2))
    lengths = torch.full((4,), prefix, dtype=torch.int32, device=dev)
    slots = torch.full((B,), 1, dtype=torch.int64, device=dev)
    halves = {}

    def prefix_half():
        halves["pre"] = bi.indexed_attention(q.reshape(B, HKV, G * T, DA), bank_k, bank_v, scale, lengths, slots)

    def causal_half():
        halves["self"] = sdpa_with_lse(q, k, v, True, scale)

    def merge_gate():
        o, lse = halves["self"]
        return tk.gate_attention(AttentionOut(o, lse, *halves["pre"], 1, B), gate)

    prefix_half(), causal_half()
    ref = merge_gate()
    launches = (("prefix_half", prefix_half), ("causal_half", causal_half), ("merge_gate", merge_gate))
    split_ms = {name: round(gpu_ms(fn, graph=True), 4) for name, fn in launches}
    out = {"rows": B, "tokens": T, "prefix": prefix, "split_ms": split_ms, "configs": []}
    print(json.dumps(out), file=sys.stderr, flush=True)
    run = lambda: sa.suffix_attention(q, k, v, bank_k, bank_v, lengths, slots, gate, scale)  # noqa: E731
    large = sa.suffix_attention(q, k, v, bank_k, bank_v, lengths, slots, gate, scale, configs=(sa.CONFIG, None))
    # the last two: the batch-invariant table's 64-row launch at D splits 2 and 4 (`suffix_attention.launch`)
    for config in ((64, 64, 8, 2), (128, 64, 8, 2), (128, 32, 8, 2), (128, 32, 8, 3), (64, 32, 4, 2), (32, 64, 4, 2),
                   (16, 64, 4, 2), (16, 32, 2, 2), (64, 64, 4, 2), (64, 64, 4, 2, 2), (64, 64, 4, 2, 4)):
        # FILL_PROGRAMS 0: this launch at every batch size
        with patched([("engine.kernels.suffix_attention", "CONFIG", config),
                      ("engine.kernels.suffix_attention", "FILL_PROGRAMS", 0)]):
            try:
                got = run()
                row = dict(config=config, ms=round(gpu_ms(run, graph=True), 4), max_diff=(got - ref).abs().max().item(),
                           same_bits_as_config=torch.equal(got, large))
            except Exception as exc:  # noqa: BLE001 - a configuration the GPU refuses
                row = dict(config=config, error=f"{type(exc).__name__}: {str(exc)[:200]}")
        print(json.dumps(row), file=sys.stderr, flush=True)
        out["configs"].append(row)
    return out


def probe_wy(B: int, T: int, prefix: int = 400) -> dict:
    """fla's two autotuned WY kernels (the fused K K^T + triangular solve, and w/u) at each of their candidate
    configurations, at this batch. fla's autotune key holds neither the batch nor the length, so the configuration
    it keeps is the one it tuned at its first call: in the engine, a prefix pass (1 row of about `prefix` tokens),
    emulated here before the timings; whether that one suits batch 1 and batch 128 steps is the question."""
    from fla.ops.gated_delta_rule import chunk_fwd, wy_fast
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.gated_delta_rule.gate import gdn_gate_chunk_cumsum
    from fla.ops.utils.constant import RCP_LN2

    from engine.kernels.cuda_fast import solve_into, w_u_into

    dev, dt = "cuda", torch.bfloat16

    def inputs(rows, tokens):
        _, k, v, a, _, A_log, dt_bias = _delta_rule_inputs(rows, tokens)
        beta = torch.rand(rows, tokens, HV, device=dev, dtype=dt)
        return k, v, beta, gdn_gate_chunk_cumsum(g=a, A_log=A_log, chunk_size=64, scale=RCP_LN2, dt_bias=dt_bias)

    k, v, beta, g = inputs(1, prefix)
    chunk_gated_delta_rule_fwd_intra(k, v, g=g, beta=beta, chunk_size=64)          # fla tunes here
    kkt, wu = chunk_fwd.chunk_gated_delta_rule_fwd_kkt_solve_kernel, wy_fast.recompute_w_u_fwd_kernel
    out = {"rows": B, "tokens": T, "tuned_at": [1, prefix],
           "tuned": {name: {str(key): str(cfg) for key, cfg in getattr(k_.fn, "cache", {}).items()}
                     for name, k_ in (("kkt_solve", kkt), ("recompute_w_u", wu))}, "kkt_solve": [], "recompute_w_u": []}
    print(json.dumps(out["tuned"]), file=sys.stderr, flush=True)
    k, v, beta, g = inputs(B, T)
    A = torch.zeros(B, T, HV, 64, device=dev, dtype=dt)
    for BK, warps in itertools.product((32, 64), (1, 2, 4)):
        row = dict(BK=BK, warps=warps, ms=round(gpu_ms(lambda: solve_into(A, k, g, beta, (BK, warps)), graph=True), 4))
        print(json.dumps({"kkt_solve": row}), file=sys.stderr, flush=True)
        out["kkt_solve"].append(row)
    w = torch.empty(B, T, HV, DK, device=dev, dtype=dt)
    u = torch.empty(B, T, HV, DV, device=dev, dtype=dt)
    for warps, stages in itertools.product((2, 4, 8), (2, 3, 4)):
        run = lambda: w_u_into(w, u, k, v, beta, A, g, (warps, stages))  # noqa: E731
        row = dict(warps=warps, stages=stages, ms=round(gpu_ms(run, graph=True), 4))
        print(json.dumps({"recompute_w_u": row}), file=sys.stderr, flush=True)
        out["recompute_w_u"].append(row)
    out["this_tree"] = _wy_this_tree(k, v, beta, g, A, w, u)
    return out


def _wy_this_tree(k, v, beta, g, A, w, u) -> list[dict]:
    """The engine's own WY kernels (`engine.kernels.delta_rule_inputs`) at its launches: the merged solve alone, w/u
    alone (both at the small grids' launches), and the two in one launch (the small-grid path), so that the one
    launch's time splits into its parts."""
    from engine.kernels import cuda_fast, delta_rule_inputs as dri

    chunk, (solve, w_u), small = cuda_fast.CHUNK, cuda_fast.WY_SMALL_LAUNCH, cuda_fast.FUSED_WY_SMALL_LAUNCH
    runs = {"merged_solve": lambda: dri.solve_into(A, k, g, beta, chunk, solve),
            "w_u": lambda: dri.w_u_into(w, u, k, v, beta, A, g, chunk, w_u),
            "solve_w_u": lambda: dri.solve_w_u_into(w, u, A, k, v, g, beta, chunk, small)}
    rows = []
    for name, run in runs.items():
        rows.append({"kernel": name, "ms": round(gpu_ms(run, graph=True), 4)})
        print(json.dumps({"this_tree": rows[-1]}), file=sys.stderr, flush=True)
    return rows


def probe_fla_launches(B: int, T: int) -> dict:
    """fla's whole Gated DeltaNet forward (a prefix pass; `full_fast`'s layers) at B rows of T tokens: the launches
    fla's autotuner picks for the kernels `engine.kernels.cuda_fast` pins, and the forward's time autotuned and
    pinned."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from engine.kernels import cuda_fast

    q, k, v, a, b, A_log, dt_bias = _delta_rule_inputs(B, T)
    h0 = torch.randn(B, HV, DK, DV, device="cuda") * 0.1
    run = lambda: chunk_gated_delta_rule(q, k, v, g=a, beta=b, initial_state=h0, output_final_state=True,  # noqa
                                         use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                         use_beta_sigmoid_in_kernel=True)
    tuners = [kernel.fn for kernel, _ in cuda_fast.PINNED_LAUNCHES]
    saved = [(t.configs, dict(t.cache)) for t in tuners]
    try:
        for t in tuners:
            t.cache.clear()
        tuned_out = run()[0]
        tuned = {t.base_fn.__name__: [str(c) for c in t.cache.values()] for t in tuners}
        out = {"rows": B, "tokens": T, "tuned": tuned, "tuned_ms": round(gpu_ms(run), 4)}
        out["pinned"] = cuda_fast.pin_autotuned_launches()
        out["pinned_ms"] = round(gpu_ms(run), 4)
        out["max_diff"] = (run()[0].float() - tuned_out.float()).abs().max().item()
    finally:
        for t, (configs, cache) in zip(tuners, saved):
            t.configs, t.cache = configs, cache
    print(json.dumps(out), file=sys.stderr, flush=True)
    return out


PROBES = {"conv": lambda a: probe_conv(a.batch, a.tokens), "gqa": lambda a: probe_gqa(a.batch, a.tokens),
          "state_copy": lambda a: probe_state_copy(a.batch), "delta": lambda a: probe_delta_rule(a.batch, a.tokens),
          "prefix": lambda a: probe_prefix_attention(a.batch, a.tokens),
          "suffix": lambda a: probe_suffix_attention(a.batch, a.tokens), "wy": lambda a: probe_wy(a.batch, a.tokens),
          "fla_launches": lambda a: probe_fla_launches(a.batch, a.tokens)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=144)
    ap.add_argument("--only", default=",".join(PROBES), help=f"comma-separated probes of {', '.join(PROBES)}")
    args = ap.parse_args(argv)
    unknown = [name for name in args.only.split(",") if name not in PROBES]
    if unknown:
        ap.error(f"--only: no probe named {', '.join(unknown)} (the probes: {', '.join(PROBES)})")
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__}
    for name in args.only.split(","):
        result[name] = PROBES[name](args)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
