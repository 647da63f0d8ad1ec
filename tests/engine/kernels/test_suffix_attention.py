"""The attention kernels of a suffix pass: engine.kernels.suffix_attention (one kernel for a row's prefix and causal
suffix, the answers' attention, the deterministic table's launches) and the split path's prefix half read from the bank
by index (engine.kernels.cuda_deterministic.indexed_attention). Runs on the GPU, or on a CPU through Triton's
interpreter (`tests/engine/kernels/test_fused.py` says how)."""

import pytest
import torch

from tests.engine.kernels.triton_device import require

ON_GPU, DEV = require()

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the key loop's bound is a loaded length, which Triton's "
                    "interpreter cannot iterate to")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexed_attention_reads_each_rows_prefix_from_the_bank(dtype):
    """The prefix half for rows of many schemas: query entry z attends to bank entry kv_index[z], only up to its own
    length, and its result does not depend on the other rows."""
    from engine.kernels.cuda_deterministic import indexed_attention

    g = torch.Generator().manual_seed(7)
    S, Hkv, N, D, B, GT = 5, 2, 300, 64, 9, 3 * 41
    bank_k, bank_v = ((torch.randn(S, Hkv, N, D, generator=g)).to(DEV, dtype) for _ in range(2))
    lengths = torch.tensor([300, 17, 129, 64, 1], dtype=torch.int32, device=DEV)
    index = torch.tensor([1, 0, 4, 2, 2, 3, 0, 1, 4], device=DEV)
    q = torch.randn(B, Hkv, GT, D, generator=g).to(DEV, dtype)
    out, lse = indexed_attention(q, bank_k, bank_v, 0.125, lengths, index)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for z in range(B):
        s, n = index[z].item(), lengths[index[z]].item()
        scores = (q[z].float() @ bank_k[s, :, :n].float().transpose(-1, -2)) * 0.125
        want = torch.softmax(scores, -1) @ bank_v[s, :, :n].float()
        torch.testing.assert_close(out[z].float(), want, atol=tol, rtol=tol)
        torch.testing.assert_close(lse[z], torch.logsumexp(scores, -1), atol=1e-4, rtol=1e-4)
        alone = indexed_attention(q[z:z + 1], bank_k, bank_v, 0.125, lengths, index[z:z + 1])
        assert torch.equal(alone[0], out[z:z + 1]) and torch.equal(alone[1], lse[z:z + 1])


def _suffix_attention_inputs(dtype, seed: int):
    """q [B, Hq, T, D], k [B, Hkv, T, D], v (a strided view, as the forward's), a bank of 4 prefixes' K/V of lengths
    80, 5, 33 and 1, the rows' slots and the gate [B, T, Hq, D] (a strided half): B = 3, T = 70, G = 2, D = 32."""
    g = torch.Generator().manual_seed(seed)
    S, Hkv, G, N, D, B, T = 4, 2, 2, 80, 32, 3, 70
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(DEV, dtype)  # noqa: E731
    bank_k, bank_v = rnd(S, Hkv, N, D), rnd(S, Hkv, N, D)
    lengths = torch.tensor([80, 5, 33, 1], dtype=torch.int32, device=DEV)
    slots = torch.tensor([2, 0, 3], device=DEV)
    q, k = rnd(B, Hkv * G, T, D), rnd(B, Hkv, T, D)
    v = rnd(B, T, Hkv, 2 * D)[..., D:].transpose(1, 2)
    gate = torch.chunk(rnd(B, T, Hkv * G, 2 * D), 2, dim=-1)[1]
    return q, k, v, bank_k, bank_v, lengths, slots, gate


def _suffix_attention_reference(q, k, v, bank_k, bank_v, lengths, slots, gate, scale):
    """One softmax per row over [its prefix's keys from its bank entry | its causal suffix keys], in float32, then
    transformers' rounding of the output and its sigmoid gate."""
    B, Hq, T, D = q.shape
    G = Hq // k.shape[1]
    out = torch.empty(B, T, Hq, D)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for b in range(B):
        s, n = slots[b].item(), lengths[slots[b]].item()
        keys = torch.cat([bank_k[s, :, :n], k[b]], 1).float().repeat_interleave(G, 0)        # [Hq, n + T, D]
        values = torch.cat([bank_v[s, :, :n], v[b]], 1).float().repeat_interleave(G, 0)
        scores = (q[b].float() @ keys.transpose(-1, -2)) * scale                               # [Hq, T, n + T]
        keep = torch.cat([torch.ones(T, n, dtype=torch.bool), causal], 1)
        o = torch.softmax(scores.masked_fill(~keep, float("-inf")), -1) @ values                 # [Hq, T, D]
        out[b] = o.to(q.dtype).float().transpose(0, 1) * torch.sigmoid(gate[b].float()).to(q.dtype).float()
    return out.reshape(B, T, Hq * D).to(q.dtype)


