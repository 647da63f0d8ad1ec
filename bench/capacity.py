"""Real-time capacity: the highest offered load at which each latency budget still holds (`stream_bench.py --capacity`).

    python bench/stream_bench.py --capacity                          # GPU: budgets 25, 50, 100 ms, broker delay 0
    python bench/stream_bench.py --capacity --broker-delay-ms 2      # through bench/latency_proxy.py, 2 ms each way
    python bench/stream_bench.py --capacity --quick                  # CPU, tiny model (the tests run it)
    python bench/capacity.py --plot bench/results/X-capacity.json    # the PNG again, from a result (needs matplotlib)

The run measures the full-load throughput first (`stream_phases.throughput_phase`, the workers reaching the broker
through the proxy when there is a delay), then for each budget B starts workers with `--latency-budget-ms B
--max-wait-ms B` and offers states at fractions of that throughput, ascending (--capacity-loads, default 30% to 95%),
--capacity-samples windows per load (default 2), each --latency-warmup-seconds unmeasured then --latency-seconds
measured (`stream_phases.latency_window`), after --capacity-settle-seconds at the budget's first load that are not
measured either (`_settle`: a fresh broker's and workers' first seconds). A load holds when every sample has p99
event -> visible <= B and at most 1% of its states over B; B's capacity is the highest load held with every lower
measured load held too, as a fraction of the full-load throughput, and a budget stops climbing at its first load that
does not hold.

Every window's states over B are charged to one cause each (`bench/tail_causes.py`: the GPU busy with the cycle
ahead, the state's own scoring, a host stage, a broker call, garbage collection, a pause of Apache Kafka's JVM, a graph
capture, a rebalance, the reader): the window's `tail_causes` and each load's (its windows together) in the JSON, a
table below the capacity table, and the PNG's second panel (the share of each load's states over B, stacked by cause).

Each phase runs on an embedded broker of its own (``fresh_broker`` says why). Two simplifications keep a run inside
one GPU call, and both are in the JSON: the samples of a budget are consecutive
windows on one set of warm workers and topics (a window starts after the one before is visible in full; starting
fresh workers per sample would cost a model load and the graph captures each time), and a budget starts one load step
below the capacity of the tighter budget before it (`first_load`): the loads below that held for the tighter budget
(where its first load does not hold, the loads below it are measured, highest first, until one holds).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import tail_causes  # noqa: E402
from bench.stream_phases import exactly_once, latency_window, produce, running_stream, throughput_phase  # noqa: E402
from worker.devbroker.processes import free_port  # noqa: E402
from worker.ops.ports import port_open  # noqa: E402

DEFAULT_LOADS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
OVER_BUDGET_SHARE = 0.01   # a load holds with at most this share of a sample's states over the budget


@contextlib.contextmanager
def slower_broker(broker_port: int, delay_ms: float, logs: Path):
    """The workers' bootstrap: the broker itself without a delay, else a latency proxy in front of it (its own process,
    so its threads do not share the bench's interpreter) -> (bootstrap, the proxy's stats once it stopped)."""
    stats: dict = {"delay_ms": 0.0}
    if not delay_ms:
        yield f"127.0.0.1:{broker_port}", stats
        return
    listen, stats_file = f"127.0.0.3:{free_port()}", logs / "proxy-stats.json"
    proxy = subprocess.Popen([sys.executable, "-m", "bench.latency_proxy", "--upstream", f"127.0.0.1:{broker_port}",
                              "--listen", listen, "--delay-ms", str(delay_ms), "--stats", str(stats_file)],
                             cwd=Path(__file__).resolve().parents[1], stdout=open(logs / "proxy.log", "ab"),
                             stderr=subprocess.STDOUT)
    try:
        _wait_listening(listen, proxy)
        yield listen, stats
    finally:
        proxy.terminate()
        proxy.wait(10)
        if stats_file.exists():
            stats.update(json.loads(stats_file.read_text()))


def _wait_listening(address: str, proxy: subprocess.Popen, timeout_s: float = 10) -> None:
    host, port = address.rsplit(":", 1)
    deadline = time.time() + timeout_s
    while not port_open(int(port), host):
        if proxy.poll() is not None:
            raise SystemExit(f"the latency proxy exited ({proxy.returncode}); see its log")
        if time.time() > deadline:
            raise SystemExit(f"the latency proxy did not listen on {address} within {timeout_s} s")
        time.sleep(0.05)


def holds(sample: dict, budget_ms: int) -> bool:
    """Whether one window met the budget: p99 within it and at most OVER_BUDGET_SHARE of its states over it."""
    return sample["p99_ms"] <= budget_ms and sample["over_budget"] <= OVER_BUDGET_SHARE * sample["measured_visible"]


def capacity_of(points: list[dict]) -> float:
    """The highest load of ``points`` (ascending) held with every load before it held too (0 if the first fails)."""
    capacity = 0.0
    for point in points:
        if not point["held"]:
            break
        capacity = point["load"]
    return capacity


def _sample_summary(window: dict) -> dict:
    """A window's figures for the capacity JSON: its latencies, the worker's view of it, without the per-cycle lists."""
    keep = ("offered_states_per_s", "states", "measured_visible", "p50_ms", "p99_ms", "max_ms", "over_budget",
            "worker0_cycles_over_budget", "worker0_cycles", "worker0_plans", "worker0_timelines", "worker0_pipeline",
            "worker0_stage_means", "p50_to_scored_ms", "p50_scored_to_visible_ms", "tail_causes", "cpu_throttled")
    return {k: window[k] for k in keep if k in window}


def budget_curve(args, bootstrap: str, model_dir, schema_file, texts, logs, budget_ms: int, full_rate: float,
                 loads: list[float], below: list[float] = ()) -> dict:
    """Offer each of ``loads`` (fractions of ``full_rate``) to workers run with ``budget_ms``, until one does not hold;
    where the first does not, the ``below`` loads, highest first, until one holds (a budget's first load is the one the
    tighter budget held: run DK's 100 ms failed it on its start-up queue, and its capacity read 0)."""
    points, ids = [], []
    with running_stream(args, bootstrap, model_dir, schema_file, texts, logs, f"cap{budget_ms}", budget_ms,
                        budget_ms) as (stream, reader, warm_ids):
        ids += warm_ids
        settled = _settle(args, stream, reader, texts, loads[0] * full_rate)
        ids += settled
        measure = lambda load: _load_point(args, stream, reader, texts, load, full_rate, budget_ms, ids)  # noqa: E731
        for load in loads:
            points.append(measure(load))
            if not points[-1]["held"]:
                break
        if points and not points[0]["held"]:
            for load in sorted(below, reverse=True):
                points.insert(0, measure(load))
                if points[0]["held"]:
                    break
        time.sleep(1.0)   # a duplicate would be visible by now
        once = exactly_once(reader, ids)
    capacity = capacity_of(points)
    return dict(budget_ms=budget_ms, first_load=loads[0], settle_states=len(settled), capacity=capacity,
                capacity_states_per_s=capacity * full_rate,
                points=points, **{f"exactly_once_{k}": v for k, v in once.items()})


def _settle(args, stream, reader, texts, rate: float) -> list[str]:
    """--capacity-settle-seconds of states at ``rate`` before a budget's first window, not measured -> their ids.

    Each budget starts a fresh broker and fresh workers, and on the GPU machine both took ~10 s of load to settle:
    in every phase of run DM (Apache Kafka, H100) the transactions took 10-14 ms a cycle in the first seconds, 6-8 ms
    5 s on and ~4 ms from ~12 s on, at an unchanged offered rate, with the close-to-launch and GPU times of each cycle
    elevated alike; the 25 ms budget's first window failed in those seconds, the steady state that a long-running
    broker and worker serve in production was measured only after it. 0 measures from the first window, as before."""
    if not args.capacity_settle_seconds:
        return []
    ids = [f"settle-{i}" for i in range(int(rate * args.capacity_settle_seconds))]
    start_seen = len(reader.visible)
    produce(stream.bootstrap, stream.topics.states, ids, [texts[i % len(texts)] for i in range(len(ids))], rate=rate)
    if not reader.wait_for(start_seen + len(ids), 120):
        raise SystemExit(f"the settling states at {rate:,.0f}/s were not all visible within 120 s; see {stream.logs}")
    return ids


def _load_point(args, stream, reader, texts, load: float, full_rate: float, budget_ms: int, ids: list) -> dict:
    """One load's --capacity-samples windows on the running workers -> its point (printed as it ends); the states'
    ids are added to ``ids``."""
    samples = []
    for k in range(args.capacity_samples):
        window = latency_window(args, stream, reader, texts, load * full_rate, f"c{round(load * 100)}s{k}", budget_ms)
        ids += window.pop("ids")
        samples.append(_sample_summary(window))
    point = dict(load=load, offered_states_per_s=load * full_rate, held=all(holds(s, budget_ms) for s in samples),
                 p99_ms=[s["p99_ms"] for s in samples], over_budget_share=[
                     s["over_budget"] / s["measured_visible"] for s in samples],
                 tail_causes=tail_causes.merged([s["tail_causes"] for s in samples if "tail_causes" in s]),
                 samples=samples)
    throttled = ", ".join(f"{t['throttled_ms']:.0f} ms in {t['throttled_periods']}" for t in
                          (s["cpu_throttled"] for s in samples if s.get("cpu_throttled")))
    print(f"budget {budget_ms} ms, load {load:.0%} ({load * full_rate:,.0f}/s): p99 "
          f"{', '.join(f'{p:.1f}' for p in point['p99_ms'])} ms -> {'holds' if point['held'] else 'does not hold'}"
          + (f" (the CPU quota throttled {throttled} periods)" if throttled else ""), flush=True)
    return point


def loads_from(grid: list[float], tighter_capacity: float | None) -> list[float]:
    """The loads to offer a budget: the grid from one step below the tighter budget's capacity (all of it for the
    first budget, or when the tighter one held nothing)."""
    if not tighter_capacity:
        return grid
    below = [load for load in grid if load < tighter_capacity]
    start = below[-1] if below else grid[0]
    return [load for load in grid if load >= start]


@contextlib.contextmanager
def fresh_broker(args, logs: Path, name: str):
    """A new broker (``--broker``) for one phase, and the workers' way to it -> (broker, proxy stats once it stopped).

    One per phase because noida-db stalls every request for a while every few seconds, longer as it holds more
    data (measured on the H200, run BW in bench/README.md: 27 ms early in a run, 73 ms after 80,000 records); on
    Apache Kafka a fresh one too, so that the two brokers' phases start alike."""
    from bench.bench_broker import bench_broker
    with bench_broker(args.broker, logs, f"broker-{name}") as broker, \
            slower_broker(broker.port, args.broker_delay_ms, logs) as (worker_bootstrap, proxy_stats):
        args.worker_bootstrap = worker_bootstrap
        # Apache Kafka's log, with its JVM's pauses (the tail's ``broker_gc``); the embedded broker has none
        args.broker_log = getattr(broker, "log_path", None)
        yield broker, proxy_stats


def capacity_run(args, env: dict, engine_rate: float, model_dir, schema_file, texts, logs: Path) -> dict:
    """The whole capacity measurement (see the module's docstring), each phase on a broker of its own."""
    grid = sorted(args.capacity_loads)
    if getattr(args, "full_load_rate", None):    # given: two trees compared at the same offered rates
        full_rate = args.full_load_rate
        full = dict(phase="given", states_per_s=full_rate, fraction_of_engine=full_rate / engine_rate, proxy={})
    else:
        with fresh_broker(args, logs, "tput") as (broker, proxy_stats):
            full = throughput_phase(args, broker.bootstrap, model_dir, schema_file, texts, logs)
        full["proxy"] = proxy_stats
        full_rate = full["all_workers_states_per_s"] or full["states_per_s"]
        full["fraction_of_engine"] = full_rate / engine_rate
    print(f"full load: {full_rate:,.1f} states/s ({full['fraction_of_engine']:.1%} of engine-only)", flush=True)
    curves, tighter = [], None
    for budget_ms in sorted(args.latency_budget_ms):
        with fresh_broker(args, logs, f"cap{budget_ms}") as (broker, proxy_stats):
            loads = loads_from(grid, tighter)
            curve = budget_curve(args, broker.bootstrap, model_dir, schema_file, texts, logs, budget_ms, full_rate,
                                 loads, [load for load in grid if load < loads[0]])
        curve["proxy"] = proxy_stats
        curves.append(curve)
        tighter = curve["capacity"]
    return dict(env=env, broker_delay_ms=args.broker_delay_ms, engine_only_states_per_s=engine_rate,
                full_load=full, full_load_states_per_s=full_rate, loads=grid, samples_per_load=args.capacity_samples,
                window_seconds=args.latency_seconds, warmup_seconds=args.latency_warmup_seconds,
                settle_seconds=args.capacity_settle_seconds,
                capacity={str(c["budget_ms"]): c["capacity"] for c in curves}, budgets=curves, logs=str(logs))


def markdown(result: dict) -> str:
    """The capacity table: per budget, its capacity and each load's p99s."""
    env = result["env"]
    lines = [f"{env['gpu']}, broker delay {result['broker_delay_ms']} ms each way, full load "
             f"{result['full_load_states_per_s']:,.1f} states/s ({result['full_load']['fraction_of_engine']:.1%} of "
             f"engine-only), {result['samples_per_load']} x {result['window_seconds']} s windows per load", "",
             "| budget ms | capacity | states/s | loads: p99 ms of each sample (held?) | exactly once |", "|---|---|---|---|---|"]
    for curve in result["budgets"]:
        loads = "; ".join(f"{p['load']:.0%}: {'/'.join(f'{x:.1f}' for x in p['p99_ms'])}{'' if p['held'] else ' ✗'}"
                          for p in curve["points"])
        lines.append(f"| {curve['budget_ms']} | {curve['capacity']:.0%} | {curve['capacity_states_per_s']:,.0f} | {loads} "
                     f"| {curve['exactly_once_ok']} |")
    lines += ["", "States over budget by cause (bench/tail_causes.py: one cause each, the one that took most of its time):",
              "", "| budget ms | load | over budget | causes (count) |", "|---|---|---|---|"]
    for curve in result["budgets"]:
        for p in curve["points"]:
            tail = p.get("tail_causes") or {}
            causes = ", ".join(f"{cause} {count}" for cause, count in
                               sorted(tail.get("causes", {}).items(), key=lambda kv: -kv[1]))
            lines.append(f"| {curve['budget_ms']} | {p['load']:.0%} | {tail.get('over_budget', '')} | {causes} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    """Two panels as a PNG at ``path`` (matplotlib): p99 against offered load per budget, with each budget's line;
    below, the states over budget per load and budget, stacked by cause (``bench.tail_causes``)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, tail_ax) = plt.subplots(2, 1, figsize=(8.5, 9.0), dpi=120, gridspec_kw={"height_ratios": [1.1, 1]})
    for k, curve in enumerate(result["budgets"]):
        color = f"C{k}"
        loads = [p["load"] * 100 for p in curve["points"]]
        ax.plot(loads, [max(p["p99_ms"]) for p in curve["points"]], "-o", color=color,
                label=f"budget {curve['budget_ms']} ms: capacity {curve['capacity']:.0%}")
        for p in curve["points"]:
            ax.scatter([p["load"] * 100] * len(p["p99_ms"]), p["p99_ms"], color=color, s=10, alpha=0.5)
        ax.axhline(curve["budget_ms"], color=color, linestyle="--", linewidth=1)
    env = result["env"]
    ax.set(xlabel=f"offered load, % of full-load throughput ({result['full_load_states_per_s']:,.0f} states/s)",
           ylabel="p99 event -> visible (ms)", yscale="log",
           title=f"{env['gpu']}: capacity per latency budget, broker delay {result['broker_delay_ms']:g} ms each way")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    _plot_tail(tail_ax, result)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _plot_tail(ax, result: dict) -> None:
    """Stacked bars: per (budget, load), the share of its measured states over the budget, by cause."""
    bars = [(curve["budget_ms"], p) for curve in result["budgets"] for p in curve["points"]]
    causes = [c for c in (*tail_causes.CAUSES, "unmapped")
              if any((p.get("tail_causes") or {}).get("causes", {}).get(c) for _, p in bars)]
    colors = dict(zip(causes, [matplotlib_color(k) for k in range(len(causes))]))
    bottoms = [0.0] * len(bars)
    measured = [sum(s["measured_visible"] for s in p["samples"]) or 1 for _, p in bars]
    for cause in causes:
        heights = [100 * (p.get("tail_causes") or {}).get("causes", {}).get(cause, 0) / n for (_, p), n in zip(bars, measured)]
        ax.bar(range(len(bars)), heights, bottom=bottoms, color=colors[cause], label=cause, width=0.8)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_xticks(range(len(bars)), [f"{b} ms\n{p['load']:.0%}" for b, p in bars], fontsize=7)
    ax.axhline(100 * OVER_BUDGET_SHARE, color="grey", linestyle=":", linewidth=1)
    ax.set(xlabel="budget, offered load", ylabel="measured states over budget (%)",
           title="why: each state over budget charged to the cause that took most of its time")
    ax.grid(True, axis="y", alpha=0.3)
    if causes:
        ax.legend(fontsize=7, ncol=4, loc="upper left")


def matplotlib_color(k: int) -> str:
    """The k-th colour of a palette long enough for every cause."""
    import matplotlib
    return matplotlib.colors.to_hex(matplotlib.colormaps["tab20"](k % 20))


def compare_plot(results: dict[str, list[dict]], path: Path) -> Path:
    """One panel as a PNG at ``path``: p99 against offered load, a colour per budget and a line style per label
    (e.g. ``{"before": [run 1, run 2], "after": [...]}``: an A/B of two trees or settings, each run a capacity result);
    each label's curve is the worse p99 of its runs at each load, every window a dot."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8.5, 5.5), dpi=120)
    budgets = sorted({curve["budget_ms"] for runs in results.values() for r in runs for curve in r["budgets"]})
    for style, (label, runs) in zip(("-o", "--s", ":^", "-.v"), results.items()):
        for k, budget in enumerate(budgets):
            windows: dict[float, list[float]] = {}
            for r in runs:
                for curve in (c for c in r["budgets"] if c["budget_ms"] == budget):
                    for point in curve["points"]:
                        windows.setdefault(point["load"] * 100, []).extend(point["p99_ms"])
            if not windows:
                continue
            held = [f"{c['capacity']:.0%}" for r in runs for c in r["budgets"] if c["budget_ms"] == budget]
            loads = sorted(windows)
            ax.plot(loads, [max(windows[x]) for x in loads], style, color=f"C{k}", alpha=0.85,
                    label=f"{label}, budget {budget} ms: capacity {', '.join(held)}")
            for x in loads:
                ax.scatter([x] * len(windows[x]), windows[x], color=f"C{k}", s=8, alpha=0.4)
    for k, budget in enumerate(budgets):
        ax.axhline(budget, color=f"C{k}", linestyle="--", linewidth=0.8)
    env = next(iter(results.values()))[0]["env"]
    ax.set(xlabel="offered load, % of the full-load rate", ylabel="p99 event -> visible (ms)", yscale="log",
           title=f"{env['gpu']}: {' against '.join(results)}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Render a capacity result's PNG (the run itself: stream_bench.py --capacity)")
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--plot", help="a capacity JSON from stream_bench.py --capacity")
    what.add_argument("--compare", nargs="+", metavar="LABEL=JSON",
                      help="capacity JSONs in one picture, a line style per label (a label given twice: its runs "
                           "together), e.g. before=a.json after=b.json; needs --png")
    ap.add_argument("--png", help="where to write it (default: beside the JSON)")
    args = ap.parse_args(argv)
    if args.plot:
        source = Path(args.plot)
        print(plot(json.loads(source.read_text()), Path(args.png) if args.png else source.with_suffix(".png")))
        return
    if not args.png:
        ap.error("--compare needs --png (where to write the picture)")
    results: dict[str, list[dict]] = {}
    for item in args.compare:
        label, sep, file = item.partition("=")
        if not sep or not label or not Path(file).is_file():
            ap.error(f"--compare: expected LABEL=JSON with an existing file, got {item!r}")
        results.setdefault(label, []).append(json.loads(Path(file).read_text()))
    print(compare_plot(results, Path(args.png)))


if __name__ == "__main__":
    main()
