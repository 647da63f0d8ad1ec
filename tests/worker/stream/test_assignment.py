"""Which group protocol a worker joins with: the one asked for, else the best one the broker offers, unless a setting
only the classic protocol has was given; asking for one the broker lacks is a user error, not a silent hang."""

from __future__ import annotations

import pytest

from worker.config import WorkerConfig
from worker.exceptions import ConfigError
from worker.kafka_clients import CONSUMER_GROUP_HEARTBEAT_API
from worker.stream.assignment import choose_group_protocol

CLASSIC_BROKER = {11, 12, 14, 28}
KIP_848_BROKER = CLASSIC_BROKER | {CONSUMER_GROUP_HEARTBEAT_API}


def _config(**fields) -> WorkerConfig:
    return WorkerConfig(bootstrap="kafka:9092", model_dir="m", worker_id="w", **fields)


@pytest.mark.parametrize("fields, api_keys, protocol", [
    ({}, KIP_848_BROKER, "consumer"),
    ({}, CLASSIC_BROKER, "classic"),
    ({}, None, "classic"),                                                   # the broker's list could not be read
    ({"group_protocol": "classic"}, KIP_848_BROKER, "classic"),
    ({"group_protocol": "consumer"}, None, "consumer"),                      # asked for: librdkafka will tell
    ({"kafka": {"group.protocol": "consumer"}}, KIP_848_BROKER, "consumer"),
    ({"session_timeout_ms": 6000}, KIP_848_BROKER, "classic"),               # settings only classic has
    ({"kafka": {"partition.assignment.strategy": "range"}}, KIP_848_BROKER, "classic"),
])
def test_the_protocol_asked_for_else_the_brokers_best(fields, api_keys, protocol):
    chosen, why = choose_group_protocol(_config(**fields), api_keys)
    assert chosen == protocol and why


def test_asking_for_the_consumer_protocol_on_a_broker_without_it_is_a_user_error():
    with pytest.raises(ConfigError, match="does not offer KIP-848's consumer group protocol"):
        choose_group_protocol(_config(group_protocol="consumer"), CLASSIC_BROKER)
