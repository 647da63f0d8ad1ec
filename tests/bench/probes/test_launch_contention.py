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


def test_pieces_clock_the_launch_path_on_the_gpu_thread_and_put_every_function_back():
    from bench.probes.launch_contention import PIECES, main
    from engine.step_layout import StepLayout
    from engine.schema_engine import SchemaEngine
    from worker.stream.scorer import Scorer

    originals = (Scorer.__dict__["_gather"], SchemaEngine.__dict__["launch_mixed"], StepLayout.__dict__["stage"])
    rows = main(["--quick", "--batches", "2", "--iters", "4", "--rounds", "1", "--pieces"])
    assert (Scorer.__dict__["_gather"], SchemaEngine.__dict__["launch_mixed"], StepLayout.__dict__["stage"]) == originals
    assert isinstance(Scorer.__dict__["_gather"], staticmethod)
    timed = {r["piece"]: r for r in rows if "piece" in r}
    assert set(PIECES) < set(timed)
    for name in ("worker.stream.scorer:Scorer._gather", "engine.schema_engine:SchemaEngine.launch_mixed",
                 "engine.step_layout:StepLayout.stage"):
        assert timed[name]["calls_a_cycle"] == 1.0 and timed[name]["cpu_us_a_cycle"] > 0
    # nested: the launch holds the step it stages
    assert timed["engine.schema_engine:SchemaEngine.launch_mixed"]["wall_us_a_cycle"] >= \
        timed["engine.step_layout:StepLayout.stage"]["wall_us_a_cycle"]
    assert timed["launch (taken -> launched)"]["cpu_us_p50"] > 0


def test_variants_time_sync_as_it_is_and_under_each_setting_in_turn_rotated_and_put_it_back():
    import engine.label_mass as label_mass
    from bench.probes.launch_contention import main

    rows = main(["--quick", "--batches", "2", "--iters", "4", "--rounds", "2", "--modes", "sync",
                 "--variant", "loop:engine.label_mass.ORDERED_MASS_KERNEL=False"])
    assert [(r["mode"], r.get("variant")) for r in rows] == [("sync", None), ("sync", None), ("sync", "base"),
                                                             ("sync", "loop"), ("sync", "loop"), ("sync", "base")]
    assert all(r["cpu_us_p50"] > 0 and r["cycles_per_s"] > 0 for r in rows)
    assert label_mass.ORDERED_MASS_KERNEL is True


def test_an_unknown_mode_is_refused_by_name(capsys):
    import pytest

    from bench.probes.launch_contention import main

    with pytest.raises(SystemExit):
        main(["--quick", "--modes", "sync,fast"])
    assert "unknown mode(s) fast" in capsys.readouterr().err
