"""The benchmarks' slower broker: every Kafka round trip through the proxy costs twice its delay, and no client
connection goes around it (the broker's address in its responses is rewritten to the proxy's)."""
import threading
import time
import uuid

import pytest
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from bench.latency_proxy import DelayStats, Frames, serve
from tests.brokers import own_broker
from worker.devbroker.processes import free_port

DELAY_MS = 40.0


@pytest.fixture(scope="module")
def proxied(tmp_path_factory):
    """(broker bootstrap, proxy bootstrap, the proxy's stats): a broker of its own, of the session's kind, so that the
    address rewrite is tested against a broker on 127.0.0.1 whatever address the session's has."""
    with own_broker(tmp_path_factory.mktemp("proxied")) as broker:
        listen = ("127.0.0.3", free_port())
        stats, ready = DelayStats(), threading.Event()
        threading.Thread(target=serve, args=(listen, ("127.0.0.1", broker.port), DELAY_MS, stats, ready),
                         daemon=True).start()
        assert ready.wait(5)
        yield broker.bootstrap, f"{listen[0]}:{listen[1]}", stats


def _create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, partitions, 1)])[topic].result(10)


def _round_trip_s(bootstrap: str, topic: str) -> float:
    """Seconds for one acknowledged produce on a connected producer (its metadata already fetched)."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})
    producer.produce(topic, b"warm")
    producer.flush(10)
    started = time.perf_counter()
    producer.produce(topic, b"timed")
    assert producer.flush(10) == 0
    return time.perf_counter() - started


def test_frames_are_cut_at_their_sizes_whatever_the_reads():
    frames = Frames()
    stream = b"\x00\x00\x00\x03abc" + b"\x00\x00\x00\x01z"
    assert frames.feed(stream[:5]) == []
    assert frames.feed(stream[5:9]) == [b"\x00\x00\x00\x03abc"]
    assert frames.feed(stream[9:]) == [b"\x00\x00\x00\x01z"]


def test_the_broker_is_advertised_at_the_proxy_and_each_round_trip_pays_both_delays(proxied):
    direct, via_proxy, stats = proxied
    topic = f"proxy-{uuid.uuid4().hex[:8]}"
    _create_topic(direct, topic, 1)
    brokers = AdminClient({"bootstrap.servers": via_proxy}).list_topics(timeout=10).brokers
    assert [f"{b.host}:{b.port}" for b in brokers.values()] == [via_proxy]
    assert stats.rewrites > 0
    direct_s, proxied_s = _round_trip_s(direct, topic), _round_trip_s(via_proxy, topic)
    assert proxied_s >= 2 * DELAY_MS / 1000 > direct_s
    summary = stats.summary(DELAY_MS)
    assert summary["frames"] > 0 and DELAY_MS <= summary["added_p50_ms"] < DELAY_MS + 20


def test_a_consumer_group_works_through_the_proxy(proxied):
    direct, via_proxy, _ = proxied
    topic = f"proxy-group-{uuid.uuid4().hex[:8]}"
    _create_topic(direct, topic, 2)
    producer = Producer({"bootstrap.servers": direct})
    for i in range(10):
        producer.produce(topic, str(i).encode(), partition=i % 2)
    producer.flush(10)
    consumer = Consumer({"bootstrap.servers": via_proxy, "group.id": topic, "auto.offset.reset": "earliest"})
    consumer.subscribe([topic])
    seen, deadline = set(), time.time() + 30
    while len(seen) < 10 and time.time() < deadline:
        message = consumer.poll(0.2)
        if message is not None and message.error() is None:
            seen.add(message.value())
    consumer.close()
    assert seen == {str(i).encode() for i in range(10)}
