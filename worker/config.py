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
MAX_COMMIT_LINGER_MS = 10_000  # a transaction held open longer than this is a misconfiguration, not a batching choice
MAX_TRANSACTIONAL_IDS = 4  # turns past the second wait for nothing: one transaction's markers take about one commit
REPLAY_MAX_BATCH = 64  # a replay is throughput-bound: fuller batches than a live worker's default
GROUP_PROTOCOLS = ("classic", "consumer")  # librdkafka's group.protocol: JoinGroup/SyncGroup, or KIP-848's
CLASSIC_SESSION_TIMEOUT_MS = 10_000  # the classic protocol's session timeout unless --session-timeout-ms sets one


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
    # A cycle closing behind one on the GPU launches only the states that fill its CUDA graph's batch size, and the
    # rest open the next cycle: a padded row costs the GPU what a real one does. On since the H100's A/B (run DK:
    # 90% of full load held at 50 ms against 85% padded, bench/README.md).
    unpadded_batches: bool = True
    schema_wait_ms: int = 10_000
    max_state_chars: int = 32_768
    schema_memory_mb: float = 2048.0
    tokenizer_threads: int = 2
    warmup_state_tokens: tuple[int, ...] = ()  # capture graphs at these state lengths when a schema is prepared
    # Kept well under Kafka's default: a worker killed mid-transaction blocks read_committed readers
    # of its output partitions until the broker aborts the transaction (or the same worker id restarts).
    transaction_timeout_ms: int = 30_000
    # Transactional ids committed on in turn (worker.stream.turns): Apache Kafka refuses a producer's next
    # transaction until the last one's markers are written, so back-to-back commits on one id wait for them; on two
    # they do not (bench/README.md, run CT: a transaction's commit 19.8 -> 12.4 ms on an H100's host).
    transactional_ids: int = 2
    # How long a scored cycle may wait for the next ones to join its transaction when none is running (0: it begins
    # at once). A transaction costs the worker's host and the broker about the same whatever it carries (~1.6 ms of
    # the worker's CPU on this project's 2-core machine); the wait is spent from the latency budget.
    commit_linger_ms: int = 0
    # The consumer group protocol: None picks the best one the broker supports when the loop starts
    # (``worker.stream.assignment``); the config file's [kafka] "group.protocol" is the same setting.
    group_protocol: str | None = None
    session_timeout_ms: int | None = None  # classic protocol only (None: 10 s); the consumer protocol's is the broker's
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
        if not 0 <= self.commit_linger_ms <= MAX_COMMIT_LINGER_MS:
            raise ConfigError(f"--commit-linger-ms {self.commit_linger_ms} is out of range: give 0 to "
                              f"{MAX_COMMIT_LINGER_MS} ms (0: each transaction begins as soon as a cycle is scored)")
        if self.max_state_chars < 1:
            raise ConfigError("--max-state-chars must be at least 1")
        if any(n < 1 for n in self.warmup_state_tokens):
            raise ConfigError("--warmup-state-tokens: every length must be at least 1 token")
        if not 1 <= self.transactional_ids <= MAX_TRANSACTIONAL_IDS:
            raise ConfigError(f"--transactional-ids {self.transactional_ids} is out of range: give 1 to "
                              f"{MAX_TRANSACTIONAL_IDS}")
        if self.broker_outage_s <= 0:
            raise ConfigError("--broker-outage-s must be positive")
        if self.stall_after_s <= 0:
            raise ConfigError("--stall-after-s must be positive")
        if self.schema_memory_mb <= 0:
            raise ConfigError("--schema-memory-mb must be positive")
        if not (self.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", self.device)):
            raise ConfigError(f"--device {self.device!r} must be cpu, cuda or cuda:N")
        check_output_format(self.output_format, self.registry)
        self._check_group_protocol()
        if self.input.format == "avro-registry" and self.registry is None:
            raise ConfigError("--input-format avro-registry needs --schema-registry-url")

    def _check_group_protocol(self) -> None:
        """``ConfigError`` for a group protocol that does not exist, that the [kafka] table contradicts, or that cannot
        take the settings given with it (librdkafka refuses client-side assignment and session settings with KIP-848's
        protocol: the broker owns them)."""
        in_table = self.kafka.get("group.protocol")
        for value, where in ((self.group_protocol, "--group-protocol"), (in_table, '[kafka] "group.protocol"')):
            if value is not None and value not in GROUP_PROTOCOLS:
                raise ConfigError(f"{where} {value!r}: use classic or consumer, or leave it out for the best one the "
                                  "broker supports")
        if self.group_protocol and in_table and self.group_protocol != in_table:
            raise ConfigError(f'--group-protocol {self.group_protocol} but the config file\'s [kafka] "group.protocol" is '
                              f"{in_table}: give the protocol once")
        if self.requested_group_protocol != "consumer":
            return
        if self.session_timeout_ms is not None:
            raise ConfigError("--session-timeout-ms has no effect with --group-protocol consumer: the broker sets the "
                              "session timeout (group.consumer.session.timeout.ms, or the group's "
                              "consumer.session.timeout.ms); leave it out, or use --group-protocol classic")
        for key in ("partition.assignment.strategy", "heartbeat.interval.ms"):
            if key in self.kafka:
                raise ConfigError(f'[kafka] "{key}" is a classic-protocol setting, refused with --group-protocol consumer '
                                  '(the broker assigns partitions: "group.remote.assignor" names its assignor)')

    @property
    def requested_group_protocol(self) -> str | None:
        """The group protocol asked for (--group-protocol, or [kafka] "group.protocol"); None: the broker's best."""
        return self.group_protocol or self.kafka.get("group.protocol")

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
    def _every_transactional_id(self) -> list[str]:
        """The ids of the largest --transactional-ids: `transactional_id` first, then ".t1", ...; each stable per
        worker id, as `transactional_id` is."""
        return [self.transactional_id] + [f"{self.transactional_id}.t{k}" for k in range(1, MAX_TRANSACTIONAL_IDS)]

    @property
    def transactional_id_turns(self) -> list[str]:
        """The --transactional-ids ids this worker commits on in turn: `transactional_id` first, then ".t1", ..."""
        return self._every_transactional_id[:self.transactional_ids]

    @property
    def retired_transactional_ids(self) -> list[str]:
        """The ids a larger --transactional-ids (up to its maximum) would add, which this worker does not commit on:
        fenced at start, so that a transaction a crash left open on one (the worker ran with more ids) is aborted then,
        not after the broker's transaction timeout, while read_committed readers of its partitions wait."""
        return self._every_transactional_id[self.transactional_ids:]

    @property
    def resolved_dtype(self) -> str:
        """The dtype the engine loads the model in."""
        return self.dtype or ("float32" if self.device == "cpu" else "bfloat16")

    @property
    def schema_memory_bytes(self) -> int:
        """Budget for prepared schemas (their prefix caches), in bytes."""
        return int(self.schema_memory_mb * 1024 * 1024)