@pytest.mark.parametrize("dtype", [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton 3.6's "
                 "interpreter multiplies bf16 tiles wrongly"))])
@pytest.mark.parametrize("config", ["large", "small"])
def test_suffix_attention_is_one_softmax_over_the_rows_prefix_and_causal_suffix(dtype, config, monkeypatch):
    """The one-kernel attention of a suffix pass: row b's queries against bank entry slots[b]'s keys up to that
    prefix's length and its own suffix keys up to its position (key blocks crossing both the prefix's end and the
    causal diagonal), gated; strided suffix values and gate as the forward passes them. A row's output is the same
    bits whatever rows share its launch."""
    from engine.kernels import suffix_attention as sa

    monkeypatch.setattr(sa, "FILL_PROGRAMS", 0 if config == "large" else 10 ** 9)
    q, k, v, bank_k, bank_v, lengths, slots, gate = _suffix_attention_inputs(dtype, seed=17)
    B, Hq, T, D = q.shape
    got = sa.suffix_attention(q, k, v, bank_k, bank_v, lengths, slots, gate, 0.2)
    want = _suffix_attention_reference(*(t.cpu() for t in (q, k, v, bank_k, bank_v, lengths, slots, gate)), 0.2)
    assert got.shape == (B, T, Hq * D)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu(), want, atol=tol, rtol=tol)
    alone = sa.suffix_attention(q[1:2], k[1:2], v[1:2], bank_k, bank_v, lengths, slots[1:2], gate[1:2], 0.2)
    assert torch.equal(alone, got[1:2])


@pytest.mark.parametrize("dtype", [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton 3.6's "
                 "interpreter multiplies bf16 tiles wrongly"))])
def test_answer_attention_is_the_suffix_attention_at_the_answer_rows(dtype):
    """The last layer's attention at the answer slots alone: each answer of row b (rows of different answer counts,
    one with none, the step's padding answers pointing at token 0) against bank entry slots[b]'s prefix keys and its
    own suffix keys up to its position, gated: the whole-row reference at those tokens, and zero at the padding. A
    row's answers get the same bits whatever rows share the launch."""
    from engine.kernels import suffix_attention as sa

    q_all, k, v, bank_k, bank_v, lengths, slots, gate_all = _suffix_attention_inputs(dtype, seed=23)
    B, Hq, T, D = q_all.shape
    positions = [[3, 40, 69], [], [0, 8, 64, 65, 66]]                        # row 1 has no answers
    per_row = 8
    tokens = [b * T + t for b, ts in enumerate(positions) for t in ts]
    rows = torch.zeros(B * per_row, dtype=torch.int64)                        # padding answers: token 0
    rows[:len(tokens)] = torch.tensor(tokens)
    counts = torch.tensor([len(ts) for ts in positions])
    starts = counts.cumsum(0) - counts
    q = q_all.permute(0, 2, 1, 3).reshape(B * T, Hq, D)[rows.to(DEV)]        # [S, Hq, D] at the answer rows
    gate = gate_all.reshape(B * T, Hq, D)[rows.to(DEV)]
    args = (bank_k, bank_v, lengths, slots, rows.to(DEV), starts.to(DEV), counts.to(DEV))
    got = sa.answer_attention(q, k, v, *args[:4], *args[4:], gate, 0.2)
    want = _suffix_attention_reference(*(t.cpu() for t in (q_all, k, v, bank_k, bank_v, lengths, slots, gate_all)),
                                       0.2).reshape(B * T, Hq * D)[rows[:len(tokens)]]
    assert got.shape == (B * per_row, Hq * D)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[:len(tokens)].cpu(), want, atol=tol, rtol=tol)
    assert not got[len(tokens):].any()
    # row 2 alone: its answers first, in a batch of one row
    alone_rows = rows[3:8] - 2 * T
    alone = sa.answer_attention(q[3:8], k[2:3], v[2:3], bank_k, bank_v, lengths, slots[2:3], alone_rows.to(DEV),
                                torch.zeros(1, dtype=torch.int64, device=DEV), counts[2:3].to(DEV), gate[3:8], 0.2)
    assert torch.equal(alone, got[3:8])


