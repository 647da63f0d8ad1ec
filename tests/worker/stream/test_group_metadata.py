"""The group metadata cycles' transactions carry (worker.stream.group_metadata): asked of the consumer once and kept,
asked again after a rebalance callback, an abort's forget, or its maximum age."""

from __future__ import annotations

import pytest
from confluent_kafka import Consumer

from worker.config import WorkerConfig
from worker.stream import group_metadata
from worker.stream.assignment import GroupAssignment
from worker.stream.group_metadata import GroupMetadata


@pytest.fixture
def consumer():
    """A real librdkafka consumer: it answers ``consumer_group_metadata`` itself, whether a broker is there or not."""
    consumer = Consumer({"bootstrap.servers": "127.0.0.1:1", "group.id": "metadata", "log_level": 0})
    yield consumer
    consumer.close()


def test_the_metadata_is_asked_once_and_kept_until_forgotten(consumer):
    metadata = GroupMetadata()
    first = metadata.current(consumer)
    assert first == consumer.consumer_group_metadata()
    assert [metadata.current(consumer) for _ in range(50)] == [first] * 50
    assert metadata.asked == 1
    metadata.forget()
    metadata.current(consumer)
    assert metadata.asked == 2


def test_metadata_older_than_its_maximum_age_is_asked_again(consumer, monkeypatch):
    metadata = GroupMetadata()
    metadata.current(consumer)
    monkeypatch.setattr(group_metadata, "MAX_AGE_S", 0.0)
    metadata.current(consumer)
    assert metadata.asked == 2


@pytest.mark.parametrize("callback", ["_on_assign", "_on_revoke", "_on_lost"])
def test_every_rebalance_callback_forgets_it(consumer, callback):
    """A rebalance moves the classic protocol's generation or KIP-848's member epoch: the next transaction asks."""
    assignment = GroupAssignment(WorkerConfig(bootstrap="127.0.0.1:1", model_dir="m", worker_id="w"))
    assignment.metadata.current(consumer)
    getattr(assignment, callback)(consumer, [])
    assignment.metadata.current(consumer)
    assert assignment.metadata.asked == 2
