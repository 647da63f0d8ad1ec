"""How long a cycle gathers states under a latency budget before it may close (``LatencyBudget``'s gathering window):
the part of the budget the planner spends on larger batches when the load needs them.

Closing every cycle as soon as the GPU can take it keeps the first state's wait short, but every cycle pays the same
fixed costs: on the GPU a batch's fixed part (about 2.3 ms on the H200 at 10 questions x 4 options, against 0.45 ms
a state), on the host the close, the launch and the records, and a transaction. Near the GPU's or the host's limit
those fixed costs decide whether the load is held, and a larger budget could pay for fewer, larger cycles; yet with
every cycle closed at once the budget changed nothing but the count of misses (runs CN and before, bench/README.md:
the p99s of 25, 50 and 100 ms at a load were within noise of each other).

So the planner first asks what the load needs. At ``rate`` states a second, cycles of ``n`` states keep the GPU
busy ``utilisation(n) = rate x G(n) / n`` of the time, where ``G(n) = fixed + per_state x n`` is the learned GPU
time of a cycle from its launch (``CostLine``, fitted to the budget's per-bucket estimates; the time from the close,
``E(n)``, until the GPU's is learned). The cycle gathers for the time ``n - 1``
more states take to arrive, for the smallest ``n`` whose utilisation is at most ``UTILISATION`` (the rest of the time
is the headroom that absorbs a stall without a queue building up): 0 at a light load, where one state's cycle
already leaves that headroom, so a light load and a tight budget close every cycle as soon as the GPU can take it, as
before; 0 too at a load whose states' own time (``rate x per_state``) fills that share, where no batch size leaves
the headroom and the queue behind the GPU sets the batch (gathering there idled the GPU and lost the highest load on
this CPU). Where the batch needed is larger than the budget allows, the window is capped so that the cycle's first
state is planned visible within ``GATHER_SHARE`` of the budget (its window, the launch lead, the pessimistic scoring
and commit times of the ``n`` states it gathers): a larger budget then buys larger batches, and only then. A window
shorter than a cycle's fixed time (its scoring's and its transaction's) is not waited at all (it would cost the first state more than it saves), so a tight
budget closes as it did. Nor does a
cycle gather past the batch size beyond which a larger batch was not measured cheaper per state (on a CPU the
tiny model's batch of 60 seemed to cost more per state than one of 50).

Gathering up to the cycle's own deadline, at every load, was tried before (runs P and R): the larger batch held the
GPU past the next cycle's deadline. This window differs in both: it is 0 until the load needs it, and it plans the
gathered states' own scoring and commit within half the budget, leaving the other half for the queue and the stalls.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

UTILISATION = 0.7
"""The share of the time the planner lets the scoring path be busy, when the budget allows batches large enough."""

GATHER_SHARE = 0.5
"""The share of the budget a cycle's plan may take (gathering, launch, scoring, commit) when it gathers."""

RATE_WINDOW_S = 2.0
"""The arrival rate is measured over the cycles committed in the last this many seconds."""

GATHER_REFRESH_S = 0.02
"""The gathering window is worked out again at a commit this long after the last time, not at every commit: it serves
the load of the last RATE_WINDOW_S, and its three least-squares lines, fitted at every commit of a tight budget's few
hundred a second, were the loop's largest stage on the CPU (`bench/host_cost.py --modes stages`); refitted at most
this often, the budget's learning took 31-54 us a commit against 67-94 (`bench/probes/budget_cost.py`)."""


