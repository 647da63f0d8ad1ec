"""Kernel launch choices timed side by side in one process: each variant sets module constants of the engine, gets
its own SchemaEngine and CUDA graphs (captured while its constants hold, so its replays keep them), and the variants
are timed in turns, round after round. Timing two checkouts in two processes (`bench/gpu_session.sh ab`) moves batch
1 by +-0.15 ms from one process to the next; in turns, in one process, such drifts fall on every variant alike.

    python bench/probes/variant_ab.py --batches 1,32,128 \\
        --variant "separate:engine.kernels.cuda_fast.FUSED_OUTPUT=False" \\
        --variant "conv-16:engine.kernels.causal_conv.CONV_CONFIG=(16, 2)" \\
        --variant "fused-128:engine.kernels.indexed_delta_rule.FUSED_CONFIG=(128, 8, 2)"

A variant is NAME:module.ATTR=python literal[;module.ATTR=literal...]; the variant "base" is the code as it is. Each
round starts at another variant: the first timing after a change of batch size runs slower. Prints per batch size
each variant's median over rounds of its p50 step, and the largest difference of its probabilities from base's (0
where the change keeps the bits). --deterministic: the workers' batch-invariant kernel table. --quick: the tiny model
on the CPU, eager.
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.ab_order import rotated  # noqa: E402
from bench.engine_bench import parse_setting, timed  # noqa: E402
from bench.workload import build_engine, questions, states  # noqa: E402
from engine import SchemaEngine  # noqa: E402


def parse_variant(spec: str) -> tuple[str, list[tuple[str, str, object]]]:
    """"NAME:mod.ATTR=literal;..." -> (NAME, [(module, attribute, value)])."""
    usage = f"variant {spec!r}: expected NAME:module.ATTR=literal[;module.ATTR=literal...]"
    name, _, sets = spec.partition(":")
    try:
        patches = [parse_setting(item) for item in filter(None, (s.strip() for s in sets.split(";")))]
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"variant {spec!r}: {exc}") from None
    if not name.strip() or name == "base" or not patches:
        raise argparse.ArgumentTypeError(usage + " (a name other than base, and at least one setting)")
    return name, patches


@contextmanager
def patched(patches):
    saved = []
    try:
        for module, attr, value in patches:
            mod = importlib.import_module(module)           # parse_variant checked that it has attr
            saved.append((mod, attr, getattr(mod, attr)))
            setattr(mod, attr, value)
        yield
    finally:
        for mod, attr, value in reversed(saved):
            setattr(mod, attr, value)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model on the CPU")
    ap.add_argument("--deterministic", action="store_true",
                    help="engines with batch-invariant kernels, as the stream's workers run by default")
    ap.add_argument("--batches", default="1,2,8,32")
    ap.add_argument("--state-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20, help="steps per variant, batch size and round")
    ap.add_argument("--variant", action="append", default=[], type=parse_variant)
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args(argv)
    args.device = "cpu" if args.quick else "cuda"
    args.dtype = "float32" if args.quick else "bfloat16"
    batches = [int(b) for b in args.batches.split(",")]
    eng, model_desc = build_engine(args)
    sync = torch.cuda.synchronize if eng.dev.type == "cuda" else (lambda: None)
    qs = questions(eng.tok, 10, 4, 60 if args.quick else 400)
    variants = [("base", [])] + args.variant
    engines = {}
    for name, patches in list(variants):
        started = time.perf_counter()
        try:
            with patched(patches):
                engines[name] = _prepare(eng, qs, batches, args, sync)
        except Exception as exc:  # noqa: BLE001 - a launch the GPU refuses (too much shared memory) drops its variant
            if name == "base":
                raise
            print(f"{name}: dropped, it failed to run: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            variants.remove((name, patches))
            continue
        print(f"{name}: prepared and captured in {time.perf_counter() - started:.1f} s", flush=True)
    p50s = {name: {B: [] for B in batches} for name, _ in variants}
    for r in range(args.rounds):
        for B in batches:
            # each round starts at another variant: the first timing after a change of batch size ran slower (run AS:
            # the same code as base, timed after it, was up to 0.1 ms faster at batch 1)
            for name, _ in rotated(variants, r):
                se, h, per_batch = engines[name]
                rows = per_batch[B][0]
                p50s[name][B].append(statistics.median(timed(lambda: se.score_rows(h, rows), args.iters, sync)))
            # as it goes, so that a run cut short by its time limit still shows the rounds it finished
            print(f"round {r} batch {B}: " + ", ".join(f"{n} {p50s[n][B][-1] * 1e3:.3f}" for n, _ in variants),
                  flush=True)
    base = engines["base"][2]
    result = {"model": model_desc, "device": torch.cuda.get_device_name(0) if eng.dev.type == "cuda" else "cpu",
              "state_tokens": args.state_tokens, "rounds": args.rounds, "iters": args.iters,
              "variants": {name: [f"{m}.{a}={v!r}" for m, a, v in patches] for name, patches in variants},
              "batches": {}}
    for B in batches:
        row = {}
        for name, _ in variants:
            probs = engines[name][2][B][1]
            diff = max((a - b).abs().max().item() for a, b in zip(_flat(probs), _flat(base[B][1])))
            row[name] = {"p50_ms": round(statistics.median(p50s[name][B]) * 1e3, 4),
                         "rounds_ms": [round(t * 1e3, 4) for t in p50s[name][B]], "max_diff_vs_base": diff}
        result["batches"][B] = row
        print(f"batch {B}: " + ", ".join(f"{n} {r['p50_ms']:.3f} ms (diff {r['max_diff_vs_base']:.2g})"
                                          for n, r in row.items()), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


def _prepare(eng, qs, batches, args, sync):
    """A SchemaEngine under the current settings, its schema prepared and each batch's graph captured: (se, handle,
    {batch: (rows, probabilities)})."""
    se = SchemaEngine(eng, use_graphs=not args.quick)
    h = se.prepare(qs)
    per_batch = {}
    for B in batches:
        rows = [se.tokenize(h, s) for s in states(eng.tok, B, args.state_tokens, seed=B)]
        probs = se.score_rows(h, rows)             # captures this variant's graph for the batch
        sync()
        per_batch[B] = (rows, probs)
    return se, h, per_batch


def _flat(probs) -> list[torch.Tensor]:
    """score_rows' probabilities as a list of tensors, whatever nesting it returns."""
    if isinstance(probs, torch.Tensor):
        return [probs.float().cpu()]
    return [t for p in probs for t in _flat(p)]


if __name__ == "__main__":
    main()
