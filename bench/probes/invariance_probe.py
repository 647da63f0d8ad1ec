"""Which GPU kernels make a state's scores depend on its batch, and what the batch-invariant kernels cost (H200).

One kernel family at a time, at the 0.8B shape: a probe state's rows (182 real tokens) are placed at a random
position among random neighbours, in batches of R rows padded to a length bucket T, and its outputs are compared bit
for bit with the probe scored alone. Families: the GEMMs (cuBLAS through F.linear, and
`engine.kernels.cuda_deterministic.matmul`), the suffix attention's two halves (torch's flash op, and
`engine.kernels.cuda_deterministic.attention`), and fla's chunked delta rule. Then each invariant kernel is timed
against what it would replace.

    python bench/probes/invariance_probe.py --out DIR     (writes DIR/invariance_probe.json, prints a table)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random

import torch
import torch.nn.functional as F
import triton

from engine.kernels import cuda_deterministic as bi

REAL = 182                                  # the probe state's suffix tokens (128-token state + 10 answer slots)
PLACEMENTS = [(1, 184), (2, 184), (8, 192), (12, 136 + 48), (32, 184), (40, 256), (64, 184), (128, 184), (128, 264)]
GEMMS = {"gdn_in_proj": (8224, 1024), "attn_qkv": (5120, 1024), "mlp_in": (7168, 1024), "mlp_down": (1024, 3584),
         "out_proj": (1024, 2048), "labels": (8, 1024)}
MM_CONFIGS = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4),
              (128, 64, 64, 4, 4), (256, 128, 64, 8, 3)]
HQ, HKV, DA, TP = 8, 2, 256, 400
HK, DK, HV, DV = 16, 128, 16, 128
dev = "cuda"
bf16 = torch.bfloat16


def ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def place(probe: torch.Tensor, R: int, T: int, r0: int, rest: tuple) -> torch.Tensor:
    """[R, T, *rest] of random neighbours with `probe` ([REAL, *rest]) as row r0's first REAL tokens."""
    x = torch.randn(R, T, *rest, device=dev).to(probe.dtype)
    x[r0, :REAL] = probe
    return x


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    return {"equal": bool(torch.equal(ref, got)), "max_abs": float((ref.float() - got.float()).abs().max())}


def gemm_invariance(rng: random.Random) -> dict:
    out = {}
    for name, (N, K) in GEMMS.items():
        W = torch.randn(N, K, device=dev, dtype=bf16) / K ** 0.5
        probe = torch.randn(REAL, K, device=dev, dtype=bf16)
        for impl, fn in (("cublas", F.linear), ("triton", bi.matmul)):
            ref = fn(probe, W)
            rows = []
            for R, T in PLACEMENTS:
                r0 = rng.randrange(R)
                y = fn(place(probe, R, T, r0, (K,)).view(R * T, K), W).view(R, T, N)
                rows.append({"R": R, "T": T, **compare(ref, y[r0, :REAL])})
            out[f"{name}/{impl}"] = {"all_equal": all(r["equal"] for r in rows),
                                     "max_abs": max(r["max_abs"] for r in rows), "rows": rows}
    return out


def gemm_timing() -> dict:
    out = {}
    for name, (N, K) in GEMMS.items():
        W = torch.randn(N, K, device=dev, dtype=bf16) / K ** 0.5
        for M in (184, 32 * 184, 128 * 184):
            x = torch.randn(M, K, device=dev, dtype=bf16)
            row = {"cublas": ms(lambda: F.linear(x, W))}
            for cfg in MM_CONFIGS if N >= 64 else [(64, 16, 64, 4, 3), (128, 16, 64, 4, 3), (64, 32, 64, 4, 3)]:
                try:
                    got = bi.matmul(x, W, cfg)
                    err = float(((got.float() - F.linear(x, W).float()).norm() / F.linear(x, W).float().norm()))
                    row["x".join(map(str, cfg))] = ms(lambda: bi.matmul(x, W, cfg))
                    row["x".join(map(str, cfg)) + "_relerr"] = err
                except Exception as exc:                          # a config that does not fit (shared memory)
                    row["x".join(map(str, cfg))] = f"{type(exc).__name__}"
            row["tflops_cublas"] = 2 * M * N * K / row["cublas"] / 1e9
            out[f"{name}/M={M}"] = row
    return out