@dataclass(frozen=True)
class CostLine:
    """A cycle's time as ``fixed + per_state x n`` seconds, and a pessimistic margin on top of it."""

    fixed: float
    per_state: float
    margin: float = 0.0
    cheapest_up_to: float = math.inf   # no batch larger than this measured cheaper per state (``fitted``)

    @classmethod
    def fitted(cls, points: list[tuple[float, float, float]]) -> "CostLine | None":
        """The least-squares line through ``points`` (mean states, mean seconds, margin) of the measured batch buckets,
        with their median margin;
        with one bucket, or a fit that would make either part negative, the line through the largest bucket's point
        and the origin or a flat one, whichever the points allow (a time learned at one size cannot tell the fixed part
        from the rest: charging it all per state promises no gain from a larger batch). None without points."""
        if not points:
            return None
        # the buckets' median margin: a bucket seen once plans with half its time as deviation (RFC 6298's start),
        # and one rare large batch would otherwise cap every window
        margins = sorted(m for _, _, m in points)
        margin = margins[(len(margins) - 1) // 2]
        # where a larger batch stopped being cheaper per state (a CPU's time is not linear in the batch): the size of
        # the cheapest bucket, or twice it where it is the largest measured (the next one up is worth a try)
        sizes = sorted(points)
        cheapest = min(range(len(sizes)), key=lambda k: sizes[k][1] / max(sizes[k][0], 1.0))
        cheapest_up_to = sizes[cheapest][0] * (2 if cheapest == len(sizes) - 1 else 1)
        if len(points) >= 2:
            mean_n = sum(n for n, _, _ in points) / len(points)
            mean_s = sum(s for _, s, _ in points) / len(points)
            spread = sum((n - mean_n) ** 2 for n, _, _ in points)
            if spread > 0:
                slope = sum((n - mean_n) * (s - mean_s) for n, s, _ in points) / spread
                fixed = mean_s - slope * mean_n
                if slope >= 0 and fixed >= 0:
                    return cls(fixed, slope, margin, cheapest_up_to)
                if slope < 0:                   # no larger batch measured slower: the noise of a fixed cost
                    return cls(max(s for _, s, _ in points), 0.0, margin, cheapest_up_to)
        n, seconds, _ = max(points)
        return cls(0.0, seconds / max(n, 1.0), margin, cheapest_up_to)

    def seconds(self, n: float, pessimistic: bool = False) -> float:
        """The time of a cycle of ``n`` states (plus the margin when ``pessimistic``)."""
        return self.fixed + self.per_state * n + (self.margin if pessimistic else 0.0)


@dataclass
class CommitWindow:
    """The cycles committed in the last ``window_s`` seconds, with the sums of their scored states and of their misses
    (cycles visible later than the budget) over the window: kept as cycles come and go, because a sum over the window at
    every commit grew with the cycle rate (a tight budget's window holds thousands of small cycles). Shared by
    `RecentRate` and `worker.stream.latency_budget.Overload`."""

    window_s: float
    states: int = 0
    missed: int = 0
    _cycles: deque = field(default_factory=deque)   # (committed at, states, missed)

    def add(self, at: float, n_states: int, missed: bool = False) -> None:
        """A cycle committed at ``at``; cycles older than the window leave it."""
        self._cycles.append((at, n_states, missed))
        self.states += n_states
        self.missed += missed
        while self._cycles[0][0] < at - self.window_s:
            _, gone_states, gone_missed = self._cycles.popleft()
            self.states -= gone_states
            self.missed -= gone_missed

    def __len__(self) -> int:
        return len(self._cycles)

    def oldest_at(self) -> float:
        """When the window's oldest cycle committed (it must hold one)."""
        return self._cycles[0][0]

    def span(self) -> float:
        """Seconds from the window's oldest commit to its newest (0 before two)."""
        return self._cycles[-1][0] - self._cycles[0][0] if len(self._cycles) > 1 else 0.0

    def states_per_second(self) -> float:
        """Scored states a second over the span (0 before two cycles): the oldest cycle's states came before it."""
        span = self.span()
        return (self.states - self._cycles[0][1]) / span if span > 0 else 0.0

    def clear(self) -> None:
        self._cycles.clear()
        self.states = self.missed = 0


@dataclass
class RecentRate:
    """States a second committed over the last RATE_WINDOW_S (None until the window holds enough to say)."""

    window_s: float = RATE_WINDOW_S
    min_cycles: int = 8
    _window: CommitWindow = field(init=False)

    def __post_init__(self) -> None:
        self._window = CommitWindow(self.window_s)

    def add(self, at: float, n_states: int) -> None:
        self._window.add(at, n_states)

    def per_second(self) -> float | None:
        window = self._window
        if len(window) < self.min_cycles or window.span() < self.window_s / 4:
            return None
        return window.states_per_second()

    def forget(self) -> None:
        self._window.clear()


def gather_window(rate: float | None, engine: CostLine | None, commit: CostLine | None, budget_s: float,
                  launch_lead_s: float, max_batch: int, device: CostLine | None = None) -> float:
    """How long (seconds) a cycle gathers after its first state before it may close (see the module's docstring):
    ``rate`` states/s arriving, ``engine`` and ``commit`` the learned cycle times, ``launch_lead_s`` from close to
    the batch queued, ``device`` the GPU's own time on a cycle (from its launch), which is what a batch keeps busy
    (``engine`` where not learned yet). 0 without a rate or estimates yet, and at a load one-state cycles serve
    within UTILISATION."""
    busy = device if device is not None else engine
    if not rate or busy is None or commit is None or engine is None or rate <= 0 or busy.fixed <= 0:
        return 0.0          # nothing to go on, or a batch's time all per state: a larger batch would gain nothing
    # the smallest batch whose scoring keeps the GPU busy at most UTILISATION of the time at this rate; none (the
    # states' own time fills that share): the load is at the edge of what any batch sustains, and the queue behind the
    # GPU sets the batch, as large as it needs, without an idle GPU while a cycle gathers. The GPU's own time, not the
    # time from the close: that one holds the launch, whose host time overlaps the batch ahead and grows with the
    # batch (0.72 against the GPU's 0.47 ms a state on an H100, run DN), so at 60% of full load it found no batch
    # size that left headroom, never gathered, and the GPU ran cycles of 4-5 states ~95% busy (a 10 ms stall every
    # ~1.5 s then queued states past 50 ms)
    headroom = UTILISATION - rate * busy.per_state
    if headroom <= 0:
        return 0.0
    needed = rate * busy.fixed / headroom
    if needed <= 1:
        return 0.0
    # the largest batch whose first state is planned visible within GATHER_SHARE of the budget:
    #   (n - 1) / rate + lead + engine(n) + commit(n) <= share x budget, pessimistically, linear in n
    room = (GATHER_SHARE * budget_s - launch_lead_s - engine.fixed - engine.margin - commit.fixed - commit.margin
            + 1 / rate)
    allowed = room / (1 / rate + engine.per_state + commit.per_state)
    # and never past the batch size beyond which a larger batch was not measured cheaper per state
    n = min(needed, allowed, engine.cheapest_up_to, float(max_batch))
    window = (n - 1) / rate
    # a wait shorter than a cycle's fixed time (its scoring's and its transaction's) costs the first state more than
    # the cycle it saves (and a tight budget's window is that short: 25 ms on the H200's costs): no wait at all
    return window if window >= engine.fixed + commit.fixed else 0.0
