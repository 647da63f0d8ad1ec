"""The attention kernels' D split (`engine.kernels.suffix_attention.launch`): a launch's fifth element gives each query
block `split` programs, each computing the block's scores from all D columns of q and k and the output on D / split
columns of v. A row's result must be the attention (against the reference), the same bits alone and in any batch at one
split launch, and the same bits as the unsplit launch where the device says so (`suffix_configs_agree`: on the GPU the
real check; in Triton's interpreter `tl.dot` is numpy's, equal to float32 rounding). The batch-invariant table takes a
split only where that check held at load (`InvariantSuffixAttention.splits`, `D_SPLIT`).

Interpreted on a CPU: `TRITON_INTERPRET=1 pytest -m gpu tests/engine/kernels/test_attention_split.py` (float32, small
heads); on the GPU the last test checks the 0.8B head shape in bf16 at the splits `bench/probes/variant_ab.py` times.
"""
import random

import pytest
import torch

from tests.engine.kernels.triton_device import require, same_across_tiles

ON_GPU, DEV = require()

from engine.kernels import suffix_attention as sa  # noqa: E402

from .attention_cases import Case, answer_args, probe_in_placements  # noqa: E402
from .test_suffix_attention import _LaunchSpy, _suffix_attention_reference  # noqa: E402

pytestmark = pytest.mark.gpu

HEADS = (4, 2, 32)          # G = 2; split 2 leaves 16 columns a program


def _case(seed: int) -> Case:
    return Case(HEADS, (80, 5, 33, 1), 80, torch.float32, DEV, seed=seed)


@pytest.mark.parametrize("base", [sa.CONFIG, sa.SMALL_CONFIG, (64, 64, 4, 2)], ids=["large", "small", "64-rows"])
def test_a_split_launch_computes_the_attention_with_the_unsplit_launchs_result(base):
    """Rows after prefixes of unequal lengths (key blocks crossing a prefix's end and the causal diagonal), the
    values and gate strided views as the forward passes them: split 2 against the reference, and against the
    same launch unsplit; the answers' kernel likewise at its launch split 2."""
    case = _case(seed=3)
    batch = case.batch(case.row(41), 2, 3, 45, 1, random.Random(4))
    args = case.suffix_args(batch)
    split = sa.suffix_attention(*args, 0.2, configs=((*base, 2), None))
    whole = sa.suffix_attention(*args, 0.2, configs=(base, None))
    want = _suffix_attention_reference(*(t.cpu() for t in args), 0.2)
    torch.testing.assert_close(split.cpu(), want, atol=2e-5, rtol=2e-5)
    assert same_across_tiles(split, whole)
    kw, _ = case.answers(batch, [0, 17, 40], 4, 1, random.Random(5))
    n = int(kw["counts"].sum())
    answers = sa.answer_attention(*answer_args(kw), 0.2)
    torch.testing.assert_close(answers[:n].cpu(), want.reshape(-1, want.shape[-1])[kw["rows"][:n].cpu()],
                               atol=2e-5, rtol=2e-5)
    try:
        sa.ANSWER_CONFIG, saved = (*sa.ANSWER_CONFIG[:4], 2), sa.ANSWER_CONFIG
        answers_split = sa.answer_attention(*answer_args(kw), 0.2)
    finally:
        sa.ANSWER_CONFIG = saved
    assert same_across_tiles(answers_split, answers) and not answers_split[n:].any()


@pytest.mark.parametrize("base", [sa.CONFIG, (64, 64, 4, 2)], ids=["large", "64-rows"])
def test_a_split_launch_gives_a_row_the_same_bits_in_any_batch(base, monkeypatch):
    """At one split launch (the suffix kernel's, and the answers' at theirs split 2, as `ANSWER_CONFIG` would hold
    it) a probe row's outputs are the same bits alone and among random neighbours in batches of other sizes padded
    to other lengths: the batch-invariance the table needs of every launch it takes."""
    monkeypatch.setattr(sa, "ANSWER_CONFIG", (*sa.ANSWER_CONFIG[:4], 2))

    def attention(*args):
        return sa.suffix_attention(*args, configs=((*base, 2), None))

    rows = probe_in_placements(_case(seed=5), attention, sa.answer_attention, [(2, 37), (3, 45), (5, 70), (4, 64)],
                               L=37, slot=2, probe_answers=[3, 20, 36], per_row=4, scale=0.2)
    assert all(r["suffix_equal"] and r["answers_equal"] for r in rows), rows


