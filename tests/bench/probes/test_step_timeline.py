"""bench/probes/step_timeline.py: a step's device time split into kernels and the gaps between them."""
import pytest

from bench.probes.step_timeline import Interval, split_steps, step_summary, summarize


def _step(offset: float) -> list[Interval]:
    # a GEMM, 2 us idle, a Triton kernel, 1 us idle, a copy overlapping nothing, a second GEMM right after, a memset
    return [Interval("nvjet_sm90_tst_32x64", offset + 0, offset + 10),
            Interval("_row_norm_kernel", offset + 12, offset + 15),
            Interval("Memcpy HtoD (Pinned -> Device)", offset + 16, offset + 17),
            Interval("nvjet_sm90_tst_168x64", offset + 17, offset + 27),
            Interval("Memset (Device)", offset + 27, offset + 28)]


def test_a_step_splits_into_kernels_and_gaps_by_family_and_transition():
    summary = step_summary(_step(100.0))
    assert summary["wall_us"] == 28 and summary["gaps_us"] == 3 and summary["busy_us"] == 25
    gemm = summary["families"]["GEMM (cuBLAS)"]
    assert (gemm["count"], gemm["kernel_us"], gemm["gap_before_us"]) == (2, 20, 0)
    assert summary["families"]["_row_norm_kernel"]["gap_before_us"] == 2
    assert summary["families"]["copy"]["gap_before_us"] == 1
    assert summary["families"]["memset"]["count"] == 1
    assert summary["transitions"][("GEMM (cuBLAS)", "_row_norm_kernel")] == (1, 2)
    assert summary["transitions"][("copy", "GEMM (cuBLAS)")] == (1, 0)
    assert summary["transitions"][("GEMM (cuBLAS)", "memset")] == (1, 0)


def test_the_time_from_the_first_kernel_leaves_out_the_inputs_copies_and_the_launchs_delay():
    # the inputs' copies, then 50 us until the graph's first kernel starts (its launch on the host)
    step = [Interval("Memcpy HtoD (Pinned -> Device)", 0, 1), Interval("Memcpy HtoD (Pinned -> Device)", 1, 2),
            *_step(52.0)]
    summary = step_summary(step)
    assert summary["wall_us"] == 80 and summary["from_first_kernel_us"] == 28
    assert "from the first kernel after the input's copies: median 28.0 us" in summarize(step, 1)


def test_overlapping_events_are_not_counted_as_idle():
    summary = step_summary([Interval("_a", 0, 10), Interval("_b", 5, 8), Interval("_c", 11, 12)])
    assert summary["wall_us"] == 12 and summary["gaps_us"] == 1


def test_steps_are_told_apart_by_count_and_the_median_one_is_reported():
    trace = _step(0) + _step(1000) + _step(2000)
    assert [s[0].start_us for s in split_steps(trace, 3)] == [0, 1000, 2000]
    report = summarize(trace, 3)
    assert "median 28.0 us" in report and "idle between them 3.0 us" in report
    with pytest.raises(ValueError, match="do not divide"):
        split_steps(trace[:-1], 3)


def test_torch_kernels_are_listed_by_whole_name_in_step_order():
    from bench.probes.step_timeline import Interval, torch_kernels

    step = [Interval("_row_norm_kernel", 0, 2), Interval("void at::native::(anonymous namespace)::CatArrayBatchedCopy<"
                                                         "float>(x)", 3, 9),
            Interval("nvjet_gemm", 10, 20), Interval("void at::native::vectorized_elementwise_kernel<4>(y)", 21, 22)]
    lines = torch_kernels(step)
    assert lines[3] == "| 1 | _row_norm_kernel | void CatArrayBatchedCopy<float>(x) | 6.0 |"
    assert lines[4] == "| 3 | GEMM (cuBLAS) | void vectorized_elementwise_kernel<4>(y) | 1.0 |" and len(lines) == 5
