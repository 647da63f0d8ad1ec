"""Kafka client construction and topic administration, with the reason for each non-obvious setting."""

from __future__ import annotations

import re
import time
from typing import Any, Iterable

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from worker.config import CLASSIC_SESSION_TIMEOUT_MS, Cluster, Topics, WorkerConfig
from worker.exceptions import BrokerUnavailableError
from worker.ops import liveness
from worker.ops.metrics import on_consumer_stats

# librdkafka logs every failed connection attempt to stderr; the CLI reports unreachable brokers itself.
_QUIET = {"log_level": 0}
# Defaults the [kafka] table may override. librdkafka backs off reconnecting up to 10 s by default (the Java client: 1
# s), so a worker could sit idle for seconds after its broker was back: measured on the embedded broker, the
# transaction coordinator's connection came up 7.5 s after the broker's restart.
_RECONNECT = {"reconnect.backoff.max.ms": 1000}
# Nagle's algorithm stays as librdkafka leaves it (on). TCP_NODELAY on every client, as Java's clients set it, was the
# default for a while; on an H100's host with Apache Kafka (bench/README.md, runs EG and EH: both orders in one machine)
# it left every step of a commit as it was and the 25 ms budget's p99 at 70% of full load higher (21.1-24.7 ms against
# 15.6-18.9). The [kafka] table may still set `socket.nagle.disable`.


def _on_states_consumer_stats(stats_json: str) -> None:
    """The states consumer's statistics: lag for the metrics, broker connections for readiness, each partition's end
    for the stall check."""
    on_consumer_stats(stats_json)
    liveness.BROKER.on_stats(stats_json)
    liveness.PARTITION_ENDS.on_stats(stats_json)


def as_cluster(cluster: Cluster | str) -> Cluster:
    """``cluster`` itself, or a bare bootstrap address as a cluster with no extra client settings."""
    return cluster if isinstance(cluster, Cluster) else Cluster(cluster)


def base_config(cluster: Cluster | str) -> dict[str, Any]:
    """What every client gets: the bootstrap address, quiet librdkafka logs, then the ``[kafka]`` settings
    (``worker.config_file`` validated them and refused the keys decider sets itself)."""
    cluster = as_cluster(cluster)
    return {"bootstrap.servers": cluster.bootstrap, **_QUIET, **_RECONNECT, **cluster.settings}


def admin_client(cluster: Cluster | str) -> AdminClient:
    """An admin client for ``cluster``."""
    return AdminClient(base_config(cluster))


def check_broker(cluster: Cluster | str, timeout_s: float = 5.0) -> dict:
    """Return the cluster's topic metadata, or raise ``BrokerUnavailableError`` with a clear message."""
    bootstrap = as_cluster(cluster).bootstrap
    try:
        return admin_client(cluster).list_topics(timeout=timeout_s).topics
    except KafkaException as exc:
        raise BrokerUnavailableError(
            f"no Kafka broker answered at {bootstrap} within {timeout_s:.0f} s ({exc.args[0].str()}); "
            "start one (decider broker, or docker compose up kafka) or fix -b/DECIDER_BOOTSTRAP"
        ) from exc


def create_topics_command(bootstrap: str, topics: Topics) -> str:
    """The ``decider topics create`` command that creates ``topics`` (flags only for names other than the defaults)."""
    defaults = Topics()
    flags = [f"--{role.replace('_', '-')}-topic {getattr(topics, role)}" for role in ("states", "schemas", "probabilities", "dead_letter")
             if getattr(topics, role) != getattr(defaults, role)]
    return " ".join([f"decider topics create -b {bootstrap}", *flags])


