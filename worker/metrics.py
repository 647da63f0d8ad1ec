"""Prometheus metrics of the worker (served on --metrics-port when given)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

STATES_SCORED = Counter("decider_states_scored_total", "States scored and committed", ["schema_id"])
DEAD_LETTERS = Counter("decider_dead_letters_total", "States sent to the dead-letter topic", ["reason"])
TRANSACTIONS = Counter("decider_transactions_total", "Transactions by outcome", ["outcome"])
CYCLE_SECONDS = Histogram(
    "decider_cycle_seconds", "From a cycle's first state to its commit",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
BATCH_SIZE = Histogram("decider_batch_states", "States per scored batch", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
PREPARED_BYTES = Gauge("decider_prepared_schema_bytes", "Device bytes held by prepared schemas")


def serve(port: int) -> None:
    """Expose /metrics on ``port`` (a daemon thread)."""
    start_http_server(port)
