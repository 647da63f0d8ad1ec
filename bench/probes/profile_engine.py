"""Where the cached path spends GPU time (torch profiler table), at one batch size and state length.

    python bench/probes/profile_engine.py --batch 1,32 --state-tokens 128 [--graphs] [--deterministic] [--timeline] \
        [--variant "split:engine.model.FUSED_ATTENTION=False"]

One model build serves every batch size (building the 0.8B-shaped model takes about a minute). Each --variant (the
format of `bench/probes/variant_ab.py`) is profiled after the code as it is, with its settings held while it runs.

--timeline (with --graphs, as users' steps run): instead of the table, where one step's wall time goes on the device,
from the kernels' own start and end times (`bench/probes/step_timeline.py`): kernels against the gaps between them, by
kernel family, and which transitions the gaps sit at.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.workload import build_engine, questions, states  # noqa: E402
from bench.probes.step_timeline import kernel_intervals, summarize  # noqa: E402
from bench.probes.variant_ab import parse_variant, patched  # noqa: E402
from engine import SchemaEngine  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="32", help="comma-separated batch sizes, profiled one after another")
    ap.add_argument("--state-tokens", type=int, default=128)
    ap.add_argument("--graphs", action="store_true")
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--deterministic", action="store_true", help="the workers' batch-invariant kernel table")
    ap.add_argument("--timeline", action="store_true", help="kernels against gaps in one step (see above)")
    ap.add_argument("--variant", action="append", default=[], type=parse_variant)
    args = ap.parse_args()
    args.quick, args.device, args.dtype = False, "cuda", "bfloat16"
    eng, _ = build_engine(args)
    for name, patches in [("base", [])] + args.variant:
        with patched(patches):
            se = SchemaEngine(eng, use_graphs=args.graphs)
            h = se.prepare(questions(eng.tok, 10, 4, 400))
            for batch in (int(b) for b in args.batch.split(",")):
                print(f"=== {name}: batch {batch}, {args.state_tokens}-token states, graphs={args.graphs}")
                texts = states(eng.tok, batch, args.state_tokens, 0)
                if args.timeline:
                    timeline_batch(se, h, texts, args.rows)
                else:
                    profile_batch(se, h, texts, args.rows)


def warmed_rows(se: SchemaEngine, handle, texts: list[str]) -> list:
    """The texts tokenized, after three unprofiled steps on them (compilation, graph captures)."""
    rows = [se.tokenize(handle, s) for s in texts]
    for _ in range(3):
        se.score_rows(handle, rows)
    torch.cuda.synchronize()
    return rows


def profile_batch(se: SchemaEngine, handle, texts: list[str], n_rows: int) -> None:
    rows = warmed_rows(se, handle, texts)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            se.score_rows(handle, rows)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=n_rows, max_name_column_width=60))


def timeline_batch(se: SchemaEngine, handle, texts: list[str], n_rows: int, steps: int = 5) -> None:
    """Profile `steps` synchronous steps, then summarize the median one's kernels and gaps."""
    rows = warmed_rows(se, handle, texts)
    walls = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            start = time.perf_counter()
            se.score_rows(handle, rows)
            walls.append(1000 * (time.perf_counter() - start))
    print(f"host wall per step (profiled): {sorted(walls)[steps // 2]:.3f} ms")
    try:
        print(summarize(kernel_intervals(prof), steps, n_rows))
    except ValueError as exc:           # e.g. a graph captured mid-profile: the steps launched different work
        print(f"no timeline: {exc}")


if __name__ == "__main__":
    main()
