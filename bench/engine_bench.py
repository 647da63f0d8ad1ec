"""Engine benchmark: the cached SchemaEngine against whole-prompt forwards, side by side in one process.

    python bench/engine_bench.py                 # H200: Qwen3.5-0.8B-shaped random bf16 model, real Qwen3.5 token counts
    python bench/engine_bench.py --quick         # CPU: the tiny model, a few sizes (a test runs this)

Methods (one row per method x batch x state length):
  reference      engine.reference.score_full batched: a user's own transformers code, whole prompt per state
  full_fast      the engine's own forward over the whole prompt, no cache: a good server that recomputes the prompt
  cached_eager   SchemaEngine, prefix cached, no graphs
  cached_graphs  SchemaEngine with CUDA graphs (GPU only)
  cached_graphs_deterministic   the same with Engine.load(..., deterministic=True): batch-invariant kernels (GPU only)
  cached_graphs_pipelined       cached_graphs sustained: each batch launched (`SchemaEngine.launch_mixed`) before the
                 one ahead is read, as the worker's GPU thread and `decider replay` run it, so the host's preparation
                 of a batch overlaps the device's work on the one ahead; p50 is the wall time per batch over windows
                 of 8 launches, not one batch's latency (GPU only)
  cached_eager_deterministic    cached_eager with deterministic=True (not in the default list; the CPU's cost)
  METHOD_no_label_mass          a cached METHOD with SchemaEngine(label_mass=False): the read-out without the
                 full-vocabulary log-sum-exp behind the label mass (engine.label_mass), whose cost is the difference
                 (the markdown prints it); e.g. --methods cached_graphs_deterministic,cached_graphs_deterministic_no_label_mass

With --schemas N[,N...] (many schemas live): N schemas of the same shape (prefixes of --prefix-tokens +-32 tokens,
distinct questions), each batch's states spread evenly over them, on the deterministic engine (the CUDA default):
  mixed          SchemaEngine.score_mixed: one batch, every row reading its own schema's prefix from the bank
  per_schema     one score_lists call per schema (each schema's share of the batch as its own smaller batch)
with the graphs held and the prefix bank's memory after each N.

Writes a markdown table to stdout and bench/results/<date>-<gpu>.json ({"env": ..., "runs": [...]}; with --schemas,
<date>-<gpu>-schemas.json).
"""
from __future__ import annotations

import argparse
import ast
import datetime
import importlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.full_forward import FullPromptScorer  # noqa: E402
from bench.workload import build_engine, questions, states  # noqa: E402
from engine import Engine, SchemaEngine  # noqa: E402
from engine.reference import score_full  # noqa: E402


def parse_setting(item: str) -> tuple[str, str, object]:
    """"module.ATTR=python literal" -> (module, ATTR, value), for a module constant the engine reads when it traces a
    step (`--set` here, `bench/probes/variant_ab.py`'s variants)."""
    target, _, literal = item.partition("=")
    module, _, attr = target.strip().rpartition(".")
    if not module or not literal.strip():
        raise argparse.ArgumentTypeError(f"setting {item!r}: expected module.ATTR=literal")
    try:
        value = ast.literal_eval(literal.strip())
    except (ValueError, SyntaxError):
        raise argparse.ArgumentTypeError(f"setting {item!r}: {literal.strip()!r} is not a Python literal "
                                         "(a number, True/False, None, a quoted string, a tuple)") from None
    try:
        known = hasattr(importlib.import_module(module), attr)
    except ImportError as exc:
        raise argparse.ArgumentTypeError(f"setting {item!r}: {exc}") from None
    if not known:
        raise argparse.ArgumentTypeError(f"setting {item!r}: {module} has no {attr}")
    return module, attr, value


def parse_methods(spec: str) -> dict[str, set[int] | None]:
    """"m1,m2@32+128" -> {m1: None (every batch size), m2: {32, 128}}."""
    out = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, sizes = item.partition("@")
        out[name] = {int(b) for b in sizes.split("+")} if sizes else None
    return out


def timed(fn, iters: int, sync) -> list[float]:
    fn()
    sync()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return times


