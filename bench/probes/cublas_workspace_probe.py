"""Does cuBLAS sum a row in one order at every row count when it has no workspace? (issue 48: the deterministic
table 4% behind the fast one at batch 128).

The deterministic table runs the MLP's down projection (1024 x 3584 at the 0.8B shape) as `blocked_linear`: cuBLAS
on blocks of 256 rows, because one GEMM of all a batch's rows changed a row's bits with the row count
(`cublas_is_invariant` failed at every floor). The likely cause is split-K, which cuBLAS picks for some M and which
needs a workspace for its partial sums; cuBLAS given no workspace (`CUBLAS_WORKSPACE_CONFIG=:0:0`, and for cuBLASLt
`CUBLASLT_WORKSPACE_SIZE=0`) cannot split K that way. If the down projection is then invariant as one GEMM, and that
GEMM is faster than the blocked one, the deterministic table can run it so. Only the device can tell: for each
setting, in a process of its own (cuBLAS reads the variables once), this probe asks `cublas_is_invariant` for each of
the model's projection shapes over the row counts a step has (184 a state), and times one GEMM of each inside a CUDA
graph at batch 1, 8, 32 and 128's rows, beside the blocked path for the down projection.

    python bench/probes/cublas_workspace_probe.py [--out results/X.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

SETTINGS = {
    "default": {"DECIDER_CUBLAS_WORKSPACE": "default"},        # else importing the engine sets none (engine.cublas_workspace)
    "no_workspace": {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"},
    "cublaslt": {"DECIDER_PROBE_BLAS": "cublaslt", "DECIDER_CUBLAS_WORKSPACE": "default"},
    "cublaslt_no_workspace": {"DECIDER_PROBE_BLAS": "cublaslt", "CUBLAS_WORKSPACE_CONFIG": ":0:0",
                              "CUBLASLT_WORKSPACE_SIZE": "0"},
}
ROWS_PER_STATE = 184
INVARIANCE_ROWS = [184, 368, 552, 736, 1104, 1472, 2208, 2944, 4416, 5888, 8832, 11776, 17664, 23552]
TIMED_BATCHES = (1, 8, 32, 128)


def measure() -> dict:
    """(In the setting's own process) invariance and times, per shape."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.probes.gemm_probe import SHAPES, floor_us
    from bench.probes.kernel_probe import gpu_ms
    from bench.probes.launch_floor import chain
    from engine.kernels.blocked_linear import blocked_linear
    from engine.kernels.cuda_deterministic import cublas_is_invariant

    if os.environ.get("DECIDER_PROBE_BLAS"):
        torch.backends.cuda.preferred_blas_library(os.environ["DECIDER_PROBE_BLAS"])
    gen = torch.Generator(device="cuda").manual_seed(0)
    out: dict = {"blas": str(torch.backends.cuda.preferred_blas_library()), "shapes": {}}
    for name, N, K in SHAPES:
        w = (torch.randn(N, K, device="cuda", generator=gen) / K ** 0.5).to(torch.bfloat16)
        x = torch.randn(max(INVARIANCE_ROWS), K, device="cuda", generator=gen).to(torch.bfloat16)
        shape = {"invariant": cublas_is_invariant(w, INVARIANCE_ROWS), "us": {}, "blocked_us": {}, "floor_us": {}}
        for batch in TIMED_BATCHES:
            xm = x[:batch * ROWS_PER_STATE].contiguous()
            calls = max(2, 40 // batch)
            shape["us"][str(batch)] = round(1000 * gpu_ms(chain(lambda: F.linear(xm, w), calls), iters=20, graph=True)
                                       / calls, 2)
            shape["floor_us"][str(batch)] = round(floor_us(xm.shape[0], N, K), 2)
            if (N, K) == (1024, 3584):
                shape["blocked_us"][str(batch)] = round(
                    1000 * gpu_ms(chain(lambda: blocked_linear(xm, w), calls), iters=20, graph=True) / calls, 2)
        out["shapes"][f"{name} {N}x{K}"] = shape
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measure", action="store_true", help="(internal) measure in this process's setting")
    ap.add_argument("--out", default=None, help="JSON file for the results")
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure()))
        return {}
    results = {}
    for setting, env in SETTINGS.items():
        run = subprocess.run([sys.executable, __file__, "--measure"], env={**os.environ, **env}, capture_output=True,
                             text=True, timeout=300)
        if run.returncode != 0:
            results[setting] = {"env": env, "error": run.stderr[-2000:]}
            print(f"{setting}: failed\n{run.stderr[-2000:]}")
            continue
        results[setting] = {"env": env, **json.loads(run.stdout.strip().splitlines()[-1])}
        print(f"## {setting} {env} (blas {results[setting]['blas']})")
        print("| shape | invariant 184-23,552 rows | " + " | ".join(f"batch {b} us" for b in TIMED_BATCHES) + " |")
        print("|---|---|" + "---|" * len(TIMED_BATCHES))
        for name, shape in results[setting]["shapes"].items():
            blocked = shape["blocked_us"]
            cells = [f"{shape['us'][str(b)]}" + (f" (blocked {blocked[str(b)]})" if blocked else "") for b in TIMED_BATCHES]
            print(f"| {name} | {shape['invariant']} | " + " | ".join(cells) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