def require_topics(cluster: Cluster | str, names: Iterable[str], timeout_s: float = 5.0,
                   roles: Topics | None = None) -> dict[str, int]:
    """Partition count of each topic in ``names``; ``BrokerUnavailableError`` if any is missing, with the command that
    creates it (``roles``: the topic set the names belong to, for that command's flags)."""
    bootstrap = as_cluster(cluster).bootstrap
    topics = check_broker(cluster, timeout_s)
    counts: dict[str, int] = {}
    missing = []
    for name in names:
        meta = topics.get(name)
        if meta is None or meta.error is not None or not meta.partitions:
            missing.append(name)
        else:
            counts[name] = len(meta.partitions)
    if missing:
        raise BrokerUnavailableError(
            f"topic(s) {', '.join(missing)} do not exist on {bootstrap}{_typo_hint(missing, topics)}; if the name is "
            f"right, create them with: {create_topics_command(bootstrap, roles or Topics())}"
        )
    return counts


def _typo_hint(missing: list[str], existing: Iterable[str]) -> str:
    """' (a typo? existing: a.b, c.d)', naming the existing topics closest to the missing ones, or ' (a typo?)'."""
    import difflib

    names = [name for name in existing if not name.startswith("__")]  # not Kafka's own internal topics
    close = sorted({match for name in missing for match in difflib.get_close_matches(name, names, n=3, cutoff=0.6)})
    return f" (a typo? existing: {', '.join(close)})" if close else " (a typo?)"


def create_topics(cluster: Cluster | str, topics: Topics, partitions: int, replication: int = 1) -> dict[str, str]:
    """Create the four topics; returns ``{name: "created" | "exists"}``. Idempotent."""
    check_broker(cluster)
    requests = [
        NewTopic(topics.states, partitions, replication),
        # The schema topic is a table: compaction keeps the latest version per schema id (and
        # tombstones delete). One partition keeps every schema id's history in one ordered log.
        NewTopic(topics.schemas, 1, replication, config={"cleanup.policy": "compact"}),
        NewTopic(topics.probabilities, partitions, replication),
        NewTopic(topics.dead_letter, partitions, replication),
    ]
    outcome: dict[str, str] = {}
    admin = admin_client(cluster)  # must outlive the futures: a collected client cancels them
    for name, future in admin.create_topics(requests, request_timeout=15).items():
        try:
            future.result()
            outcome[name] = "created"
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise BrokerUnavailableError(f"could not create topic {name}: {exc.args[0].str()}") from exc
            outcome[name] = "exists"
    _wait_for_leaders(admin, [request.topic for request in requests])
    return outcome


def _wait_for_leaders(admin: AdminClient, names: list[str], timeout_s: float = 15.0) -> None:
    """Until every partition of ``names`` has a leader in the broker's metadata. Apache Kafka answers CreateTopics once
    its controller holds the topic; the broker takes a moment more to lead its partitions, and a client meanwhile gets
    NOT_LEADER_FOR_PARTITION (a schema put right after ``decider topics create`` failed so). noida-db has them at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        topics = admin.list_topics(timeout=5).topics
        waiting = [name for name in names if name not in topics or topics[name].error is not None
                   or not topics[name].partitions
                   or any(p.leader < 0 or p.error is not None for p in topics[name].partitions.values())]
        if not waiting:
            return
        if time.monotonic() > deadline:
            raise BrokerUnavailableError(f"topic(s) {', '.join(waiting)} have no partition leader {timeout_s:.0f} s "
                                         f"after their creation")
        time.sleep(0.1)


def plain_producer(cluster: Cluster | str, linger_ms: int = 5) -> Producer:
    """An idempotent, non-transactional producer for the CLI's schema put / produce commands (``linger_ms``: how long
    a record may wait for others to share its request; it is part of every record's latency)."""
    return Producer({
        **base_config(cluster),
        "enable.idempotence": True,  # retries never duplicate or reorder a produced state
        # Java-client-compatible key hashing, so a state id lands on the same partition whoever produces it.
        "partitioner": "murmur2_random",
        "linger.ms": linger_ms,
    })


def reader_consumer(cluster: Cluster | str, group: str | None = None) -> Consumer:
    """A read_committed consumer for reading topics whole (the schema table, tail).

    Without a group it never commits: readers assign partitions themselves and keep no position.
    """
    return Consumer(reader_consumer_config(cluster, group))