def flash(q, k, v, causal, scale):
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    return o, lse[..., :q.shape[2]].float()


def attention_invariance(rng: random.Random) -> dict:
    scale = DA ** -0.5
    G = HQ // HKV
    kp = torch.randn(1, HKV, TP, DA, device=dev, dtype=bf16)
    vp = torch.randn(1, HKV, TP, DA, device=dev, dtype=bf16)
    pq = torch.randn(HKV, G, REAL, DA, device=dev, dtype=bf16)           # the probe's queries, prefix-major layout
    sq = torch.randn(HQ, REAL, DA, device=dev, dtype=bf16)
    sk = torch.randn(HKV, REAL, DA, device=dev, dtype=bf16)
    sv = torch.randn(HKV, REAL, DA, device=dev, dtype=bf16)
    out = {}
    for impl, fn in (("flash", flash), ("triton", bi.attention)):
        pre, suf = [], []
        ref_pre = ref_suf = None
        for R, T in [(1, 184)] + PLACEMENTS:
            r0 = rng.randrange(R)
            q = torch.randn(R, HKV, G, T, DA, device=dev, dtype=bf16)
            q[r0, :, :, :REAL] = pq
            qp = q.permute(1, 0, 2, 3, 4).reshape(1, HKV, R * G * T, DA)        # [P, Hkv, R*G*T, D]
            o, lse = fn(qp, kp, vp, False, scale)
            got = (o.view(HKV, R, G, T, DA)[:, r0, :, :REAL], lse.view(HKV, R, G, T)[:, r0, :, :REAL])
            ref_pre = ref_pre or got
            pre.append({"R": R, "T": T, "o": compare(ref_pre[0], got[0]), "lse": compare(ref_pre[1], got[1])})
            qs, ks, vs = (place(t.transpose(0, 1), R, T, r0, t.transpose(0, 1).shape[1:]).transpose(1, 2).contiguous()
                          for t in (sq, sk, sv))                               # [R, H, T, D]
            o, lse = fn(qs, ks, vs, True, scale)
            got = (o[r0, :, :REAL], lse[r0, :, :REAL])
            ref_suf = ref_suf or got
            suf.append({"R": R, "T": T, "o": compare(ref_suf[0], got[0]), "lse": compare(ref_suf[1], got[1])})
        for part, rows in (("prefix", pre), ("suffix", suf)):
            out[f"{part}/{impl}"] = {"all_equal": all(r["o"]["equal"] and r["lse"]["equal"] for r in rows),
                                     "max_abs": max(r["o"]["max_abs"] for r in rows), "rows": rows}
    # agreement of the two implementations, and time, at batch 1, 32 and 128
    for R in (1, 32, 128):
        T = 184
        qp = torch.randn(1, HKV, R * G * T, DA, device=dev, dtype=bf16)
        qs = torch.randn(R, HQ, T, DA, device=dev, dtype=bf16)
        ks, vs = (torch.randn(R, HKV, T, DA, device=dev, dtype=bf16) for _ in range(2))
        row = {}
        for part, args in (("prefix", (qp, kp, vp, False, scale)), ("suffix", (qs, ks, vs, True, scale))):
            fo, fl = flash(*args)
            to, tl_ = bi.attention(*args)
            row[f"{part}_relerr"] = float((to.float() - fo.float()).norm() / fo.float().norm())
            row[f"{part}_lse_maxabs"] = float((tl_ - fl).abs().max())
            row[f"{part}_flash_ms"] = ms(lambda: flash(*args))
            for bm, bn, w, s in ((64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 3), (128, 32, 8, 2), (64, 64, 8, 2)):
                try:
                    row[f"{part}_triton_{bm}x{bn}x{w}x{s}_ms"] = ms(lambda: bi.attention(*args, block_m=bm, block_n=bn,
                                                                                          warps=w, stages=s))
                except Exception as exc:
                    row[f"{part}_triton_{bm}x{bn}x{w}x{s}_ms"] = type(exc).__name__
        out[f"timing/R={R}"] = row
    return out


