"""bench/probes/transaction_probe.py on the session's broker: every variant runs its transactions through the
worker's ``Transactions`` and reports each step; a variant's settings reach the producer (an unknown key fails)."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaException

from bench.probes import transaction_probe
from tests.brokers import bench_broker_args


def test_every_variant_times_every_step_of_its_transactions():
    result = transaction_probe.main([*bench_broker_args(), "--transactions", "4", "--blocks", "2", "--records", "3"])
    assert set(result["variants"]) == {"decider", "librdkafka-backoff"}
    assert result["variants"]["librdkafka-backoff"]["settings"] == {"retry.backoff.ms": "100", "retry.backoff.max.ms": "1000"}
    for row in result["variants"].values():
        assert set(row) == {"settings", "begin", "produce", "offsets", "flush", "commit", "total"}
        assert 0 < row["total"]["p50"] <= row["total"]["p99"]
        assert row["total"]["p50"] >= row["offsets"]["p50"]


def test_a_variant_setting_librdkafka_does_not_know_fails():
    with pytest.raises(KafkaException, match="no.such.setting"):
        transaction_probe.main([*bench_broker_args(), "--transactions", "1", "--blocks", "1",
                                "--variant", "bad:no.such.setting=1"])