def last_committed(cluster: Cluster | str, group: str, partitions: list[TopicPartition],
                   timeout_s: float = 10.0) -> list[TopicPartition]:
    """``group``'s committed offsets (and their metadata) of ``partitions`` as they stand, whatever transaction is open.

    A read_committed consumer asks for stable offsets only, and while a transaction holds offsets of the group (a
    worker killed inside one, until its successor fences it or the transaction times out) Apache Kafka answers
    UNSTABLE_OFFSET_COMMIT, which librdkafka retries until the timeout. Read uncommitted, the answer is the last
    offsets a transaction committed."""
    consumer = Consumer({**reader_consumer_config(cluster, group), "isolation.level": "read_uncommitted"})
    try:
        return consumer.committed(partitions, timeout=timeout_s)
    finally:
        consumer.close()


def whole_pass_reader(cluster: Cluster | str) -> Consumer:
    """A ``reader_consumer`` that fetches each partition whole in one response where it fits (64 MiB), for reading
    topics from offset 0 to their end. On the embedded broker a read_committed reader must: noida-db 0.2.3 lists every
    aborted transaction below the last stable offset in each Fetch answer, and librdkafka then skips every later
    batch of that producer id in the response, so a reader taking a partition in small fetches loses a restarted
    worker's later records (docs/brokers.md, the development broker)."""
    return Consumer({**reader_consumer_config(cluster), "max.partition.fetch.bytes": 64 << 20,
                     "fetch.max.bytes": 64 << 20})


def reader_consumer_config(cluster: Cluster | str, group: str | None = None) -> dict[str, Any]:
    """Settings of ``reader_consumer``."""
    config = {
        # On Kafka a wait, not a poll interval: an empty Fetch is held at the broker until a record arrives (then
        # answered at once, whatever this value) or this many ms pass, so an idle reader sends ~20 fetches/s. A request
        # sent behind that parked Fetch on the same connection waits for it (Kafka answers one at a time per
        # connection): the schema table asks for end offsets through a client that never fetches (worker.stream.schema_table).
        # A default the [kafka] table may set.
        "fetch.wait.max.ms": 50,
        **base_config(cluster),
        # Only records of committed transactions: aborted attempts of a worker are never shown.
        "isolation.level": "read_committed",
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "enable.partition.eof": True,  # tells a reader when it has caught up with a partition
    }
    # librdkafka requires a group.id even for assign()-only consumers; it is never joined or committed.
    config["group.id"] = group or "decider-reader-unused"
    return config


def worker_consumer_config(config: WorkerConfig, protocol: str = "classic") -> dict[str, Any]:
    """Settings of the states consumer of the exactly-once loop (subscribes through the consumer group), on group
    ``protocol`` (classic or consumer: ``worker.stream.assignment`` picks it)."""
    return {
        # On Kafka a wait, not a poll interval: an empty Fetch is held at the broker until a record arrives (then
        # answered at once, whatever this value) or this many ms pass. An idle worker thus sends ~50 fetches/s per
        # broker it fetches from, plus the schema reader's ~20, and uses 0.35-0.5% of a core in all (measured against
        # librdkafka's mock cluster, which holds empty fetches the same way; bench/idle_cost.py). The value bounds what
        # waits behind a parked Fetch: librdkafka keeps one in flight per broker, so a partition assigned or sought
        # meanwhile starts fetching after it. The embedded broker (noida-db) ignores it and answers every Fetch at once:
        # there every consumer spins (~20k fetches/s each; an idle worker a third of a core and the broker a fifth on
        # the loaded 2-core development machine), at 500 ms exactly as at 20; no client setting changes that.
        # A default: the [kafka] table may set it (as every key decider does not own).
        "fetch.wait.max.ms": 20,
        **_group_membership(config, protocol),
        **base_config(config.cluster),
        "group.id": config.group,
        # Offsets are committed only inside our transactions (send_offsets_to_transaction).
        "enable.auto.commit": False,
        # Never read another producer's aborted output; inputs produced transactionally stay atomic too.
        "isolation.level": "read_committed",
        "auto.offset.reset": "earliest",  # a new group scores the whole topic, never skips
        # Scoring a batch holds the loop for at most seconds; this is the bound on a stuck GPU.
        "max.poll.interval.ms": 300_000,
        # Consumer lag per partition for the metrics, computed by librdkafka from the fetch responses, and whether
        # any broker connection is up, for /readyz (``worker.ops.liveness``).
        "statistics.interval.ms": 2000,
        "stats_cb": _on_states_consumer_stats,
    }