def alternated(methods: list[str], iters: int) -> list[tuple[str, int]]:
    """The order the methods of one batch size are timed in, as (method, iterations): half of each method's iterations
    in the given order, the other half in the reverse order. In one order the method timed second at batch 128 was
    0.7-2.2% slower than where it was timed first (run FD, an H100: the GPU's clocks drift over a run), which the table
    then read as the deterministic table's cost; timed both ways, each method gets as much of either position."""
    first = -(-iters // 2)
    schedule = [(m, first) for m in methods]
    if iters - first:
        schedule += [(m, iters - first) for m in reversed(methods)]
    return schedule


DEFAULT_BATCHES = "1,8,16,32,64,128"
"""Batch sizes timed by default, for every method (the deterministic table beside the fast one): 1 (latency), 8 and 16
(a stream's batches under a latency budget at half load), 32, 64 and 128 (throughput)."""

PIPELINE_WINDOW = 8
"""Launches per timed window of `pipelined`."""


def pipelined(launch, iters: int) -> list[float]:
    """Seconds per batch over `iters` windows of PIPELINE_WINDOW batches, each batch launched before the one ahead is
    read (`launch() -> PendingScores`): what a caller that keeps the device fed sustains."""
    launch().result()
    times = []
    for _ in range(iters):
        started = time.perf_counter()
        pending = launch()
        for _ in range(PIPELINE_WINDOW - 1):
            ahead, pending = pending, launch()
            ahead.result()
        pending.result()
        times.append((time.perf_counter() - started) / PIPELINE_WINDOW)
    return times


def gemm_ceiling(dev) -> float:
    """Measured dense bf16 GEMM rate (FLOP/s) on this device; on CPU the float32 rate."""
    n, dtype = (8192, torch.bfloat16) if dev.type == "cuda" else (1024, torch.float32)
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    t = statistics.median(timed(lambda: a @ b, 10, sync))
    return 2 * n ** 3 / t


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small CPU run on the tiny model")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--batches", default=None, help=f"comma-separated batch sizes (default {DEFAULT_BATCHES})")
    ap.add_argument("--state-tokens", default=None, help="comma-separated state lengths in tokens")
    ap.add_argument("--methods", default="reference,full_fast,cached_eager,cached_graphs,cached_graphs_deterministic",
                    help="comma-separated; METHOD@B+B... times that method at those of the batch sizes alone "
                         "(full_fast@32: the baseline at batch 32 only)")
    ap.add_argument("--questions", type=int, default=10)
    ap.add_argument("--options", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=400)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--schemas", default=None,
                    help="comma-separated schema counts: time batches spread over that many live schemas instead")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--set", action="append", default=[], type=parse_setting, metavar="module.ATTR=LITERAL",
                    help="set an engine switch before anything runs, e.g. engine.model.ANSWER_QUERIES=True (repeatable)")
    args = ap.parse_args(argv)
    for module, attr, value in args.set:
        setattr(importlib.import_module(module), attr, value)
    cuda = torch.cuda.is_available() and not args.quick
    args.device = args.device or ("cuda" if cuda else "cpu")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    batches = [int(x) for x in (args.batches or ("1,4" if args.quick else DEFAULT_BATCHES)).split(",")]
    lengths = [int(x) for x in (args.state_tokens or ("32" if args.quick else "64,128,256")).split(",")]
    iters = args.iters or (2 if args.quick else 10)
    only = parse_methods(args.methods)
    methods = [m for m in only if not m.startswith("cached_graphs") or args.device.startswith("cuda")]

    eng, model_desc = build_engine(args)
    dev = eng.dev
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if args.schemas:
        return many_schemas(args, eng, model_desc, [int(x) for x in args.schemas.split(",")],
                            [int(x) for x in (args.batches or ("4" if args.quick else "128")).split(",")],
                            [int(x) for x in (args.state_tokens or ("32" if args.quick else "128")).split(",")],
                            iters, sync)
    qs = questions(eng.tok, args.questions, args.options, args.prefix_tokens if not args.quick else 60)
    se_eager, se_graph, full = SchemaEngine(eng, use_graphs=False), SchemaEngine(eng, use_graphs=True), FullPromptScorer(eng)
    h_eager, h_graph = se_eager.prepare(qs), se_graph.prepare(qs)
    # the same weights behind a deterministic forward (its own fused matrices: one more copy of the layers' weights)
    det_eng = Engine(eng.model, eng.tok, model_id=eng.model_id, deterministic=True)
    se_det_eager, se_det_graph = SchemaEngine(det_eng, use_graphs=False), SchemaEngine(det_eng, use_graphs=True)
    h_det_eager, h_det_graph = se_det_eager.prepare(qs), se_det_graph.prepare(qs)
    nonemb = sum(p.numel() for n, p in eng.model.named_parameters() if "embed" not in n and "lm_head" not in n)
    flop_per_token = 2 * nonemb
    ceiling = gemm_ceiling(dev)
    env = dict(gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
               torch=torch.__version__, transformers=__import__("transformers").__version__, fla=_fla_version(),
               delta_rule=se_eager.fwd.kernels.name,
               deterministic_kernels=se_det_graph.fwd.kernels.name,
               model=model_desc, dtype=args.dtype,
               prefix_tokens=h_eager.prefix_tokens, questions=args.questions, options=args.options,
               flop_per_token=flop_per_token, gemm_ceiling_tflops=ceiling / 1e12,
               settings=[f"{m}.{a}={v!r}" for m, a, v in args.set],
               date=datetime.date.today().isoformat())
    print(json.dumps(env), flush=True)
    # Parity first: a run cut short by a time limit still shows that what it timed computes the right thing.
    parity = _parity(eng, full, qs, dev, {"cached_eager": (se_eager, h_eager), "cached_graphs": (se_graph, h_graph),
                                          "cached_eager_deterministic": (se_det_eager, h_det_eager),
                                          "cached_graphs_deterministic": (se_det_graph, h_det_graph)})
    without_mass = _without_label_mass(methods, qs, {"cached_eager": (eng, False), "cached_graphs": (eng, True),
                                                     "cached_eager_deterministic": (det_eng, False),
                                                     "cached_graphs_deterministic": (det_eng, True)})
    print(f"max |p - reference| on 16 states: {json.dumps(parity)}", flush=True)
    runs = []
    _save(args, env, runs, parity=parity)
    for L in lengths:
        for B in batches:
            S = states(eng.tok, B, L, seed=B * 1000 + L)
            rows = [se_eager.tokenize(h_eager, s) for s in S]
            suffix_tokens = statistics.mean(len(r.ids) for r in rows)
            prompt = full.prompts(qs, S)
            prompt_tokens = statistics.mean(map(len, prompt[1]))
            requests = [(h_graph, r) for r in rows]                 # the pipelined method's batch
            calls = {
                "reference": (lambda: score_full(eng, qs, S, batch_size=B), prompt_tokens),
                "full_fast": (lambda: full.score_prompts(*prompt), prompt_tokens),
                "cached_eager": (lambda: se_eager.score_rows(h_eager, rows), suffix_tokens),
                "cached_graphs": (lambda: se_graph.score_rows(h_graph, rows), suffix_tokens),
                "cached_eager_deterministic": (lambda: se_det_eager.score_rows(h_det_eager, rows), suffix_tokens),
                "cached_graphs_deterministic": (lambda: se_det_graph.score_rows(h_det_graph, rows), suffix_tokens),
                "cached_graphs_pipelined": (lambda: se_graph.launch_mixed(requests), suffix_tokens),
                **{m: (lambda se=se, h=h: se.score_rows(h, rows), suffix_tokens) for m, (se, h) in without_mass.items()},
            }
            timings: dict[str, list[float]] = {}
            spent: dict[str, float] = {}
            peak: dict[str, int | None] = {}
            for m, n in alternated([m for m in methods if only[m] is None or B in only[m]], iters):
                fn, _ = calls[m]
                if dev.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(dev)
                started = time.perf_counter()
                timings.setdefault(m, []).extend(pipelined(fn, n) if m.endswith("_pipelined") else timed(fn, n, sync))
                spent[m] = spent.get(m, 0.0) + time.perf_counter() - started
                peak[m] = max(peak.get(m) or 0, torch.cuda.max_memory_allocated(dev)) if dev.type == "cuda" else None
            for m, ts in timings.items():
                tokens_run = calls[m][1]
                p50, p99 = statistics.median(ts), _pct(ts, 0.99)
                tok_s = B * tokens_run / p50
                r = dict(method=m, batch=B, state_tokens=L, suffix_tokens=round(suffix_tokens, 1),
                         prompt_tokens=round(prompt_tokens, 1), states_per_s=B / p50, tokens_per_s=tok_s,
                         gemm_fraction=tok_s * flop_per_token / ceiling, p50_ms=p50 * 1e3, p99_ms=p99 * 1e3,
                         iters=len(ts),
                         prefix_tokens_saved_per_state=(h_eager.prefix_tokens if m.startswith("cached") else 0),
                         gpu_mem_gb=(peak[m] / 1e9 if peak[m] is not None else None))
                runs.append(r)
                print(_row(r), f"  ({spent[m]:.1f} s incl. warm-up and captures)", flush=True)
                _save(args, env, runs, parity=parity)   # after every row: a run cut short still leaves its numbers
    result = dict(env=env, runs=runs, parity=parity, graph_stats=se_graph.graph_stats(),
                  deterministic_graph_stats=se_det_graph.graph_stats())
    print(markdown(result))
    path = _save(args, env, runs, parity=parity, graph_stats=result["graph_stats"],
                 deterministic_graph_stats=result["deterministic_graph_stats"])
    if path:
        print(f"wrote {path}")
    return result