def test_the_invariant_table_takes_a_split_only_where_the_device_check_held(monkeypatch):
    """`InvariantSuffixAttention` checks the splits of `SUFFIX_SPLITS` that leave >= 16 columns against the large
    launch at load; a call takes the largest of them up to `D_SPLIT` (read at each call) that keeps its programs
    within `SPLIT_FILL_PROGRAMS`, else the small launch as checked. Its launch then starts `split` programs a query
    block, and its name (the scoring fingerprint's) says so. `INVARIANT_FILL_PROGRAMS` moves its small/large limit."""
    # from the settings before the splits were the default (run CN), so that each step below is one change
    monkeypatch.setattr(sa, "D_SPLIT", 1)
    monkeypatch.setattr(sa, "ANSWER_CONFIG", sa.ANSWER_CONFIG[:4])
    checked = []
    monkeypatch.setattr(sa, "suffix_configs_agree",
                        lambda heads, dtype, device, large, small: checked.append(small) or small[:4] == (64, 64, 4, 2))
    attention = sa.InvariantSuffixAttention((4, 2, 64), torch.float32, DEV)      # D 64: splits 2 and 4
    assert checked == [*sa.SUFFIX_SMALL_CANDIDATES, (64, 64, 4, 2, 2), (64, 64, 4, 2, 4)]
    assert attention.small == (64, 64, 4, 2) and attention.splits == (2, 4)
    assert attention.small_launch(24) == (64, 64, 4, 2) and repr(attention).endswith("(64, 64, 4, 2) below the fill")
    monkeypatch.setattr(sa, "D_SPLIT", 4)
    # batch 1 of the 0.8B shape (24 programs unsplit) splits 4, batch 2 (48) 2, batch 4 (96) not at all
    assert [attention.small_launch(n) for n in (24, 48, 96)] == [(64, 64, 4, 2, 4), (64, 64, 4, 2, 2), (64, 64, 4, 2)]
    assert "(D split up to 4 within 132 programs)" in repr(attention)
    monkeypatch.setattr(sa, "D_SPLIT", 2)
    assert attention.small_launch(24) == (64, 64, 4, 2, 2)
    monkeypatch.setattr(sa, "suffix_configs_agree", lambda heads, dtype, device, large, small: len(small) == 4)
    refused = sa.InvariantSuffixAttention((4, 2, 64), torch.float32, DEV)        # the splits disagree: none taken
    assert refused.splits == () and refused.small_launch(24) == refused.small and "split" not in repr(refused)
    monkeypatch.setattr(sa, "ANSWER_CONFIG", (*sa.ANSWER_CONFIG, 4))
    assert repr(refused).endswith(f"; answers {sa.ANSWER_CONFIG}")
    # a one-row step of 40 tokens (2 query blocks of 64 rows a kv head): split 4, then 1
    launches = []
    monkeypatch.setattr(sa, "_suffix_attention_kernel", _LaunchSpy(sa._suffix_attention_kernel, launches))
    case = Case((4, 2, 64), (80, 5, 33, 1), 80, torch.float32, DEV, seed=7)
    args = case.suffix_args(case.batch(case.row(40), 1, 1, 40, 0, random.Random(0)))
    monkeypatch.setattr(sa, "D_SPLIT", 4)
    split = attention(*args, 0.2)
    monkeypatch.setattr(sa, "D_SPLIT", 1)
    assert same_across_tiles(attention(*args, 0.2), split)
    # the table's own fill (the fast table's `FILL_PROGRAMS` untouched): at 1 the large launch even for one row
    monkeypatch.setattr(sa, "INVARIANT_FILL_PROGRAMS", 1)
    assert same_across_tiles(attention(*args, 0.2), split)
    assert launches == [(64, (2 * 4, 2, 1)), (64, (2, 2, 1)), (sa.CONFIG[0], (1, 2, 1))]


def test_a_split_must_leave_a_power_of_two_of_at_least_16_columns():
    with pytest.raises(ValueError):
        sa.launch((64, 64, 4, 2, 4), D=32)
    with pytest.raises(ValueError):
        sa.launch((64, 64, 4, 2, 3))
    assert sa.launch((64, 64, 4, 2), D=32) == (64, 64, 4, 2, 1) and sa.launch((64, 64, 4, 2, 2), D=32)[4] == 2


@pytest.mark.skipif(not ON_GPU, reason="whether a split gives the unsplit launch's bits is the GPU's answer")
@pytest.mark.parametrize("split", [4, 2])
def test_split_launches_give_a_row_the_large_launchs_bits_at_the_08b_shape(split, monkeypatch):
    """On the device, at the 0.8B shape in bf16 (8 query heads, 2 kv heads, head dim 256): the load-time check finds
    the split of the 64-row launch giving the large launch's bits, and with `D_SPLIT` and the answers at that split a
    probe row of 182 tokens after a 400-token prefix is the same bits alone (the split small launch) as in batches of
    2 x 184 to 128 x 264 (the large launch from 32 rows up): what `D_SPLIT` needs before it can be the default."""
    from tests.engine.test_gpu_invariance import PLACEMENTS

    attention = sa.InvariantSuffixAttention((8, 2, 256), torch.bfloat16, "cuda")
    # "exact" in the line: `bench/gpu_session.sh tests` shows it
    print(f"D splits giving the large launch's bits exactly: {attention.splits} ({attention!r})")
    assert split in attention.splits
    monkeypatch.setattr(sa, "D_SPLIT", split)
    monkeypatch.setattr(sa, "ANSWER_CONFIG", (*sa.ANSWER_CONFIG[:4], split))
    case = Case((8, 2, 256), (400, 37, 129, 512, 300), 512, torch.bfloat16, "cuda", seed=11)
    rows = probe_in_placements(case, attention, sa.answer_attention, PLACEMENTS, L=182, slot=0,
                               probe_answers=list(range(163, 182, 2)), per_row=16, scale=256 ** -0.5)
    print(f"split {split}, same bits exactly: " + ", ".join(
        f"{r['R']}x{r['T']}: suffix {r['suffix_equal']}, answers {r['answers_equal']}" for r in rows))
    assert all(r["suffix_equal"] and r["answers_equal"] for r in rows), rows