def _group_membership(config: WorkerConfig, protocol: str) -> dict[str, Any]:
    """How the states consumer takes part in its group. With KIP-848's protocol the broker assigns partitions and owns
    the session timeout and heartbeat interval (librdkafka refuses them client-side). With the classic one decider
    sets both, and the assignor is a default the [kafka] table may set: cooperative-sticky moves only the partitions
    that change owner (``worker.stream.assignment`` then drops only their uncommitted work); an eager one (range,
    roundrobin) revokes every partition of every member on each rebalance. A group switches from one kind to the other
    only with all its workers stopped: librdkafka refuses a list that mixes them, so no worker speaks both."""
    if protocol == "consumer":
        # No static membership here: Apache Kafka 4.4 refuses a second member with a static id while the first
        # still heartbeats (UNRELEASED_INSTANCE_ID, fatal in librdkafka), so a worker started in place of a live one
        # with the same --worker-id would die instead of taking over; and a static member's partitions wait for the
        # broker's session timeout even after a clean stop. The transactional id still fences the older worker
        # (its next transaction fails: exit 3), and a member that leaves hands its partitions over at once.
        return {"group.protocol": "consumer"}
    session_ms = config.session_timeout_ms or CLASSIC_SESSION_TIMEOUT_MS
    return {"partition.assignment.strategy": "cooperative-sticky", "group.protocol": "classic",
            "session.timeout.ms": session_ms, "heartbeat.interval.ms": max(100, session_ms // 5),
            # Static membership: a worker restarted with the same --worker-id (after a crash or kill -9) takes its
            # partitions back at once instead of waiting for the dead member's session to expire; a newer one with
            # the same id replaces the older in the group. A clean stop leaves the group explicitly (Worker
            # unsubscribes before closing), so its partitions move to the other workers right away.
            "group.instance.id": config.worker_id}


def incremental_rebalancing(consumer_config: dict[str, Any]) -> bool:
    """Whether a consumer with ``consumer_config`` rebalances incrementally (revokes only the partitions that move)."""
    return (consumer_config.get("group.protocol") == "consumer"
            or "cooperative" in str(consumer_config.get("partition.assignment.strategy", "")))


CONSUMER_GROUP_HEARTBEAT_API = 68
"""KIP-848's ConsumerGroupHeartbeat: a broker that lists it in its ApiVersions answer runs the consumer protocol."""
_API_LINE = re.compile(r"ApiKey \S+ \((\d+)\) Versions (\d+)\.\.(\d+)")


class _LogLines:
    """A librdkafka ``logger`` that keeps the lines (for ``broker_api_keys``)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def log(self, level: int, message: str, *args: Any) -> None:
        self.lines.append(message % args if args else message)


EMBEDDED_BROKER_CLUSTER_ID = "MkU3OEVBNTctOEUyRi00"
"""The cluster id noida-db 0.2.3 (the embedded development broker) reports, the same for every data directory:
how a worker tells it from Kafka, whose KRaft cluster ids are random UUIDs (``StorageTool random-uuid``)."""


def is_embedded_broker(cluster: Cluster | str, timeout_s: float = 5.0) -> bool:
    """Whether the brokers at ``cluster`` are the embedded development broker (False when none answers)."""
    admin = AdminClient({**base_config(cluster), "log_level": 0})
    try:
        return admin.list_topics(timeout=timeout_s).cluster_id == EMBEDDED_BROKER_CLUSTER_ID
    except KafkaException:
        return False


def broker_api_keys(cluster: Cluster | str, timeout_s: float = 5.0) -> set[int] | None:
    """The API keys the bootstrap broker advertises, or None if they could not be read (no broker answered, or
    librdkafka's log lines changed their form).

    librdkafka keeps each broker's ApiVersions answer to itself; its ``feature`` debug context logs it, one line per
    API, on the client's own connection (TLS and SASL included: ApiVersions precedes authentication). So a short-lived
    admin client lists the topics once, which connects it, and the lines are read back."""
    lines = _LogLines()
    admin = AdminClient({**base_config(cluster), "debug": "feature", "log_level": 7, "logger": lines})
    try:
        admin.list_topics(timeout=timeout_s)
    except KafkaException:
        return None
    deadline = time.monotonic() + 1.0
    while not any(_API_LINE.search(line) for line in lines.lines) and time.monotonic() < deadline:
        admin.poll(0.05)
    keys = {int(match.group(1)) for line in lines.lines if (match := _API_LINE.search(line))}
    return keys or None


def replay_consumer_config(config: WorkerConfig) -> dict[str, Any]:
    """Settings of a replay's states consumer: assigned partitions, offsets committed only in transactions."""
    return {
        "fetch.wait.max.ms": 100,  # a default the [kafka] table may set
        **base_config(config.cluster),
        "group.id": config.group,  # only holds the committed offsets; never joined (assign(), no subscribe)
        "enable.auto.commit": False,
        "isolation.level": "read_committed",
        # A partition whose range ends at the topic's end is finished when the reader reaches it.
        "enable.partition.eof": True,
        "auto.offset.reset": "earliest",
        "statistics.interval.ms": 2000,
        "stats_cb": _on_states_consumer_stats,
    }


def transactional_producer_config(config: WorkerConfig) -> dict:
    """Settings of the producer whose transactions carry output records, dead letters and input offsets."""
    return {
        # Once every broker it knows is down, librdkafka re-bootstraps by default and decommissions the brokers it
        # knew, the coordinators among them; a send_offsets_to_transaction in flight then never returns, even after
        # the broker is back (librdkafka issues 5456 and 5511: the coordinator request waits on a state change of a
        # broker thread that no longer exists). Seen on the embedded broker killed mid-stream, every run at
        # transaction timeouts of 20 s and 60 s. Without re-bootstrap the call returns once the broker answers
        # (Java clients before Kafka 4.0 never re-bootstrap either). The [kafka] table may set it back.
        "metadata.recovery.strategy": "none",
        # Apache Kafka answers EndTxn before the transaction's markers are written, and refuses the next
        # transaction's AddOffsetsToTxn and AddPartitionsToTxn with CONCURRENT_TRANSACTIONS until they are (a few to
        # tens of ms on one node). librdkafka retries those after retry.backoff.ms, doubling up to
        # retry.backoff.max.ms: at the defaults (100 ms, 1 s) back-to-back transactions spent ~110 ms of ~115 in
        # send_offsets_to_transaction; at 5 ms and 25 ms ~30 ms in all, waits of up to 25 ms once the doubling reaches
        # them; at 2 ms and 10 ms the same p50 on the CPU, and on the H200's host a commit of 6.5 ms against 8.5
        # (docs/brokers.md). The [kafka] table may set both.
        "retry.backoff.ms": 2,
        "retry.backoff.max.ms": 10,
        **base_config(config.cluster),
        # Derived from --worker-id: a restarted worker fences its predecessor and aborts its open transaction.
        "transactional.id": config.transactional_id,
        "transaction.timeout.ms": config.transaction_timeout_ms,
        "partitioner": "murmur2_random",
        "linger.ms": 2,  # a whole batch is produced at once, then flushed; no point waiting longer
    }

