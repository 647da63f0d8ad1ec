"""`bench/probes/launch_contention.py` stays runnable: `--quick` on the CPU, tiny model, every mode through the worker's
own `Scorer`, and the engine as it was afterwards."""


def test_launch_contention_quick_times_every_mode_and_restores_the_engine(tmp_path):
    import json

    from bench.probes.launch_contention import MODES, main
    from engine import SchemaEngine

    record_done = SchemaEngine._record_done
    out = tmp_path / "contention.json"
    rows = main(["--quick", "--batches", "2", "--iters", "4", "--rounds", "1", "--out", str(out)])
    assert SchemaEngine._record_done is record_done
    assert [r["mode"] for r in rows] == list(MODES)
    for row in rows:
        assert row["batch"] == 2 and row["cycles_per_s"] > 0
        assert 0 < row["cpu_us_p50"] <= row["cpu_us_p90"]
        assert row["cpu_us_p50"] <= row["launch_us_p50"] * 1.5    # CPU within its wall span, clocks' grain aside
    assert len(json.loads(out.read_text())["rows"]) == len(MODES)


def test_blocking_events_hold_only_inside_their_block():
    from bench.probes.launch_contention import blocking_events
    from engine import SchemaEngine

    before = SchemaEngine._record_done
    with blocking_events():
        assert SchemaEngine._record_done is not before
    assert SchemaEngine._record_done is before
