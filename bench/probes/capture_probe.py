"""What a CUDA graph capture costs on the scoring path, and what scoring sees once captures run beside it (GPU only).

    python bench/probes/capture_probe.py [--fast] [--max-batch 8] [--out DIR]

On the Qwen3.5-0.8B-shaped random model (`bench.workload`), one kernel table per process (the default deterministic
one, or --fast), 128-token states, a 10 x 4 schema with a 400-token prefix:

inline      today's path (`SchemaEngine()`: a step captures its missing graph before it runs): the process's first
            batch, a replay, then batches of a new length bucket, a new batch bucket and a new key (a 20-question
            schema: 32 answers a row), each with its capture split into warm-up, capture call and the rest (end of
            capture and instantiation), from the manager's records and a wrapped step
graph_ctx   what `torch.cuda.graph`'s entry adds to each capture in a serving process (synchronize, empty_cache and the
            pinned-memory empty_cache) and what the next steps pay for it
background  the worker's path (`SchemaEngine(background_captures=True)`): a schema's announced plan (graphs, bytes,
            seconds); 8-state batches of a held shape scored while another schema's plan is captured beside them
            against the same batches with nothing being captured; a new schema of a new question count met
            mid-stream (5 questions: 8 answers a row), its first batch (on a larger graph) and the same batch on its
            own graph once captured, with their bits compared; a schema no held graph serves (40 questions: 64 a
            row), its first batch eagerly

Writes capture_probe_<table>.json under --out and prints one line per figure.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.workload import build_engine, questions, states  # noqa: E402
from engine import SchemaEngine  # noqa: E402
from engine import capture as capture_module  # noqa: E402
from engine import graphs as graphs_module  # noqa: E402


def timed(fn):
    # the stream the scoring runs on, not the device: a capture may be under way on another thread
    torch.cuda.current_stream().synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.current_stream().synchronize()
    return out, time.perf_counter() - t


class SplitRecord:
    """Wraps `GraphManager._record` to split a capture: static inputs + warm-up (synchronised), the captured call (host
    time), and the rest (capture_end: instantiation)."""

    def __init__(self):
        self.splits: list[dict] = []
        self._orig = graphs_module.GraphManager._record

    def __enter__(self):
        probe = self

        def record(manager, example, fn, keep, begin, host_wait=False):
            calls = []

            def wrapped(*a):
                t = time.perf_counter()
                out = fn(*a)
                if len(calls) < capture_module.WARMUP_RUNS:
                    torch.cuda.current_stream().synchronize()
                calls.append(time.perf_counter() - t)
                return out
            t0 = time.perf_counter()
            made = probe._orig(manager, example, wrapped, keep, begin, host_wait)
            total = time.perf_counter() - t0
            if made is not None:
                warm = sum(calls[:-1])
                probe.splits.append({"warmup_s": round(warm, 4), "capture_call_s": round(calls[-1], 4),
                                     "end_and_instantiate_s": round(total - warm - calls[-1], 4),
                                     "total_s": round(total, 4), "nbytes": made[1]})
            return made
        graphs_module.GraphManager._record = record
        return self

    def __exit__(self, *exc):
        graphs_module.GraphManager._record = self._orig


def batch_times(se, h, rows, n):
    return [timed(lambda: se.score_lists(h, rows))[1] for _ in range(n)]


def ms(x):
    return round(x * 1000, 2)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fast", action="store_true", help="the fast kernel table (default: the deterministic one)")
    ap.add_argument("--max-batch", type=int, default=8, help="states a batch at most, for the announced plans")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    args.quick, args.device, args.dtype, args.deterministic = False, "cuda", "bfloat16", not args.fast
    table = "fast" if args.fast else "deterministic"
    t = time.perf_counter()
    eng, model = build_engine(args)
    result = {"table": table, "model": model, "load_s": round(time.perf_counter() - t, 1),
              "warmup_runs": capture_module.WARMUP_RUNS}
    tok = eng.tok
    schema = questions(tok, 10, 4, 400)
    wide = questions(tok, 20, 4, 600, seed=2)
    texts = {n: states(tok, 16, n, seed=n) for n in (96, 104, 112, 120, 128)}

    # ---- inline: today's path -----------------------------------------------------------------------------------
    split = SplitRecord()
    with split:
        se = SchemaEngine(eng)
        h = se.prepare(schema)
        hw = se.prepare(wide)
        inline = []
        for label, hh, n, tokens in [("first batch in the process", h, 8, 128), ("replay", h, 8, 128),
                                     ("new length bucket (120 tokens)", h, 8, 120),
                                     ("new length bucket (112)", h, 8, 112), ("new batch bucket (4)", h, 4, 128),
                                     ("new batch bucket (6)", h, 6, 128),
                                     ("new key (20 questions: 32 a row)", hw, 8, 128), ("replay", h, 8, 128)]:
            rows = [se.tokenize(hh, s) for s in texts[tokens][:n]]
            before = len(split.splits)
            _, seconds = timed(lambda: se.score_lists(hh, rows))
            inline.append({"what": label, "ms": ms(seconds), "captures": split.splits[before:]})
            print(f"inline {label}: {ms(seconds)} ms {split.splits[before:]}", flush=True)
        result["inline"] = inline

        # ---- what torch.cuda.graph's entry would add --------------------------------------------------------------
        rows = [se.tokenize(h, s) for s in texts[128][:8]]
        quiet = batch_times(se, h, rows, 10)
        host_empty = getattr(torch._C, "_host_emptyCache", lambda: None)
        _, ctx = timed(lambda: (torch.cuda.synchronize(), torch.cuda.empty_cache(), host_empty()))
        after = batch_times(se, h, rows, 3)
        result["graph_ctx"] = {"entry_ms": ms(ctx), "batch_ms_before": ms(statistics.median(quiet)),
                               "next_batches_ms": [ms(x) for x in after]}
        print(f"torch.cuda.graph entry: {ms(ctx)} ms; batches after it {[ms(x) for x in after]} ms against "
              f"{ms(statistics.median(quiet))}", flush=True)
        del se, h, hw

        # ---- background: the worker's path ----------------------------------------------------------------------
        se = SchemaEngine(eng, background_captures=True)
        huge_questions = questions(tok, 40, 2, 900, seed=4)             # 64 answers a row: nothing will serve it
        se.release(se.prepare(huge_questions))    # sizes the bank for it now: no reallocation (and recapture) later
        h = se.prepare(schema)
        free0 = torch.cuda.mem_get_info()[0]
        started = time.perf_counter()
        plan = se.announce(h, max_batch=args.max_batch, state_tokens=(128,))
        se.wait_for_captures()
        first_plan = {"graphs": len(plan), "seconds": round(time.perf_counter() - started, 2),
                      "device_mib": round((free0 - torch.cuda.mem_get_info()[0]) / 2**20, 1),
                      "per_capture_ms": [ms(r.seconds) for r in se.graphs.records]}
        result["plan_of_the_first_schema"] = first_plan
        print(f"plan of the first schema: {first_plan}", flush=True)

        rows = [se.tokenize(h, s) for s in texts[128][:8]]
        quiet = batch_times(se, h, rows, 30)
        hw = se.prepare(wide)
        n_records = len(se.graphs.records)
        plan = se.announce(hw, max_batch=args.max_batch, state_tokens=(128, 112))
        busy = []
        while se.graph_stats()["pending"]:
            busy.extend(batch_times(se, h, rows, 1))
        se.wait_for_captures()
        added = list(se.graphs.records)[n_records:]
        result["beside_captures"] = {
            "plan_graphs": len(plan), "captured": len(added), "capture_s": round(sum(r.seconds for r in added), 2),
            "capture_ms_median": ms(statistics.median(r.seconds for r in added)),
            "device_mib": round(sum(r.nbytes for r in added) / 2**20, 1),
            "quiet_batch_ms": {"median": ms(statistics.median(quiet)), "max": ms(max(quiet))},
            "busy_batch_ms": {"n": len(busy), "median": ms(statistics.median(busy)),
                              "p90": ms(sorted(busy)[int(0.9 * (len(busy) - 1))]), "max": ms(max(busy))}}
        print(f"beside captures: {result['beside_captures']}", flush=True)

        for label, qs, n, announced in [("new_schema_mid_stream", questions(tok, 5, 4, 250, seed=3), 8, True),
                                        ("uncovered_schema", huge_questions, 4, False)]:
            # 5 questions: 8 answers a row, a key never captured, announced; 40: 64 a row, nothing serves it
            hh = se.prepare(qs)
            plan = se.announce(hh, max_batch=args.max_batch, state_tokens=(128,)) if announced else []
            rows = [se.tokenize(hh, s) for s in texts[128][:n]]
            before = se.graph_stats()
            first, first_s = timed(lambda: se.score_lists(hh, rows))
            mid = se.graph_stats()
            se.wait_for_captures()
            own, own_s = timed(lambda: se.score_lists(hh, rows))
            result[label] = {"plan_graphs": len(plan), "first_batch_ms": ms(first_s),
                             "covered": mid["covered"] - before["covered"], "eager": mid["eager"] - before["eager"],
                             "own_graph_batch_ms": ms(own_s), "same_bits": own == first}
            print(f"{label}: {result[label]}", flush=True)
        result["graph_stats"] = se.graph_stats()
        result["splits_background"] = split.splits[-8:]
    out = Path(args.out) / f"capture_probe_{table}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
