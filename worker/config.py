"""One frozen configuration object per process, built once at the CLI from flags, ``DECIDER_*`` environment
variables and the config file (``worker.config_file``). The defaults written here are the CLI's defaults too."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from worker.exceptions import ConfigError
from worker.formats.input_mapping import InputMapping
from worker.formats.output_formats import check_output_format
from worker.formats.registry import RegistryConfig

DEFAULT_STATES_TOPIC = "decider.states"
DEFAULT_SCHEMAS_TOPIC = "decider.schemas"
DEFAULT_PROBABILITIES_TOPIC = "decider.probabilities"
DEFAULT_DEAD_LETTER_TOPIC = "decider.dead-letter"
DEFAULT_GROUP = "decider"
MAX_LATENCY_BUDGET_MS = 600_000  # ten minutes: far beyond any batch's scoring and commit
REPLAY_MAX_BATCH = 64  # a replay is throughput-bound: fuller batches than a live worker's default


@dataclass(frozen=True)
class Cluster:
    """How to reach the Kafka cluster: the bootstrap servers and the librdkafka settings of the config file's
    ``[kafka]`` table (security.protocol, sasl.*, ssl.*, ...), which every client decider creates gets."""

    bootstrap: str
    settings: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Topics:
    """The four topic names; every one is overridable (flag or env var)."""

    states: str = DEFAULT_STATES_TOPIC
    schemas: str = DEFAULT_SCHEMAS_TOPIC
    probabilities: str = DEFAULT_PROBABILITIES_TOPIC
    dead_letter: str = DEFAULT_DEAD_LETTER_TOPIC

    def all(self) -> tuple[str, str, str, str]:
        """The names in creation order."""
        return (self.states, self.schemas, self.probabilities, self.dead_letter)


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a loop (``decider worker`` or ``decider replay``) needs; built once, never mutated."""

    bootstrap: str
    model_dir: str
    worker_id: str
    device: str = "cpu"
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA
    deterministic: bool | None = None  # None: the engine's default for the device (Engine.load)
    group: str = DEFAULT_GROUP
    topics: Topics = field(default_factory=Topics)
    max_batch: int = 32
    max_wait_ms: int | None = 50  # None: no deadline, cycles close only when a batch is full (replay)
    latency_budget_ms: int | None = None  # None: cycles close by --max-batch and --max-wait-ms alone
    schema_wait_ms: int = 10_000
    max_state_chars: int = 32_768
    schema_memory_mb: float = 2048.0
    tokenizer_threads: int = 2
    warmup_state_tokens: tuple[int, ...] = ()  # capture graphs at these state lengths when a schema is prepared
    # Kept well under Kafka's default: a worker killed mid-transaction blocks read_committed readers
    # of its output partitions until the broker aborts the transaction (or the same worker id restarts).
    transaction_timeout_ms: int = 30_000
    session_timeout_ms: int = 10_000
    broker_outage_s: float = 300.0  # how long the loop rides out an unreachable broker before it exits (code 5)
    stall_after_s: float = 180.0  # a partition without progress this long is reported and fails /readyz (worker.stream.progress)
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"   # this machine only; a scraper in another container needs 0.0.0.0
    kafka: Mapping[str, Any] = field(default_factory=dict)  # the config file's [kafka] table
    input: InputMapping = field(default_factory=InputMapping)  # how the states topic's records become states
    output_format: str = "avro"  # avro | avro-registry | json (worker.formats.output_formats)
    registry: RegistryConfig | None = None  # --schema-registry-url and the config file's [schema_registry] table

    def __post_init__(self) -> None:
        if not self.bootstrap:
            raise ConfigError("no bootstrap servers: pass -b/--bootstrap or set DECIDER_BOOTSTRAP")
        if not re.fullmatch(r"[A-Za-z0-9._-]+", self.worker_id or ""):
            raise ConfigError(f"--worker-id {self.worker_id!r} must be non-empty and use only letters, digits, '.', '_', '-'")
        if self.max_batch < 1:
            raise ConfigError("--max-batch must be at least 1")
        for name in ("max_wait_ms", "schema_wait_ms"):
            if (getattr(self, name) or 0) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0")
        if self.latency_budget_ms is not None and not 1 <= self.latency_budget_ms <= MAX_LATENCY_BUDGET_MS:
            raise ConfigError(f"--latency-budget-ms {self.latency_budget_ms} is out of range: give 1 to "
                              f"{MAX_LATENCY_BUDGET_MS} ms, or leave it out to close batches by --max-wait-ms alone")
        if self.max_state_chars < 1:
            raise ConfigError("--max-state-chars must be at least 1")
        if any(n < 1 for n in self.warmup_state_tokens):
            raise ConfigError("--warmup-state-tokens: every length must be at least 1 token")
        if self.broker_outage_s <= 0:
            raise ConfigError("--broker-outage-s must be positive")
        if self.stall_after_s <= 0:
            raise ConfigError("--stall-after-s must be positive")
        if self.schema_memory_mb <= 0:
            raise ConfigError("--schema-memory-mb must be positive")
        if not (self.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", self.device)):
            raise ConfigError(f"--device {self.device!r} must be cpu, cuda or cuda:N")
        check_output_format(self.output_format, self.registry)
        if self.input.format == "avro-registry" and self.registry is None:
            raise ConfigError("--input-format avro-registry needs --schema-registry-url")

    @property
    def cluster(self) -> Cluster:
        """The cluster every client of this process connects to."""
        return Cluster(self.bootstrap, self.kafka)

    @property
    def transactional_id(self) -> str:
        """Stable per worker id: a restart with the same --worker-id fences the old instance and
        aborts its open transaction (the zombie-fencing contract of transactional producers)."""
        return f"decider.{self.group}.{self.worker_id}"

    @property
    def resolved_dtype(self) -> str:
        """The dtype the engine loads the model in."""
        return self.dtype or ("float32" if self.device == "cpu" else "bfloat16")

    @property
    def schema_memory_bytes(self) -> int:
        """Budget for prepared schemas (their prefix caches), in bytes."""
        return int(self.schema_memory_mb * 1024 * 1024)