def delta_rule_invariance(rng: random.Random) -> tuple[dict, str]:
    from engine.kernels.table import select_kernels
    delta = select_kernels("cuda").delta_rule
    g = torch.Generator(device=dev).manual_seed(1)
    q = F.normalize(torch.randn(REAL, HK, DK, device=dev, generator=g), dim=-1).to(bf16)
    k = F.normalize(torch.randn(REAL, HK, DK, device=dev, generator=g), dim=-1).to(bf16)
    v = torch.randn(REAL, HV, DV, device=dev, generator=g).to(bf16)
    a = torch.randn(REAL, HV, device=dev, generator=g).to(bf16)
    b = torch.randn(REAL, HV, device=dev, generator=g).to(bf16)
    A_log = torch.randn(HV, device=dev, generator=g)
    dt_bias = torch.randn(HV, device=dev, generator=g)
    h0 = torch.randn(1, HV, DK, DV, device=dev, generator=g) * 0.1
    rows, ref, digest = [], None, hashlib.sha256()
    for R, T in [(1, 184)] + PLACEMENTS:
        r0 = rng.randrange(R)
        ins = [place(t, R, T, r0, t.shape[1:]) for t in (q, k, v, a, b)]
        ins[0] = F.normalize(ins[0].float(), dim=-1).to(bf16)
        ins[1] = F.normalize(ins[1].float(), dim=-1).to(bf16)
        ins[0][r0, :REAL], ins[1][r0, :REAL] = q, k
        o, _ = delta(*ins, A_log, dt_bias, h0.expand(R, -1, -1, -1).contiguous(), False)
        got = o[r0, :REAL]
        ref = got if ref is None else ref
        digest.update(got.float().cpu().numpy().tobytes())
        rows.append({"R": R, "T": T, **compare(ref, got)})
    return {"all_equal": all(r["equal"] for r in rows), "max_abs": max(r["max_abs"] for r in rows), "rows": rows}, \
        digest.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--parts", default="gemm,attention,delta,timing")
    args = ap.parse_args()
    torch.manual_seed(0)
    rng = random.Random(0)
    parts = args.parts.split(",")
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__}
    if "gemm" in parts:
        result["gemm"] = gemm_invariance(rng)
        for key, r in result["gemm"].items():
            print(f"gemm {key:24s} invariant={r['all_equal']} max_abs={r['max_abs']:.3g}", flush=True)
    if "attention" in parts:
        result["attention"] = attention_invariance(rng)
        for key, r in result["attention"].items():
            if "all_equal" in r:
                print(f"attention {key:20s} invariant={r['all_equal']} max_abs={r['max_abs']:.3g}", flush=True)
            else:
                print(f"attention {key}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                       for k, v in r.items()), flush=True)
    if "delta" in parts:
        result["delta_rule"], result["delta_rule_digest"] = delta_rule_invariance(rng)
        print(f"delta rule invariant={result['delta_rule']['all_equal']} max_abs={result['delta_rule']['max_abs']:.3g} "
              f"digest={result['delta_rule_digest'][:16]}", flush=True)
    if "timing" in parts:
        result["gemm_timing"] = gemm_timing()
        for key, row in result["gemm_timing"].items():
            print(f"time {key:24s} " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                  for k, v in row.items() if not k.endswith("relerr")), flush=True)
    with open(f"{args.out}/invariance_probe.json", "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
