"""Where one scoring step's time goes on the device: its kernels against the gaps between them.

Built from a torch profiler trace's device events (each kernel's own start and end, also for kernels a CUDA graph
replays), for `bench/probes/profile_engine.py --timeline`. A step is every device event of one synchronous `score_rows`
call; the trace holds several steps of the same shape, each launching the same kernels, so they are told apart by
count. Gaps are the times between one event's end and the next one's start (the device idle: a kernel's launch
latency, or the host not having queued the next work yet).
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

GEMM_MARKERS = ("nvjet", "gemm", "xmma", "cutlass", "cublas")


@dataclass(frozen=True)
class Interval:
    """One device event: a kernel, copy or memset, in microseconds on the trace's clock."""

    name: str
    start_us: float
    end_us: float

    @property
    def family(self) -> str:
        """What to group it under: cuBLAS's GEMMs together, copies together, memsets together (a GEMM that zeroes its
        output first shows as one), each other kernel by its name."""
        lowered = self.name.lower()
        if any(marker in lowered for marker in GEMM_MARKERS):
            return "GEMM (cuBLAS)"
        if lowered.startswith("memset"):
            return "memset"
        if lowered.startswith("memcpy"):
            return "copy"
        if self.name.startswith("_"):
            return self.name                                    # a Triton kernel: its function's name
        return "torch: " + self.name.split("<")[0].split("(")[0][-40:]


def kernel_intervals(prof) -> list[Interval]:
    """The device events of a finished `torch.profiler.profile`, in start order."""
    events = [e for e in prof.events() if getattr(e, "device_type", None) is not None
              and str(e.device_type).endswith("CUDA") and e.time_range.end > e.time_range.start]
    return sorted((Interval(e.name, float(e.time_range.start), float(e.time_range.end)) for e in events),
                  key=lambda i: i.start_us)


def split_steps(intervals: list[Interval], steps: int) -> list[list[Interval]]:
    """The trace's events cut into `steps` equal runs (each step launches the same work)."""
    if not intervals or len(intervals) % steps:
        raise ValueError(f"{len(intervals)} device events do not divide into {steps} steps of the same kernels: "
                         "was something else running on the device?")
    per_step = len(intervals) // steps
    return [intervals[i * per_step:(i + 1) * per_step] for i in range(steps)]


def step_summary(step: list[Interval]) -> dict:
    """Wall, busy and gap time of one step, per family and per transition between families."""
    by_family = defaultdict(lambda: {"count": 0, "kernel_us": 0.0, "gap_before_us": 0.0})
    transitions = defaultdict(lambda: [0, 0.0])
    busy_until = step[0].start_us
    gaps = 0.0
    previous = None
    for event in step:
        gap = max(0.0, event.start_us - busy_until)
        family = by_family[event.family]
        family["count"] += 1
        family["kernel_us"] += event.end_us - event.start_us
        family["gap_before_us"] += gap
        if previous is not None:
            key = (previous.family, event.family)
            transitions[key][0] += 1
            transitions[key][1] += gap
        gaps += gap
        busy_until = max(busy_until, event.end_us)
        previous = event
    wall = busy_until - step[0].start_us
    first_kernel = next((e for e in step if e.family != "copy"), step[0])
    return {"wall_us": wall, "gaps_us": gaps, "busy_us": wall - gaps, "events": len(step),
            "from_first_kernel_us": busy_until - first_kernel.start_us,
            "kernel_us": sum(e.end_us - e.start_us for e in step), "families": dict(by_family),
            "transitions": {k: tuple(v) for k, v in transitions.items()}}


def summarize(intervals: list[Interval], steps: int, n_rows: int = 25) -> str:
    """A text report of the median step (by wall time): totals, then families and transitions by time."""
    summaries = sorted((step_summary(s) for s in split_steps(intervals, steps)), key=lambda s: s["wall_us"])
    median = summaries[len(summaries) // 2]
    walls = [s["wall_us"] for s in summaries]
    firsts = [s["from_first_kernel_us"] for s in summaries]
    lines = [f"device wall per step: median {median['wall_us']:.1f} us (min {min(walls):.1f}, max {max(walls):.1f}); "
             f"{median['events']} device events, busy {median['busy_us']:.1f} us, idle between them "
             f"{median['gaps_us']:.1f} us ({median['gaps_us'] / median['wall_us']:.0%}; "
             f"{median['gaps_us'] / max(1, median['events'] - 1):.2f} us a gap on average)",
             # the input's copies come before the graph's launch, whose delay on the host varies from run to run (61 to
             # 503 us under the profiler on an H100, runs DA and DC): from the first kernel on, steps of two settings
             # compare without it
             f"from the first kernel after the input's copies: median {statistics.median(firsts):.1f} us (min "
             f"{min(firsts):.1f}, max {max(firsts):.1f})",
             "", "| family | count | kernel us | mean us | share of wall | idle before it, us (mean) |",
             "|---|---|---|---|---|---|"]
    families = sorted(median["families"].items(), key=lambda kv: -(kv[1]["kernel_us"] + kv[1]["gap_before_us"]))
    for name, f in families[:n_rows]:
        lines.append(f"| {name[:60]} | {f['count']} | {f['kernel_us']:.1f} | {f['kernel_us'] / f['count']:.2f} | "
                     f"{f['kernel_us'] / median['wall_us']:.1%} | {f['gap_before_us']:.1f} "
                     f"({f['gap_before_us'] / f['count']:.2f}) |")
    lines += ["", "| after -> before | transitions | idle us | mean us |", "|---|---|---|---|"]
    transitions = sorted(median["transitions"].items(), key=lambda kv: -kv[1][1])
    for (after, before), (count, idle) in transitions[:n_rows]:
        lines.append(f"| {after[:40]} -> {before[:40]} | {count} | {idle:.1f} | {idle / count:.2f} |")
    lines.append(f"(median of the steps' gap totals: {statistics.median(s['gaps_us'] for s in summaries):.1f} us)")
    return "\n".join(lines + torch_kernels(split_steps(intervals, steps)[0]))


def torch_kernels(step: list[Interval]) -> list[str]:
    """Each kernel of torch's own in a step (`summarize` lists the first), in order, by its whole name and the kernel
    before it: a family's name keeps only the start of a templated name, which lumps different kernels together."""
    lines = ["", "| position | after | torch kernel (whole name; the first step) | us |", "|---|---|---|---|"]
    for position, event in enumerate(step):
        if event.family.startswith("torch: "):
            after = step[position - 1].family if position else "-"
            lines.append(f"| {position} | {after[:40]} | {_short(event.name)} | {event.end_us - event.start_us:.1f} |")
    return lines


def _short(name: str) -> str:
    # the kernel's own name and its functor, without the template arguments' long tails
    name = name.replace("(anonymous namespace)::", "").replace("at::native::", "")
    return name[:160].replace("|", "/")
