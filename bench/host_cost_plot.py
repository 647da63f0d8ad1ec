"""The PNG of a `bench/host_cost.py` result: per tree, the host CPU a state and the GIL by thread against issue 46's
targets, and the largest stages.

    python bench/host_cost.py --plot bench/results/X-cpu-host-cost.json      # renders X-cpu-host-cost.png
"""
from __future__ import annotations

import statistics
from pathlib import Path

from bench.host_stages import thread_group

TARGET_US_PER_STATE = 60.0
"""Issue 46's host CPU a state, drawn on the PNG."""
TARGET_GIL_SHARE = 0.15
"""Issue 46's GIL held outside the engine, as a share of the wall time at 1,000 states/s."""


def _median_by_key(dicts: list[dict]) -> dict[str, float]:
    """Each key's median over ``dicts`` (a key missing from one counts 0 there)."""
    keys = {k for d in dicts for k in d}
    return {k: statistics.median(d.get(k, 0.0) for d in dicts) for k in keys} if dicts else {}


def plot(result: dict, path: Path, stages_shown: int = 12) -> Path:
    """The PNG at ``path`` (matplotlib), one bar per tree in each panel: the host CPU a state by thread (the light
    windows' medians, librdkafka's threads as one), with the 60 us target; the GIL held by thread as a share of the
    wall time, with the 15% target; where a stages window ran, its ``stages_shown`` largest stages (the wrapper's cost
    taken off), grouped by tree. A thread has one colour in every panel."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    trees = [t for t in result["summary"] if t != "ratios"]
    names = [Path(t).name or t for t in trees]
    light = {t: [r for r in result["runs"] if r["tree"] == t and r["mode"] == "light"] for t in trees}
    cpu = [_median_by_key([_by_group(r["by_thread_us_per_state"]) for r in light[t]]) for t in trees]
    gil = [_median_by_key([_by_group(r["gil"]["by_thread"]) for r in light[t] if r.get("gil", {}).get("by_thread")])
           for t in trees]
    threads = sorted({k for p in cpu + gil for k in p}, key=lambda k: -max(p.get(k, 0.0) for p in cpu + gil))
    colors = {k: f"C{j % 10}" for j, k in enumerate(threads)}
    rows = {t: {(r["thread"], r["stage"]): r["us_per_state_corrected"] for r in result["summary"][t].get("stages", [])}
            for t in trees}
    with_stages = any(rows.values())
    in_order = [r for r in result["runs"] if r["mode"] == "light" and r.get("broker_cpu_us_per_state") is not None]
    heights = [1, 1] + ([1.6] if with_stages else []) + ([1.2] if len(in_order) > 1 else [])
    fig, axes = plt.subplots(len(heights), 1, figsize=(10.0, 3.3 * sum(heights)), dpi=110,
                             gridspec_kw={"height_ratios": heights})
    cpu_ax, gil_ax = axes[0], axes[1]
    env = result["env"]
    _stacked(cpu_ax, names, cpu, colors, scale=1.0)
    cpu_ax.axvline(TARGET_US_PER_STATE, color="black", linestyle="--", linewidth=1, label="target: 60 us")
    cpu_ax.set(xlabel="host CPU us a committed state (every thread's CPU clock, the engine's forward taken off)",
               title=f"host cost at {env['offered_states_per_s']:,.0f} states/s offered ({env['machine']}, "
                     f"{env['broker']}, {env['questions']} x {env['options']}, {env['state_tokens']}-token states)")
    _stacked(gil_ax, names, gil, colors, scale=100.0)
    gil_ax.axvline(100 * TARGET_GIL_SHARE, color="black", linestyle="--", linewidth=1, label="target: 15%")
    gil_ax.set(xlabel="GIL held, % of the wall time (py-spy --gil samples)", title="who holds the GIL")
    for ax in (cpu_ax, gil_ax):
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if with_stages:
        _stage_bars(axes[2], names, [rows[t] for t in trees], stages_shown)
    if len(in_order) > 1:
        _windows(axes[-1], in_order, {t: n for t, n in zip(trees, names)})
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _by_group(by_thread: dict[str, float]) -> dict[str, float]:
    """A pool's threads (``decider-tok_0``, ``decider-tok_1``) summed under the pool's name (``thread_group``, as the
    worker's own snapshots name them)."""
    out: dict[str, float] = {}
    for name, value in by_thread.items():
        group = thread_group(name)
        out[group] = out.get(group, 0.0) + value
    return out


def _stacked(ax, names: list[str], parts: list[dict[str, float]], colors: dict[str, str], scale: float) -> None:
    """One horizontal bar per name, stacked by thread in ``colors``' order, its total written after it."""
    left = [0.0] * len(names)
    for key, color in colors.items():
        widths = [scale * p.get(key, 0.0) for p in parts]
        if any(widths):
            ax.barh(range(len(names)), widths, left=left, label=key, color=color, height=0.6)
            left = [a + b for a, b in zip(left, widths)]
    for y, total in enumerate(left):
        ax.text(total, y, f" {total:.1f}", va="center", fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_xlim(0, max(left + [1.0]) * 1.12)
    ax.grid(True, axis="x", alpha=0.3)


def _stage_bars(ax, names: list[str], rows: list[dict[tuple[str, str], float]], shown: int) -> None:
    """The ``shown`` largest (thread, stage) rows of any tree, a bar per tree each."""
    largest = sorted({k for r in rows for k in r}, key=lambda k: -max(r.get(k, 0.0) for r in rows))[:shown][::-1]
    height = 0.8 / len(rows)
    for i, r in enumerate(rows):
        ax.barh([y + i * height for y in range(len(largest))], [r.get(k, 0.0) for k in largest], height=height,
                label=names[i], color=f"C{i}")
    ax.set_yticks([y + height * (len(rows) - 1) / 2 for y in range(len(largest))],
                  [f"{stage} ({thread})" for thread, stage in largest], fontsize=7)
    ax.set(xlabel="host CPU us a state (stages window)", title=f"the {len(largest)} largest stages")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")


def _windows(ax, runs: list[dict], names: dict[str, str]) -> None:
    """The light windows in the order they ran: the worker's host CPU a state (a marker per tree) and the broker's, on
    one axis, so that a drift over the run shows beside the trees' difference."""
    order = range(1, len(runs) + 1)
    ax.plot(order, [r["broker_cpu_us_per_state"] for r in runs], color="grey", linestyle=":", label="broker (all trees)")
    for j, (tree, name) in enumerate(names.items()):
        mine = [(i, r["host_us_per_state"]) for i, r in zip(order, runs) if r["tree"] == tree]
        ax.plot([i for i, _ in mine], [v for _, v in mine], marker="o", linestyle="none", color=f"C{j}",
                label=f"worker: {name}")
    ax.set(xlabel="window, in the order it ran", ylabel="CPU us a committed state", ylim=(0, None),
           title="each window: the worker's host CPU and the broker's (a process beside it on this machine)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
