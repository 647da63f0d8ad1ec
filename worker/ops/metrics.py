"""Prometheus metrics of the worker (served on --metrics-port when given)."""

from __future__ import annotations

import functools
import json
from typing import Any, Callable, Mapping

from prometheus_client import Counter, Gauge, Histogram

from worker.ops.liveness import assigned_partitions

STATES_SCORED = Counter("decider_states_scored_total", "States scored and committed", ["schema_id"])
DEAD_LETTERS = Counter("decider_dead_letters_total", "States sent to the dead-letter topic", ["reason"])
TRANSACTIONS = Counter("decider_transactions_total", "Transactions by outcome", ["outcome"])
CYCLE_SECONDS = Histogram(
    "decider_cycle_seconds", "From a cycle's first state to its commit",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
BATCH_SIZE = Histogram("decider_batch_states", "States per scored batch (a cycle's states of every schema)", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
UNPADDED_CARRIED = Counter("decider_unpadded_carried_states_total", "States a closing batch left to the next one so that its CUDA graph ran no padded row (--unpadded-batches)")
LABEL_MASS = Histogram(
    "decider_label_mass", "Per probability record, the lowest label mass among its questions: the share of the model's "
    "next-token distribution on the question's option labels (low: the model is not answering in format)",
    ["schema_id"], buckets=(0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0),
)
PREPARED_BYTES = Gauge("decider_prepared_schema_bytes", "Device bytes held by prepared schemas")
PREFIX_BANK_BYTES = Gauge("decider_prefix_bank_bytes", "Device bytes of the engine's prefix bank, where every prepared "
                          "schema's prefix states live (it grows by doubling and never shrinks; released slots are reused)")
PREPARED_SCHEMAS = Gauge("decider_prepared_schemas", "Schema versions prepared and held on the device")
FILL_WAIT = Histogram(
    "decider_batch_fill_wait_seconds", "From a cycle's first state to its submission for scoring",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
ENGINE_SECONDS = Histogram(
    "decider_engine_seconds", "One batch on the device: from its launch, or from the end of the batch queued "
    "ahead of it, to its probabilities read",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
LAUNCH_SECONDS = Histogram(
    "decider_batch_launch_seconds", "Host time to queue one batch on the device (on the GPU thread: waiting for its "
    "tokenization, building the step inputs, the launch)",
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1),
)
COMMIT_SECONDS = Histogram(
    "decider_transaction_commit_seconds", "One transaction: produce, flush, send offsets, commit",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
CONSUMER_LAG = Gauge("decider_consumer_lag", "Offsets between the worker's read position and the partition's last stable "
                     "offset (librdkafka statistics)", ["topic", "partition"])
LOOP_STEP_SECONDS = Histogram(
    "decider_loop_step_seconds", "Steps that block the consume loop: the schema catch-up before a cycle closes, the "
    "wait for a cycle's scores, the transaction's opening while the batch is scored, the commit", ["step"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5),
)
GC_PAUSE_SECONDS = Histogram(
    "decider_gc_pause_seconds", "Python garbage collections by generation (each pauses every thread of the worker)",
    ["generation"], buckets=(0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
)
ENGINE_PATHS = Gauge("decider_engine_batches", "Engine batches by path: CUDA graph captures (inline: of those, on "
                     "a batch's path) and replays, replays on a larger graph while a batch's own was being captured "
                     "(covered), eager runs", ["path"])
ENGINE_GRAPHS = Gauge("decider_engine_graphs", "CUDA graphs held: one per step shape, shared by every schema "
                      "(the count does not grow with the schemas)")
LATENCY_BUDGET_SECONDS = Gauge("decider_latency_budget_seconds", "--latency-budget-ms: a cycle's first state's record "
                               "is to be visible this long after the state was consumed")
ESTIMATED_ENGINE_SECONDS = Gauge(
    "decider_estimated_engine_seconds", "The latency budget's running estimate (mean + 4 mean deviations) of the time "
    "from closing a cycle to its scores, by batch bucket (scored states, rounded up to a power of two)", ["batch"])
ESTIMATED_COMMIT_SECONDS = Gauge(
    "decider_estimated_commit_seconds", "The latency budget's running estimate (mean + 4 mean deviations) of the time "
    "from a cycle's scores to the end of its transaction, by batch bucket", ["batch"])
LATENCY_BUDGET_MISSES = Counter(
    "decider_latency_budget_misses_total", "Committed cycles whose first state's record became visible later than "
    "--latency-budget-ms after the state was consumed (transaction end - first state consumed)")
LATENCY_BUDGET_OVERLOADED = Gauge(
    "decider_latency_budget_overloaded", "1 while the latency budget does not hold at the load arriving: over the last "
    "10 s more than 5% of the committed cycles were visible later than --latency-budget-ms (a warning names the rate); "
    "add workers or raise the budget")
ARRIVAL_STATES_PER_SECOND = Gauge(
    "decider_latency_budget_arrival_states_per_second", "States scored per second over the last 10 s of committed "
    "cycles, the load the latency budget is judged at")


PARTITION_STALL_SECONDS = Gauge(
    "decider_partition_stall_seconds", "Seconds a partition has gone without progress: a states partition with records "
    "waiting whose committed offset stands still, or an output partition where read_committed readers do not get the "
    "newest record this worker committed (worker.stream.progress); at --stall-after-s it is reported and /readyz fails",
    ["topic", "partition"])
PARTITION_STALLS = Counter("decider_partition_stalls_total", "Stalled-partition warnings (worker.stream.progress)")


def clear_stall_seconds(keep: set[tuple[str, str]]) -> None:
    """Drop the stall gauge of every partition not in ``keep`` (it made progress, or is no longer this worker's)."""
    for labels in list(PARTITION_STALL_SECONDS._metrics):  # prometheus_client keeps a labelled child per label tuple
        if labels not in keep:
            PARTITION_STALL_SECONDS.remove(*labels)


@functools.cache
def _bucket_gauge(gauge: Gauge, batch: int) -> Gauge:
    """``gauge``'s child for a batch bucket: every bucket's estimate is set at every commit, and ``labels`` checks and
    locks at each call (these children are never removed)."""
    return gauge.labels(str(batch))


def observe_budget(engine: Mapping[int, float], commit: Mapping[int, float], missed: bool) -> None:
    """A cycle committed under the latency budget: the estimates it updated, and whether it missed the budget."""
    for batch, seconds in engine.items():
        _bucket_gauge(ESTIMATED_ENGINE_SECONDS, batch).set(seconds)
    for batch, seconds in commit.items():
        _bucket_gauge(ESTIMATED_COMMIT_SECONDS, batch).set(seconds)
    if missed:
        LATENCY_BUDGET_MISSES.inc()


def count_committed(cycle_seconds: float, scored: Mapping[str, int], dead_letters: Mapping[str, int],
                    first_in_transaction: bool = True) -> None:
    """A cycle committed: its latency, its probability records by schema id, its dead letters by reason code; its
    transaction counted with its first cycle (one transaction may commit several)."""
    if first_in_transaction:
        TRANSACTIONS.labels("committed").inc()
    CYCLE_SECONDS.observe(cycle_seconds)
    for schema_id, count in scored.items():
        STATES_SCORED.labels(schema_id).inc(count)
    for reason, count in dead_letters.items():
        DEAD_LETTERS.labels(reason).inc(count)


def on_event(kind: str, info: dict[str, Any]) -> None:
    """Update the metrics the loop reports as events (``Worker(on_event=...)``)."""
    if kind == "committed" and "commit_ms" in info and not info.get("transaction_cycle"):
        COMMIT_SECONDS.observe(info["commit_ms"] / 1000)      # once a transaction, with its first cycle


def on_consumer_stats(stats_json: str) -> None:
    """librdkafka's ``stats_cb``: per assigned partition, last stable offset minus the application's position.

    librdkafka's own ``consumer_lag`` counts from offsets committed through the consumer, and the worker commits
    only through its transactions, so it stays -1; ``ls_offset - app_offset`` is the lag that matters here."""
    for topic, partition, p in assigned_partitions(json.loads(stats_json)):
        end, position = p.get("ls_offset", -1), p.get("app_offset", -1)
        if end >= 0 and position >= 0:
            CONSUMER_LAG.labels(topic, str(partition)).set(max(0, end - position))


def watch_scorer(engine_stats: Callable[[], dict[str, int]], prepared: Callable[[], tuple[int, int]],
                 bank_bytes: Callable[[], int] = lambda: 0) -> None:
    """Read the engine's counters and the prepared-schema figures at every scrape (no bookkeeping in the loop)."""
    for path in ("captures", "inline", "replays", "covered", "eager"):
        ENGINE_PATHS.labels(path).set_function(lambda path=path: engine_stats().get(path, 0))
    ENGINE_GRAPHS.set_function(lambda: engine_stats().get("graphs", 0))
    PREPARED_SCHEMAS.set_function(lambda: prepared()[0])
    PREPARED_BYTES.set_function(lambda: prepared()[1])
    PREFIX_BANK_BYTES.set_function(bank_bytes)