@pytest.mark.parametrize("launch", ["large", "small"])
def test_suffix_and_answer_attention_give_a_row_the_same_bits_in_any_batch(launch):
    """What the batch-invariant table relies on: at one launch configuration, a row's suffix attention and its
    answers' attention are the same bits alone (R = 1, T = its length) and placed among random neighbours (other
    prefixes of other lengths, other answer counts and positions, random padding) in batches of other sizes padded
    to other lengths; and they agree with the reference."""
    from engine.kernels import suffix_attention as sa

    from .attention_cases import Case, answer_args, probe_in_placements

    config = sa.CONFIG if launch == "large" else sa.SMALL_CONFIG
    case = Case((4, 2, 32), (80, 5, 33, 1), 80, torch.float32, DEV, seed=5)

    def attention(*args):
        return sa.suffix_attention(*args, configs=(config, None))

    rows = probe_in_placements(case, attention, sa.answer_attention, [(2, 37), (3, 45), (5, 70), (4, 64)], L=37,
                               slot=2, probe_answers=[3, 20, 36], per_row=4, scale=0.2)
    assert all(r["suffix_equal"] and r["answers_equal"] for r in rows), rows
    # and the kernels compute the attention: one placement against the reference
    import random
    batch = case.batch(case.row(30), 0, 3, 41, 1, random.Random(1))
    want = _suffix_attention_reference(*(t.cpu() for t in case.suffix_args(batch)), 0.2)
    torch.testing.assert_close(attention(*case.suffix_args(batch), 0.2).cpu(), want, atol=2e-5, rtol=2e-5)
    kw, _ = case.answers(batch, [0, 29], 4, 1, random.Random(2))
    got = sa.answer_attention(*answer_args(kw), 0.2)
    n = int(kw["counts"].sum())
    torch.testing.assert_close(got[:n].cpu(), want.reshape(-1, want.shape[-1])[kw["rows"][:n].cpu()], atol=2e-5,
                               rtol=2e-5)


def test_the_invariant_suffix_attention_takes_the_small_launch_only_where_it_gives_the_large_ones_bits(monkeypatch):
    """`InvariantSuffixAttention` runs `CONFIG` at every batch size unless the check on the device
    (`suffix_configs_agree`) shows a small launch giving its bits; then that one where the large launch gives too few
    programs, as the fast table does. Without heads (no check possible) the large launch always."""
    from engine.kernels import cuda_deterministic as bi
    from engine.kernels import suffix_attention as sa

    from .attention_cases import Case

    assert sa.InvariantSuffixAttention(None, torch.float32, DEV).small is None
    checked = []
    monkeypatch.setattr(sa, "suffix_configs_agree",
                        lambda heads, dtype, device, large, small: checked.append(small) or small == (64, 64, 4, 2))
    attention = sa.InvariantSuffixAttention((4, 2, 32), torch.float32, DEV)
    # then the D splits of the small launch that leave >= 16 of D's 32 columns (`test_attention_split.py`)
    assert checked == [*sa.SUFFIX_SMALL_CANDIDATES, (64, 64, 4, 2, 2)] and attention.small == (64, 64, 4, 2)
    assert attention.splits == () and attention.large == sa.CONFIG and "(64, 64, 4, 2)" in repr(attention)
    monkeypatch.setattr(sa, "suffix_configs_agree", lambda *a: False)
    attention = sa.InvariantSuffixAttention((4, 2, 32), torch.float32, DEV)
    assert attention.small is None and "always" in repr(attention)
    # its launch at one row is the large one, where the fast table's would be the small one
    launches = []
    monkeypatch.setattr(sa, "_suffix_attention_kernel", _LaunchSpy(sa._suffix_attention_kernel, launches))
    case = Case((4, 2, 32), (80, 5, 33, 1), 80, torch.float32, DEV, seed=7)
    import random
    args = case.suffix_args(case.batch(case.row(9), 1, 1, 9, 0, random.Random(0)))
    attention(*args, 0.2)
    sa.suffix_attention(*args, 0.2)
    assert [bm for bm, _ in launches] == [sa.CONFIG[0], sa.SMALL_CONFIG[0]]


def test_suffix_configs_agree_compares_two_launches_on_the_device():
    """The load-time check runs (in the interpreter: numpy's tile products may or may not round alike, so only its
    type is asserted; on the GPU its answer is what the deterministic table logs), and refuses a key block that
    differs."""
    from engine.kernels import cuda_deterministic as bi
    from engine.kernels import suffix_attention as sa

    assert isinstance(sa.suffix_configs_agree((4, 2, 32), torch.float32, DEV, sa.CONFIG, sa.SMALL_CONFIG), bool)
    assert not sa.suffix_configs_agree((4, 2, 32), torch.float32, DEV, sa.CONFIG, (16, 32, 4, 2))


class _LaunchSpy:
    """A Triton kernel's `kernel[grid](...)`, recording each launch's (BM, grid) before running it."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((kwargs["BM"], grid))
            return self.kernel[grid](*args, **kwargs)
        return launch
