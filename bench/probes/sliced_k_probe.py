"""Can a batch-invariant GEMM split K at few rows and still run at cuBLAS's speed at many? (issue 48)

At batch 1 (184 rows) a 1024-column projection is 8-16 tiles for 132 SMs: cuBLAS takes 6-9 us where the weight's
bytes take 1-2, because too few programs run. Splitting K over more programs is the usual cure, and it changes the
order in which a row's products are summed, so a split used at few rows and not at many breaks batch invariance
(runs AC and AY split K at few rows only, and were slower than cuBLAS there as well). This probe times another way:
one order for every M, K cut into S slices, each slice a chain of k-steps into a fresh float32 accumulator, the slices
added in order. Two kernels give that order:

- `sliced`: one program a tile, the S slices one after the other (no extra memory traffic; for many rows);
- `split`: S programs a tile, one slice each, float32 partials to memory, then a kernel that adds them in slice order
  (S times the programs; for few rows).

Run CS found a tile's chained k16 MMAs give the same bits whatever the tile (BM, BN, BK, warps), so the two should
agree bit for bit; the probe checks that (split at few rows against sliced at many, on the same leading rows) and
S = 1 against cuBLAS. Then it times, inside CUDA graphs with a weight copy a call (more copies than L2 holds), cuBLAS,
`sliced` and `split` (its add included) for each projection shape at 184 to 23,552 rows, each at its best of a few
launch configurations. Loads go through TMA descriptors. What would make the design pay: `split` well under cuBLAS at
184 and 1,472 rows and `sliced` within a few percent of cuBLAS at 5,888 and 23,552.

    python bench/probes/sliced_k_probe.py [--rows 184,1472,5888,23552] [--slices 1,2,4,8] [--out results/X.json]
    python bench/probes/sliced_k_probe.py --plot results/X.json      # its picture, results/X.png (no GPU)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.probes import gemm_probe  # noqa: E402
from bench.probes.gemm_probe import floor_us  # noqa: E402
from bench.probes.kernel_probe import gpu_ms  # noqa: E402

SHAPES = [shape for shape in gemm_probe.SHAPES if shape[0] != "attn_q"]      # attn_qkv's first rows: the same GEMM
SLICED_CONFIGS = [(128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4)]
"""(BM, BN, BK, warps, stages) tried for `sliced`: the large tiles many rows want."""
SPLIT_CONFIGS = [(64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (128, 128, 64, 8, 4),
                 (64, 64, 128, 4, 3)]
"""(BM, BN, BK, warps, stages) tried for `split`: smaller tiles, for few rows."""
REDUCE_BLOCK = 1024


@triton.jit
def _tile_of(tile, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    # grouped order: programs running together share rows of X and columns of W in L2
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % size_m, (tile % per_group) // size_m


@triton.jit
def _slice_chain(x_desc, w_desc, off_m, off_n, first_step, steps, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr):
    # one slice of K: its k-steps chained into a fresh float32 accumulator, in order
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for i in range(steps):
        k = (first_step + i) * BK
        acc = tl.dot(x_desc.load([off_m, k]), w_desc.load([off_n, k]).T, acc)
    return acc


@triton.jit(do_not_specialize=["M"])
def _sliced_kernel(x_desc, w_desc, y_desc, M, N, K, SLICES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, GROUP_M: tl.constexpr):
    pm, pn = _tile_of(tl.program_id(0), M, N, BM, BN, GROUP_M)
    steps = K // BK // SLICES
    total = _slice_chain(x_desc, w_desc, pm * BM, pn * BN, 0, steps, BM, BN, BK)
    for s in tl.static_range(1, SLICES):
        total += _slice_chain(x_desc, w_desc, pm * BM, pn * BN, s * steps, steps, BM, BN, BK)
    y_desc.store([pm * BM, pn * BN], total.to(y_desc.dtype))


@triton.jit(do_not_specialize=["M"])
def _split_kernel(x_desc, w_desc, P, M, N, K, SLICES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, GROUP_M: tl.constexpr):
    pm, pn = _tile_of(tl.program_id(0), M, N, BM, BN, GROUP_M)
    s = tl.program_id(1)
    steps = K // BK // SLICES
    acc = _slice_chain(x_desc, w_desc, pm * BM, pn * BN, s * steps, steps, BM, BN, BK)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    tl.store(P + (s * M + rm[:, None]).to(tl.int64) * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _add_slices_kernel(P, Y, size, SLICES: tl.constexpr, BLOCK: tl.constexpr):
    # the slices' partials added in slice order, as `_sliced_kernel` adds them
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < size
    total = tl.load(P + offs, mask=ok)
    for s in tl.static_range(1, SLICES):
        total += tl.load(P + s * size + offs, mask=ok)
    tl.store(Y + offs, total.to(Y.dtype.element_ty), mask=ok)


def _descriptors(x: torch.Tensor, w: torch.Tensor, BM: int, BN: int, BK: int):
    return TensorDescriptor.from_tensor(x, [BM, BK]), TensorDescriptor.from_tensor(w, [BN, BK])


def sliced(x: torch.Tensor, w: torch.Tensor, slices: int, config: tuple) -> torch.Tensor:
    """Y = x @ w.T with K in `slices` slices added in order, one program a tile."""
    BM, BN, BK, warps, stages = config
    (M, K), N = x.shape, w.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    x_desc, w_desc = _descriptors(x, w, BM, BN, BK)
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
    _sliced_kernel[grid](x_desc, w_desc, TensorDescriptor.from_tensor(y, [BM, BN]), M, N, K, SLICES=slices, BM=BM,
                         BN=BN, BK=BK, GROUP_M=8, num_warps=warps, num_stages=stages)
    return y


def split(x: torch.Tensor, w: torch.Tensor, slices: int, config: tuple) -> torch.Tensor:
    """The same sums as `sliced`, a program a tile and slice, the float32 partials added by a second kernel."""
    BM, BN, BK, warps, stages = config
    (M, K), N = x.shape, w.shape[0]
    partials = torch.empty(slices, M, N, device=x.device, dtype=torch.float32)
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    x_desc, w_desc = _descriptors(x, w, BM, BN, BK)
    _split_kernel[(triton.cdiv(M, BM) * triton.cdiv(N, BN), slices)](
        x_desc, w_desc, partials, M, N, K, SLICES=slices, BM=BM, BN=BN, BK=BK, GROUP_M=8, num_warps=warps,
        num_stages=stages)
    _add_slices_kernel[(triton.cdiv(M * N, REDUCE_BLOCK),)](partials, y, M * N, SLICES=slices, BLOCK=REDUCE_BLOCK)
    return y


def fits(K: int, slices: int, BK: int) -> bool:
    return K % (BK * slices) == 0


def _copies(N: int, K: int, gen: torch.Generator, l2_bytes: int) -> list[torch.Tensor]:
    # enough weight copies that a graph of one call per copy reads each from HBM, not from what L2 kept
    count = max(4, -(-3 * l2_bytes // (2 * N * K)))
    first = torch.randn(N, K, device="cuda", generator=gen).to(torch.bfloat16)
    return [first] + [first.clone() for _ in range(count - 1)]


def _time_us(call, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    def run():
        for w in weights:
            call(x, w)
    return 1000 * gpu_ms(run, iters=15, graph=True) / len(weights)


def _best(call, x, weights, configs, slices, K) -> tuple[float, tuple] | None:
    timed = []
    for c in configs:
        if fits(K, slices, c[2]):
            try:
                timed.append((_time_us(lambda a, b: call(a, b, slices, c), x, weights), c))
            except Exception as failed:      # one configuration the device refuses (shared memory) leaves the others
                print(f"# {call.__name__} S={slices} {c}: {type(failed).__name__}: {str(failed)[:120]}", flush=True)
    return min(timed) if timed else None


def check_bits(N: int, K: int, slices: int, rows: list[int], gen: torch.Generator) -> dict:
    """Does `split` at each row count give `sliced`'s bits at the most rows, row for row? And S = 1 cuBLAS's?"""
    w = torch.randn(N, K, device="cuda", generator=gen).to(torch.bfloat16)
    x = torch.randn(max(rows), K, device="cuda", generator=gen).to(torch.bfloat16)
    reference = sliced(x, w, slices, SLICED_CONFIGS[0])
    found = {"slices": slices, "split_equals_sliced": {}, "sliced_configs_agree": True}
    for c in SLICED_CONFIGS[1:]:
        found["sliced_configs_agree"] &= bool(torch.equal(sliced(x, w, slices, c), reference))
    for M in rows:
        found["split_equals_sliced"][M] = all(torch.equal(split(x[:M], w, slices, c), reference[:M])
                                              for c in SPLIT_CONFIGS if fits(K, slices, c[2]))
    if slices == 1:
        found["sliced_equals_cublas"] = bool(torch.equal(reference, F.linear(x, w)))
    return found


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="184,1472,5888,23552")
    ap.add_argument("--slices", default="1,2,4,8")
    ap.add_argument("--split-rows", type=int, default=5888, help="time `split` up to this many rows")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", metavar="JSON", default=None, help="draw an earlier run's JSON beside it as a PNG")
    args = ap.parse_args(argv)
    if args.plot:
        print(f"wrote {plot(json.loads(Path(args.plot).read_text()), Path(args.plot).with_suffix('.png'))}")
        return {}
    rows = [int(r) for r in args.rows.split(",")]
    slice_counts = [int(s) for s in args.slices.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    result = {"device": torch.cuda.get_device_name(0), "unit": "us per GEMM", "bits": {}, "times": {}}
    print(f"# {result['device']}; us a GEMM (best launch configuration), graph replays of one call per weight copy "
          f"(L2 {l2 >> 20} MiB); S = slices of K, one summation order at every row count for a given S")
    split_counts = [s for s in slice_counts if s > 1]
    print("| shape | rows | cuBLAS | floor | " + " | ".join(f"sliced S={s}" for s in slice_counts) + " | "
          + " | ".join(f"split S={s}" for s in split_counts) + " |")
    print("|---|---|---|---|" + "---|" * (len(slice_counts) + len(split_counts)))
    for name, N, K in SHAPES:
        result["bits"][name] = [check_bits(N, K, s, [r for r in rows if r <= 1472], gen) for s in slice_counts]
        weights = _copies(N, K, gen, l2)
        for M in rows:
            x = torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16)
            row = {"cublas": _time_us(lambda a, b: F.linear(a, b), x, weights), "floor": floor_us(M, N, K),
                   "sliced": {s: _best(sliced, x, weights, SLICED_CONFIGS, s, K) for s in slice_counts},
                   "split": {s: _best(split, x, weights, SPLIT_CONFIGS, s, K) if M <= args.split_rows else None
                             for s in split_counts}}
            result["times"].setdefault(name, {})[M] = row
            cells = [_cell(t, row["cublas"]) for t in [*row["sliced"].values(), *row["split"].values()]]
            print(f"| {name} {N}x{K} | {M} | {row['cublas']:.1f} | {row['floor']:.1f} | " + " | ".join(cells) + " |",
                  flush=True)
        print(f"bits {name}: {json.dumps(result['bits'][name])}", flush=True)
        del weights
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    return result


def _cell(timed: tuple[float, tuple] | None, cublas: float) -> str:
    return f"{timed[0]:.1f} ({timed[0] / cublas:.2f}x)" if timed else "-"


def plot(result: dict, path: Path) -> Path:
    """Each shape's GEMM time against cuBLAS's by row count: `sliced` at S = 1 and 2, `split` at its best S, and the
    floor."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = result["times"]
    fig, axes = plt.subplots(2, -(-len(shapes) // 2), figsize=(13, 7), sharey=True)
    for ax, (name, by_rows) in zip(axes.flat, shapes.items()):
        rows = sorted(by_rows, key=int)
        ratio = {label: [] for label in ("sliced S=1", "sliced S=2", "split, best S", "floor")}
        for M in rows:
            row = by_rows[M]
            timed = {"sliced S=1": row["sliced"].get("1"), "sliced S=2": row["sliced"].get("2"),
                     "split, best S": min((t for t in row["split"].values() if t), default=None)}
            for label, t in timed.items():
                ratio[label].append(t[0] / row["cublas"] if t else float("nan"))
            ratio["floor"].append(row["floor"] / row["cublas"])
        x = [int(M) for M in rows]
        for label, values in ratio.items():
            ax.plot(x, values, "--" if label == "floor" else "o-", label=label)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("rows (184 = a batch of 1)")
    for ax in axes[:, 0]:
        ax.set_ylabel("time / cuBLAS's")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"{result['device']}: one summation order for every row count, against cuBLAS (under 1 is faster)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
