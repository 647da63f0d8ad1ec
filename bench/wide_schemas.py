"""Wide schemas (issue 47): scoring time by schema shape, side by side in one process, on the tiny model (CPU) or any
model directory.

    python bench/wide_schemas.py                               # tiny model, CPU: 10 x 4 beside 64 x 26 (and between)
    python bench/wide_schemas.py --model DIR --device cuda     # a real model

Shapes are QUESTIONS x OPTIONS; the wide ones have ordinal options "1".."26" (one-token options: the widest prefix
that fits). Per table (fast, deterministic) and batch size: the median time of a batch of `SchemaEngine.score_rows`
(label mass on, the default), states/s, and the time per answer (per state and question).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_bench import questions, states, timed  # noqa: E402
from engine import Engine, SchemaEngine  # noqa: E402


def shape_questions(tok, shape: str) -> list[dict]:
    """"10x4": bench/engine_bench.py's 10 questions of 4 two-word options (a ~400-token prefix, its default shape);
    any other "QxO": Q questions of O ordinal options "1".."O"."""
    n, k = (int(x) for x in shape.lower().split("x"))
    if (n, k) == (10, 4):
        return questions(tok, 10, 4, 400)
    return [{"question": f"How strongly does the event show sign {i}?", "options": [str(o) for o in range(1, k + 1)]}
            for i in range(n)]


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the tiny random model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shapes", default="10x4,10x26,64x4,64x26")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--tables", default="deterministic,fast")
    ap.add_argument("--state-tokens", type=int, default=32)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args(argv)
    model_dir = args.model
    if model_dir is None:
        from engine.testing import write_tiny_model
        model_dir = write_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}", flush=True)
    runs = []
    for table in args.tables.split(","):
        se = SchemaEngine(Engine.load(model_dir, device=args.device, deterministic=table == "deterministic"))
        handles = {}
        for shape in args.shapes.split(","):
            started = time.perf_counter()
            handles[shape] = h = se.prepare(shape_questions(se.e.tok, shape))
            print(f"{table:13s} {shape:6s} prepare {(time.perf_counter() - started) * 1e3:7.0f} ms, prefix "
                  f"{h.prefix_tokens} tokens", flush=True)
        for B in (int(b) for b in args.batches.split(",")):
            texts = states(se.e.tok, B, args.state_tokens, seed=B)
            for shape, h in handles.items():        # the shapes side by side at each batch size
                rows = [se.tokenize(h, s) for s in texts]
                p50 = statistics.median(timed(lambda: se.score_rows(h, rows), args.iters, sync))
                run = dict(table=table, shape=shape, batch=B, ms=p50 * 1e3, states_per_s=B / p50,
                           us_per_answer=p50 / B / h.n_questions * 1e6, suffix_tokens=statistics.mean(len(r.ids) for r in rows))
                runs.append(run)
                print(f"{table:13s} {shape:6s} batch {B:3d}: {run['ms']:8.1f} ms  {run['states_per_s']:7.1f} states/s  "
                      f"{run['us_per_answer']:6.0f} us/answer  (suffix {run['suffix_tokens']:.0f} tokens)", flush=True)
    return runs


if __name__ == "__main__":
    main()
