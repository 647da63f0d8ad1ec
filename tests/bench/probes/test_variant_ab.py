"""`bench/probes/variant_ab.py` stays runnable: `--quick` on the CPU, tiny model; a malformed variant is refused in
one line."""
import pytest


def test_variant_ab_quick_times_each_variant_with_its_constants_then_restores_them(tmp_path):
    """bench/probes/variant_ab.py on the CPU: a variant's constants hold while its engine is built and scored, base's
    probabilities are the reference, and the module is as it was afterwards."""
    import json

    from bench.probes.variant_ab import main as variant_main
    from engine import buckets

    before = buckets.B_BUCKETS
    out = tmp_path / "ab.json"
    result = variant_main(["--quick", "--batches", "1,3", "--rounds", "2", "--iters", "1",
                           "--variant", "small-buckets:engine.buckets.B_BUCKETS=(1, 2, 4)", "--out", str(out)])
    assert buckets.B_BUCKETS is before
    assert result["variants"] == {"base": [], "small-buckets": ["engine.buckets.B_BUCKETS=(1, 2, 4)"]}
    for B in (1, 3):
        row = result["batches"][B]
        assert set(row) == {"base", "small-buckets"}
        assert all(len(r["rounds_ms"]) == 2 and r["p50_ms"] > 0 for r in row.values())
        assert row["base"]["max_diff_vs_base"] == 0
        assert row["small-buckets"]["max_diff_vs_base"] < 1e-5    # bucket padding does not move a row's scores
    assert json.loads(out.read_text())["rounds"] == 2


@pytest.mark.parametrize("spec", ["no-settings", "x:engine.buckets.NO_SUCH=1", "x:engine.buckets.B_BUCKETS=(1,",
                                  "base:engine.buckets.B_BUCKETS=(1,)", "x:no_such_module.A=1"])
def test_variant_ab_rejects_a_malformed_variant_in_one_line(spec, capsys):
    from bench.probes.variant_ab import main as variant_main

    with pytest.raises(SystemExit) as exit_:
        variant_main(["--quick", "--variant", spec])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert ": error: argument --variant: variant " in err.strip().splitlines()[-1], err
