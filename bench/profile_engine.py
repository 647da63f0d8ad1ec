"""Where the cached path spends GPU time (torch profiler table), at one batch size and state length.

    python bench/profile_engine.py --batch 32 --state-tokens 128 [--graphs]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.engine_bench import build_engine, questions, states  # noqa: E402
from engine import SchemaEngine  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--state-tokens", type=int, default=128)
    ap.add_argument("--graphs", action="store_true")
    ap.add_argument("--rows", type=int, default=30)
    args = ap.parse_args()
    args.quick, args.device, args.dtype = False, "cuda", "bfloat16"
    eng, _ = build_engine(args)
    se = SchemaEngine(eng, use_graphs=args.graphs)
    h = se.prepare(questions(eng.tok, 10, 4, 400))
    rows = [se.tokenize(h, s) for s in states(eng.tok, args.batch, args.state_tokens, 0)]
    for _ in range(3):
        se.score_rows(h, rows)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            se.score_rows(h, rows)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
