"""Scale-out under load (``bench.scale_out``), on the CPU with the tiny model and the tests' broker: the workers of
one group go 1 -> 3 -> 1 (one joins, another joins, one is SIGTERMed, one SIGKILLed) while states keep arriving;
every state is visible exactly once, and each rebalance's cost is reported: partitions moved, seconds each partition
had no owner, states read twice. Incremental rebalancing leaves the partitions that keep their owner owned
throughout; eager revokes every partition at every join and stop. A worker whose group session expires meanwhile (on
this 2-core machine the embedded broker has answered nothing for the 6 s session timeout while a starting worker
loaded its model) loses its whole assignment and joins again: the table reports those partitions as lost, and they
are the only others an incremental step may leave unowned.

The default run is short; ``-m slow`` runs the same steps at a higher rate with longer dwells. Run with ``-s`` to see
the table (it is also written to the test's temporary directory as scale-out.md)."""
from __future__ import annotations

import json

import pytest

from bench.rebalances import markdown
from bench.scale_out import ScaleOut, run_scale_out
from tests import brokers
from tests.worker.conftest import QUESTIONS, state_texts

MODES = ["eager", "incremental"] + (["consumer"] if "consumer" in brokers.group_protocols() else [])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from engine.testing import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("scale-model"), seed=0)


def _run(kafka_bootstrap, tiny_model, tmp_path, rebalancing: str, rate: float, dwell_s: float) -> dict:
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(QUESTIONS))
    result = run_scale_out(ScaleOut(kafka_bootstrap, tiny_model, schema_file, tmp_path, state_texts(500, seed=5),
                                    rebalancing=rebalancing, rate=rate, dwell_s=dwell_s,
                                    expire_killed_members=brokers.selection() == "embedded"))
    table = markdown([result])
    (tmp_path / "scale-out.md").write_text(table + "\n")
    print(f"\n{result['states']} states at {rate:.0f}/s, exactly once: {result['exactly_once']}\n{table}")
    return result


def _check(result: dict) -> None:
    assert result["exactly_once"]["ok"], result
    rows = {row["step"]: row for row in result["rebalances"]}
    assert list(rows) == ["worker 1 joins", "worker 2 joins", "worker 1 SIGTERM", "worker 2 SIGKILL"], rows
    for row in rows.values():
        assert row["moved"] and set(row["moved"]) <= set(row["unowned_s"]), row   # a move leaves it unowned a while
    if result["rebalancing"] == "eager":
        for step in ("worker 1 joins", "worker 2 joins", "worker 1 SIGTERM"):
            assert sorted(rows[step]["unowned_s"]) == list(range(8)), rows[step]   # everyone revokes everything
    else:
        for row in rows.values():
            # only the partitions that move, or that an expired session lost, are ever unowned
            assert sorted(row["unowned_s"]) == sorted(set(row["moved"]) | set(row["lost"])), row
    kill = rows["worker 2 SIGKILL"]
    # the killed worker's partitions wait for its session to expire
    assert min(kill["unowned_s"][p] for p in kill["moved"]) >= 3.0, kill


@pytest.mark.parametrize("rebalancing", MODES)
def test_workers_go_one_to_three_to_one_under_load_and_every_state_is_scored_once(kafka_bootstrap, tiny_model,
                                                                                  tmp_path, rebalancing):
    _check(_run(kafka_bootstrap, tiny_model, tmp_path, rebalancing, rate=20.0, dwell_s=2.0))


@pytest.mark.slow
@pytest.mark.parametrize("rebalancing", MODES)
def test_the_longer_scale_out_run(kafka_bootstrap, tiny_model, tmp_path, rebalancing):
    _check(_run(kafka_bootstrap, tiny_model, tmp_path, rebalancing, rate=60.0, dwell_s=10.0))
