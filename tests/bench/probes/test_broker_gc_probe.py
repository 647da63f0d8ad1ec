"""bench/probes/broker_gc_probe.py on a real Apache Kafka broker, briefly."""
import json

import pytest

from tests import brokers


@pytest.mark.skipif(brokers.kafka_problem() is not None, reason="needs Java and the Kafka jars (bash dev/setup.sh)")
def test_the_probe_commits_transactions_and_reads_the_brokers_pauses(tmp_path):
    from bench.probes import broker_gc_probe

    out = tmp_path / "gc.json"
    [result] = broker_gc_probe.main(["--gc", "zgc", "--seconds", "4", "--rate", "300", "--out", str(out)])
    assert json.loads(out.read_text()) == [result]
    assert result["states"] > 100 and result["transactions"] > 10 and result["broker_cpu_ms_per_1000_states"] > 0
    assert result["pauses"] > 0 and result["pause_ms_max"] < 5      # ZGC's pauses, at the start's collections at least


def test_an_unknown_collector_is_refused_before_any_broker_starts(capsys):
    from bench.probes import broker_gc_probe

    with pytest.raises(SystemExit):
        broker_gc_probe.main(["--gc", "zgc,serial"])
    assert "serial" in capsys.readouterr().err