def many_schemas(args, eng, model_desc: str, counts: list[int], batches: list[int], lengths: list[int], iters: int,
                 sync) -> dict:
    """States/s with N live schemas, states spread evenly over them: one mixed batch against one call per schema."""
    det_eng = Engine(eng.model, eng.tok, model_id=eng.model_id, deterministic=eng.dev.type == "cuda")
    se = SchemaEngine(det_eng, prefix_slots=max(counts))
    prefix = args.prefix_tokens if not args.quick else 60
    pool = [se.prepare(questions(eng.tok, args.questions, args.options, prefix + 16 * (i % 5) - 32, seed=i))
            for i in range(max(counts))]
    env = dict(gpu=torch.cuda.get_device_name(eng.dev) if eng.dev.type == "cuda" else platform.processor() or "cpu",
               torch=torch.__version__, fla=_fla_version(), kernels=se.fwd.kernels.name, model=model_desc,
               dtype=args.dtype, questions=args.questions, options=args.options,
               prefix_tokens=sorted({h.prefix_tokens for h in pool}), date=datetime.date.today().isoformat())
    print(json.dumps(env), flush=True)
    runs = []
    for N in counts:
        live = pool[:N]
        for L in lengths:
            for B in batches:
                texts = states(eng.tok, B, L, seed=B * 1000 + L)
                requests = [(live[i % N], se.tokenize(live[i % N], t)) for i, t in enumerate(texts)]
                by_schema = {}
                for h, row in requests:
                    by_schema.setdefault(h.id, (h, []))[1].append(row)
                calls = {"mixed": lambda: se.score_mixed(requests),
                         "per_schema": lambda: [se.score_lists(h, rows) for h, rows in by_schema.values()]}
                for method, fn in calls.items():
                    p50 = statistics.median(timed(fn, iters, sync))
                    memory = se.memory()
                    r = dict(method=method, schemas=N, batch=B, state_tokens=L, states_per_s=B / p50, p50_ms=p50 * 1e3,
                             graphs=se.graph_stats()["graphs"], bank_mb=memory["bank_bytes"] / 2**20,
                             slot_mb=memory["slot_bytes"] / 2**20,
                             gpu_mem_gb=(torch.cuda.memory_allocated(eng.dev) / 1e9 if eng.dev.type == "cuda" else None))
                    runs.append(r)
                    print(json.dumps(r), flush=True)
                    _save(args, env, runs, suffix="-schemas")
    one = {(r["method"], r["batch"], r["state_tokens"]): r["states_per_s"] for r in runs if r["schemas"] == counts[0]}
    lines = ["| method | schemas | batch | state tokens | states/s | vs " f"{counts[0]} schema(s) | p50 ms | graphs | "
             "bank MiB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        base = one.get((r["method"], r["batch"], r["state_tokens"]))
        lines.append(f"| {r['method']} | {r['schemas']} | {r['batch']} | {r['state_tokens']} | {r['states_per_s']:,.1f} | "
                     f"{r['states_per_s'] / base:.2f} | {r['p50_ms']:.2f} | {r['graphs']} | {r['bank_mb']:.0f} |")
    print("\n".join(lines))
    return dict(env=env, runs=runs)


NO_LABEL_MASS = "_no_label_mass"


def _without_label_mass(methods: list[str], qs: list[dict], bases: dict) -> dict:
    """The SchemaEngines (label_mass=False) and handles of the requested METHOD_no_label_mass methods; bases: METHOD ->
    (engine, graphs)."""
    out = {}
    for m in methods:
        base = m[:-len(NO_LABEL_MASS)] if m.endswith(NO_LABEL_MASS) else None
        if base in bases:
            engine_, graphs = bases[base]
            se = SchemaEngine(engine_, use_graphs=graphs, label_mass=False)
            out[m] = (se, se.prepare(qs))
    return out


def _save(args, env, runs, suffix: str = "", **extra) -> Path | None:
    if args.quick:
        return None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{env['date']}-{env['gpu'].replace(' ', '-').lower()}{suffix}.json"
    path.write_text(json.dumps(dict(env=env, runs=runs, **extra), indent=1))
    return path


def _parity(eng, full, qs, dev, cached: dict) -> dict:
    """max |p - oracle| per method on 16 states; cached: method -> (SchemaEngine, handle)."""
    S = states(eng.tok, 16, 100, seed=5)
    ref = torch.stack(score_full(eng, qs, S))
    got = {"full_fast": full.score_prompts(*full.prompts(qs, S)).cpu()}
    for m, (se, h) in cached.items():
        if dev.type == "cuda" or "graphs" not in m:
            got[m] = torch.stack(se.score(h, S))
    return {m: (p - ref).abs().max().item() for m, p in got.items()}


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _fla_version():
    try:
        import fla
        return getattr(fla, "__version__", "installed")
    except ImportError:
        return None


def _row(r) -> str:
    mem = "" if r["gpu_mem_gb"] is None else f"{r['gpu_mem_gb']:.2f}"
    return (f"| {r['method']} | {r['batch']} | {r['state_tokens']} | {r['states_per_s']:,.1f} | {r['tokens_per_s']:,.0f} "
            f"| {r['gemm_fraction']:.3f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
            f"{mem} |")


def markdown(result) -> str:
    env, lines = result["env"], []
    lines.append(f"{env['gpu']}, torch {env['torch']}, transformers {env['transformers']}, fla {env['fla']}, "
                 f"{env['model']}, {env['dtype']}; prefix {env['prefix_tokens']} tokens, {env['questions']} questions x "
                 f"{env['options']} options; GEMM ceiling {env['gemm_ceiling_tflops']:.0f} TFLOP/s")
    lines.append("")
    lines.append("| method | batch | state tokens | states/s | tokens/s | GEMM fraction | p50 ms | p99 ms | GPU GB |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    lines += [_row(r) for r in result["runs"]]
    by = {(r["method"], r["batch"], r["state_tokens"]): r for r in result["runs"]}
    lines.append("")
    for (m, B, L), r in sorted(by.items()):
        if m.endswith(NO_LABEL_MASS) and (m[:-len(NO_LABEL_MASS)], B, L) in by:
            with_mass = by[(m[:-len(NO_LABEL_MASS)], B, L)]
            lines.append(f"- batch {B}, {L}-token states: the label mass costs "
                         f"{1 - with_mass['states_per_s'] / r['states_per_s']:.1%} of {with_mass['method']}'s states/s "
                         f"({with_mass['p50_ms']:.2f} against {r['p50_ms']:.2f} ms)")
        if m.endswith("_deterministic") and (m[:-len("_deterministic")], B, L) in by:
            base = by[(m[:-len("_deterministic")], B, L)]
            lines.append(f"- batch {B}, {L}-token states: {m} / {base['method']} = "
                         f"{r['states_per_s'] / base['states_per_s']:.3f}x states/s")
        if m == "cached_graphs" and ("full_fast", B, L) in by:
            f = by[("full_fast", B, L)]
            ratio = r["states_per_s"] / f["states_per_s"]
            lines.append(f"- batch {B}, {L}-token states: cached_graphs / full_fast = {ratio:.2f}x "
                         f"(token ratio {r['prompt_tokens'] / r['suffix_tokens']:.2f})")
    lines.append(f"- max |p - oracle| on 16 states: {json.dumps(result['parity'])}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
