"""The benchmark stays runnable: `engine_bench.py --quick` on the CPU, tiny model."""
from bench.engine_bench import main

FIELDS = {"method", "batch", "state_tokens", "states_per_s", "tokens_per_s", "gemm_fraction", "p50_ms", "p99_ms"}


def test_quick_run_measures_every_cpu_method(capsys):
    result = main(["--quick", "--iters", "1"])
    runs = result["runs"]
    assert {r["method"] for r in runs} == {"reference", "full_fast", "cached_eager"}
    assert {r["batch"] for r in runs} == {1, 4}
    for r in runs:
        assert FIELDS <= r.keys()
        assert r["states_per_s"] > 0 and r["p99_ms"] >= r["p50_ms"] > 0
    assert {"gpu", "torch", "transformers", "fla"} <= result["env"].keys()
    assert max(result["parity"].values()) < 1e-4
    assert "| method | batch |" in capsys.readouterr().out


def test_stream_bench_quick_runs_end_to_end_exactly_once():
    """Embedded broker + a real worker process + load generator, on the CPU; every phase verifies exactly-once."""
    from bench.stream_bench import main as stream_main

    result = stream_main(["--quick", "--states", "60", "--latency-seconds", "2", "--replay"])
    phases = [r["phase"] for r in result["runs"]]
    assert phases == ["throughput", "latency", "replay"]
    tput, lat, replay = result["runs"]
    for r in (tput, lat):
        assert r["ok"], r
    assert tput["states_per_s"] > 0 and result["engine_only_states_per_s"] > 0
    assert 0 < lat["p50_ms"] <= lat["p99_ms"]
    # the replay scored every state of the live latency phase, and each has a live record to compare with
    assert replay["exit_code"] == 0 and replay["states_per_s"] > 0, replay
    assert replay["states"] == replay["compared"] > 0, replay
