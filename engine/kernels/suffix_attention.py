"""A suffix pass's whole attention in one Triton kernel (CUDA): each row's queries against its own prefix's keys, read
from the prefix bank by slot, then against its own causal suffix keys, under one online softmax, with transformers'
sigmoid output gate applied before the store.

It replaces three launches of the split path (`engine.model.SuffixContext.attend`: the prefix half by
`engine.kernels.cuda_deterministic.indexed_attention`, the causal half by torch's flash op, their log-sum-exp merge and
the gate by `engine.kernels.fused.gate_attention`): neither half is written out and read back, and the G query heads of
a kv head share every key tile a program loads. One softmax over all the keys is also what transformers computes: the
split path rounds each half to the model's dtype before merging them.

A program takes BM query rows of one (row, kv head), ordered (position, query head of the group), so a block spans
BM / G consecutive positions and its causal bound is its last position. Keys are read in blocks of BN from the
first, whatever the batch, and the keys past a query's own position add exact zeros (a weight of exactly 0, the
running max and sum unchanged), so at one launch configuration a query's result depends on its own row alone: not on
the batch's size, the row's place in it, its neighbours (their prefixes, lengths, schemas) or the padded length T.
What can change it is the configuration: `suffix_attention` takes `SMALL_CONFIG` where `CONFIG` gives too few
programs, and another query-block height and warp count compile to another MMA instruction and register layout,
which may add a row's products, and its softmax sum, in another order. `answer_attention` has one configuration.
The batch-invariant table (`InvariantSuffixAttention`, below) takes the small launch only where the
device shows that it gives the large one's bits.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.kernels.pdl import await_previous_kernel, pdl_launch

CONFIG = (128, 64, 8, 2)
"""(query rows, keys, warps, stages) of a launch with enough programs to fill the GPU. Read at each call, so
`bench/probes/variant_ab.py` can time others in one process. On the H200 at 128 rows of 184 tokens after a 400-token
prefix (the 0.8B shape, `bench/probes/kernel_probe.py --only suffix`, CUDA-graph replays): 0.423 ms, against 0.535 ms
for the split path's three launches and 0.679 ms for 64 query rows; 128 rows x 64 keys x 3 stages needs more shared
memory than the H200 has."""
SMALL_CONFIG = (16, 64, 4, 2)
"""The launch where `CONFIG` would give fewer programs than `FILL_PROGRAMS` (batch 1: 2 kv heads x 6 blocks of 128
rows for 4 query heads x 184 positions, on 132 SMs). At batch 1 on the H200: 0.025 ms, against 0.064 ms split and
0.038 ms for `CONFIG`."""
FILL_PROGRAMS = 264

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton 3.6's interpreter cannot loop to a bound that is not a compile-time constant: interpreted, the loops run to
the bank's token capacity and the suffix length passed as constants instead, the keys past the real bounds masked
(they add exact zeros: the same result). Compiled, neither is a constant (no compile per length)."""


@triton.jit(do_not_specialize=["T"])
def _suffix_attention_kernel(Q, K, V, KP, VP, PLENS, SLOTS, GATE, Y, T,
                             sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                             skp_s, skp_h, skp_n, svp_s, svp_h, svp_n, g_token, g_head, scale,
                             G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                             PRECISION: tl.constexpr, KEY_CAP: tl.constexpr, T_CAP: tl.constexpr,
                             PDL: tl.constexpr = False, DSPLIT: tl.constexpr = 1):
    await_previous_kernel(PDL)
    b = tl.program_id(2).to(tl.int64)
    kvh = tl.program_id(1)
    block = tl.program_id(0) // DSPLIT               # DSPLIT programs per query block, one per D / DSPLIT columns
    m = block * BM + tl.arange(0, BM)
    t = m // G                                       # each query row's position, and its query head
    h = kvh * G + m % G
    row_ok = t < T
    d = tl.arange(0, D)
    dv = (tl.program_id(0) % DSPLIT) * (D // DSPLIT) + tl.arange(0, D // DSPLIT)      # this program's output columns
    q = tl.load(Q + b * sq_b + (h * sq_h + t.to(tl.int64) * sq_t)[:, None] + d[None, :], mask=row_ok[:, None],
                other=0.0)
    qk_scale = scale * 1.4426950408889634           # exp2 instead of exp
    m_i = tl.full((BM,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, D // DSPLIT), dtype=tl.float32)

    # the prefix's keys, from the bank entry of this row's slot, up to the prefix's length; then the suffix's own
    # keys, causal: up to the last position of this block
    slot = tl.load(SLOTS + b).to(tl.int64)
    n_prefix = tl.load(PLENS + slot)
    m_i, l_i, acc = _attend_keys(q, KP + slot * skp_s + kvh * skp_h, VP + slot * svp_s + kvh * svp_h, n_prefix, t, d,
                                 dv, m_i, l_i, acc, qk_scale, skp_n, svp_n, BN, KEY_CAP, PRECISION, False)
    last = tl.minimum((block * BM + BM - 1) // G, T - 1)      # this block's last position
    m_i, l_i, acc = _attend_keys(q, K + b * sk_b + kvh * sk_h, V + b * sv_b + kvh * sv_h, last + 1, t, d, dv, m_i,
                                 l_i, acc, qk_scale, sk_t, sv_t, BN, T_CAP, PRECISION, True)

    # transformers: the attention output in the model's dtype, times sigmoid(gate) rounded to it
    ty = Y.dtype.element_ty
    o = (acc / l_i[:, None]).to(ty).to(tl.float32)
    token = b * T + t
    g = tl.load(GATE + (token * g_token + h * g_head)[:, None] + dv[None, :], mask=row_ok[:, None], other=0.0)
    y = o * tl.sigmoid(g.to(tl.float32)).to(ty).to(tl.float32)
    Hq = G * tl.num_programs(1)
    tl.store(Y + (token * Hq + h)[:, None] * D + dv[None, :], y.to(ty), mask=row_ok[:, None])


@triton.jit
def _attend_keys(q, keys, values, n_keys, t, d, dv, m_i, l_i, acc, qk_scale, k_stride, v_stride, BN: tl.constexpr,
                 CAP: tl.constexpr, PRECISION: tl.constexpr, CAUSAL: tl.constexpr):
    # the first n_keys keys at keys / values (a row's prefix in the bank, or its own suffix) in blocks of BN, into the
    # running softmax; CAUSAL: each query row sees the keys up to its own position t. CAP: the interpreter's bound.
    # The scores take every column d of q and k; the output (acc) only the value columns dv
    for start in range(0, CAP if CAP else n_keys, BN):
        n = start + tl.arange(0, BN)
        key_ok = n < n_keys
        k = tl.load(keys + n[None, :].to(tl.int64) * k_stride + d[:, None], mask=key_ok[None, :], other=0.0)
        v = tl.load(values + n[:, None].to(tl.int64) * v_stride + dv[None, :], mask=key_ok[:, None], other=0.0)
        keep = n[None, :] <= t[:, None] if CAUSAL else key_ok[None, :]
        m_i, l_i, acc = _online_softmax_step(q, k, v, keep, m_i, l_i, acc, qk_scale, PRECISION)
    return m_i, l_i, acc


@triton.jit
def _online_softmax_step(q, k, v, keep, m_i, l_i, acc, qk_scale, PRECISION: tl.constexpr):
    # one key block into the running max, sum and output; masked keys add exact zeros (the max is never -inf after
    # the first block: a prefix has a first key, and position 0 of the suffix is every row's)
    s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


def suffix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bank_k: torch.Tensor, bank_v: torch.Tensor,
                     key_lengths: torch.Tensor, slots: torch.Tensor, gate: torch.Tensor, scale: float,
                     configs: tuple[tuple[int, ...], tuple[int, ...] | None] | None = None,
                     fill: int | None = None) -> torch.Tensor:
    """q [B, Hq, T, D], k, v [B, Hkv, T, D] (the suffix's, after RoPE; any strides with the last dimension
    contiguous), bank_k, bank_v [S, Hkv, N, D] (the prefix bank's), key_lengths [S] int32 (each entry's prefix
    length), slots [B] int64 (row b continues entry slots[b]), gate [B, T, Hq, D] (a strided view) -> the gated
    attention output [B, T, Hq * D]: `Kernels.suffix_attention`. configs: (large, small) launches instead of
    (`CONFIG`, `SMALL_CONFIG`), the small one where the large one gives fewer programs than `fill` (default
    `FILL_PROGRAMS`); small None: the large one at every size."""
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    if any(t.stride(-1) != 1 for t in (q, k, v, bank_k, bank_v, gate)):
        raise ValueError("suffix_attention: the last dimension of every input must be contiguous")
    if gate.stride(0) != T * gate.stride(1):
        gate = gate.contiguous()                       # rows are addressed by token (b * T + t): one stride
    out = torch.empty(B, T, Hq * D, dtype=q.dtype, device=q.device)
    if B * T == 0:
        return out
    large, small = configs or (CONFIG, SMALL_CONFIG)
    BM, BN, warps, stages, split = launch(large, D)
    if small is not None and triton.cdiv(G * T, BM) * Hkv * split * B < (FILL_PROGRAMS if fill is None else fill):
        BM, BN, warps, stages, split = launch(small, D)
    grid = (triton.cdiv(G * T, BM) * split, Hkv, B)
    _suffix_attention_kernel[grid](
        q, k, v, bank_k, bank_v, key_lengths, slots, gate, out, T, *q.stride()[:3],
        *k.stride()[:3], *v.stride()[:3], *bank_k.stride()[:3], *bank_v.stride()[:3], gate.stride(1),
        gate.stride(2), scale, G=G, D=D, BM=BM, BN=BN, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        KEY_CAP=bank_k.shape[2] if _INTERPRETED else 0, T_CAP=T if _INTERPRETED else 0, DSPLIT=split,
        num_warps=warps, num_stages=stages, **pdl_launch())
    return out


def launch(config: tuple[int, ...], D: int | None = None) -> tuple[int, int, int, int, int]:
    """A launch (query rows, keys, warps, stages[, D split]) -> all five, the D split 1 where it is not given; with
    the head dim D, checked to leave a program a power of 2 of at least 16 columns.

    The D split: D / split output columns a program, so split programs per query block. Each computes the block's
    scores from all D columns of q and k (the same tile and instruction as without the split) and accumulates only
    its columns of the values: a query's scores, softmax and output columns are summed as without it, by MMAs of a
    narrower output (on the H200, the matmul's 64- and 256-wide tiles gave the same bits: `kernels/test_small_tile.py`).
    More programs for few rows, and a quarter of the accumulator's registers at split 4: the 64-row launch at split 1
    holds 255 registers a thread and spills (ptxas for sm_90a: `bench/probes/kernel_registers.py`)."""
    BM, BN, warps, stages, *rest = config
    split = rest[0] if rest else 1
    if split not in (1, 2, 4, 8) or (D is not None and (D % (16 * split) or D & (D - 1))):
        raise ValueError(f"attention launch {config}: a D split of 1, 2, 4 or 8 leaving >= 16 columns of D={D}")
    return BM, BN, warps, stages, split


def fitted(config: tuple[int, ...], D: int) -> tuple[int, int, int, int, int]:
    """`launch(config, D)` with its D split halved until a program keeps at least 16 columns of D: a model of small
    heads (the tests' tiny ones, D 32) takes the answers' launch at split 2 where the 0.8B shape (D 256) takes 4. One
    model's D is fixed, so every batch still gets the same launch."""
    BM, BN, warps, stages, split = launch(config)
    while split > 1 and D % (16 * split):
        split //= 2
    return launch((BM, BN, warps, stages, split), D)


ANSWER_CONFIG = (64, 64, 4, 2, 4)
"""`answer_attention`'s launch: (query rows, keys, warps, stages). A program takes one row's answer queries (up to BM /
G answers of one kv head's G query heads), so at the 0.8B shape (G = 4, 10 questions) one program holds a row's
answers. One launch at every batch size: answer j of a row is query row j * G + (its head in the group) of the row's
own programs, whatever the answers of the rows before it, its keys are read in blocks of BN from the first, and the
keys past its position add exact zeros, so an answer's result does not depend on the batch (the batch-invariant table
takes it as it is). A fifth element is a D split (`launch`): the same launch at every size too, so as invariant; at
batch 1 it gives the row's 2 programs 2 x split (51 us of the step at split 1 in run CI). Read at each call, for
`bench/probes/variant_ab.py`."""


@triton.jit(do_not_specialize=["T"])
def _answer_attention_kernel(Q, K, V, KP, VP, PLENS, SLOTS, ROWS, STARTS, COUNTS, GATE, Y, T,
                             sq_s, sq_h, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, skp_s, skp_h, skp_n, svp_s, svp_h,
                             svp_n, g_s, g_h, scale, G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                             BN: tl.constexpr, PRECISION: tl.constexpr, KEY_CAP: tl.constexpr, T_CAP: tl.constexpr,
                             DSPLIT: tl.constexpr = 1):
    b = tl.program_id(2).to(tl.int64)
    kvh = tl.program_id(1)
    block = tl.program_id(0) // DSPLIT               # as `_suffix_attention_kernel`
    m = block * BM + tl.arange(0, BM)
    j = m // G                                      # each query row's answer (of row b's), and its query head
    h = kvh * G + m % G
    count = tl.load(COUNTS + b)
    ok = j < count
    s = tl.load(STARTS + b) + j                     # the answer's index among the step's answer rows
    t = tl.load(ROWS + s, mask=ok, other=0) - b * T      # its position in row b's suffix
    t = tl.where(ok, t, 0)
    d = tl.arange(0, D)
    dv = (tl.program_id(0) % DSPLIT) * (D // DSPLIT) + tl.arange(0, D // DSPLIT)
    q = tl.load(Q + (s * sq_s + h * sq_h)[:, None] + d[None, :], mask=ok[:, None], other=0.0)
    qk_scale = scale * 1.4426950408889634
    m_i = tl.full((BM,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, D // DSPLIT), dtype=tl.float32)

    # as `_suffix_attention_kernel`: the prefix's keys from the bank entry of row b's slot, then the suffix's own keys
    # up to the block's last answer, each query masked at its own position; a row with no answers here reads none
    slot = tl.load(SLOTS + b).to(tl.int64)
    n_prefix = tl.where(block * BM < count * G, tl.load(PLENS + slot), 0)
    m_i, l_i, acc = _attend_keys(q, KP + slot * skp_s + kvh * skp_h, VP + slot * svp_s + kvh * svp_h, n_prefix, t, d,
                                 dv, m_i, l_i, acc, qk_scale, skp_n, svp_n, BN, KEY_CAP, PRECISION, False)
    last = tl.max(tl.where(ok, t, -1), 0)
    m_i, l_i, acc = _attend_keys(q, K + b * sk_b + kvh * sk_h, V + b * sv_b + kvh * sv_h, last + 1, t, d, dv, m_i,
                                 l_i, acc, qk_scale, sk_t, sv_t, BN, T_CAP, PRECISION, True)

    ty = Y.dtype.element_ty
    o = (acc / l_i[:, None]).to(ty).to(tl.float32)
    g = tl.load(GATE + (s * g_s + h * g_h)[:, None] + dv[None, :], mask=ok[:, None], other=0.0)
    y = o * tl.sigmoid(g.to(tl.float32)).to(ty).to(tl.float32)
    Hq = G * tl.num_programs(1)
    tl.store(Y + (s * Hq + h)[:, None] * D + dv[None, :], y.to(ty), mask=ok[:, None])


def answer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bank_k: torch.Tensor, bank_v: torch.Tensor,
                     key_lengths: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
                     counts: torch.Tensor, gate: torch.Tensor, scale: float) -> torch.Tensor:
    """`suffix_attention` for the answer slots' queries alone, as the last layer needs them (no later layer reads
    another token): q [S, Hq, D] at the S answer rows, rows [S] int64 their tokens (b * T + t) in the batch of k, v
    [B, Hkv, T, D]; row b's answers are rows[starts[b]:starts[b] + counts[b]] ([B] int64 each: consecutive, at most
    S / B of them); gate [S, Hq, D] -> [S, Hq * D], zero at the rows that are no row's answers (a step's padding). Each
    answer reads its row's prefix keys (bank entry slots[b]) and its suffix keys up to its own position: the 10 answers
    of a 184-token row read its keys once, where the whole-row kernel reads them for 184 queries."""
    S, Hq, D = q.shape
    B, Hkv, T, _ = k.shape
    G = Hq // Hkv
    if any(x.stride(-1) != 1 for x in (q, k, v, bank_k, bank_v, gate)):
        raise ValueError("answer_attention: the last dimension of every input must be contiguous")
    out = torch.zeros(S, Hq * D, dtype=q.dtype, device=q.device)
    if S == 0 or B == 0:
        return out
    BM, BN, warps, stages, split = fitted(ANSWER_CONFIG, D)
    grid = (triton.cdiv(G * triton.cdiv(S, B), BM) * split, Hkv, B)
    _answer_attention_kernel[grid](
        q, k, v, bank_k, bank_v, key_lengths, slots, rows, starts, counts, gate, out, T, q.stride(0), q.stride(1),
        *k.stride()[:3], *v.stride()[:3], *bank_k.stride()[:3], *bank_v.stride()[:3], gate.stride(0), gate.stride(1),
        scale, G=G, D=D, BM=BM, BN=BN, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        KEY_CAP=bank_k.shape[2] if _INTERPRETED else 0, T_CAP=T if _INTERPRETED else 0, DSPLIT=split,
        num_warps=warps, num_stages=stages)
    return out


# ---- the batch-invariant table's launches -------------------------------------------------------------------------
SUFFIX_SMALL_CANDIDATES = ((16, 64, 4, 2), (64, 64, 4, 2))
"""Launches `InvariantSuffixAttention` may take where the large one gives too few programs, in order of preference:
`engine.kernels.suffix_attention.SMALL_CONFIG` (the fast table's, 0.025 against 0.038 ms at batch 1 on the H200),
then a 64-row block (one warp group: the MMA instruction of the large launch's 64-row halves)."""


def suffix_configs_agree(heads: tuple[int, int, int], dtype: torch.dtype, device, large, small, seed: int = 0) -> bool:
    """Whether `engine.kernels.suffix_attention.suffix_attention` gives every query the same bits at the `small` launch
    as at the `large` one, for random inputs at the model's head shape (heads: (query heads, kv heads, head dim)):
    rows of two suffix lengths after prefixes of unequal lengths, keys crossing the prefix's end and the causal
    diagonal.
    A row's keys are read in the same blocks at both; whether the MMA instruction and register layout each block
    height and warp count compile to add a row's products and its softmax sum in the same order is the hardware's,
    so it is checked on the device, as `cuda_deterministic.small_tile_is_identical` checks the matmul's tiles."""
    if large[1] != small[1]:
        return False                          # another key block: another summation order by construction
    Hq, Hkv, D = heads
    gen = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, device=device, generator=gen).to(dtype)  # noqa: E731
    lengths = torch.tensor([400, 37, 129], dtype=torch.int32, device=device)
    bank_k, bank_v = rnd(3, Hkv, 512, D), rnd(3, Hkv, 512, D)
    for B, T in ((2, 184), (3, 56)):
        q, k, v, gate = rnd(B, Hq, T, D), rnd(B, Hkv, T, D), rnd(B, Hkv, T, D), rnd(B, T, Hq, D)
        slots = torch.arange(B, device=device) % 3
        args = (q, k, v, bank_k, bank_v, lengths, slots, gate, D ** -0.5)
        try:
            same = torch.equal(suffix_attention(*args, configs=(large, None)),
                               suffix_attention(*args, configs=(small, None)))
        except triton.runtime.errors.OutOfResources:              # a launch this device cannot hold is no candidate
            return False
        if not same:
            return False
    return True


SUFFIX_SPLITS = (2, 4)
"""D splits (`launch`) of the chosen small launch that `InvariantSuffixAttention` checks at load against the large
launch; `D_SPLIT` picks among those that agree."""

D_SPLIT = 4
"""The largest D split the batch-invariant table's small launch may run at (1: none), among those the load-time check
showed giving the large launch's bits; a call takes the largest of them that keeps the launch within
`SPLIT_FILL_PROGRAMS` programs, else none. Read at each call, so a CUDA graph keeps the setting it was captured under
and `bench/probes/variant_ab.py` can time splits in one process. 1 until the H200 shows a split paying: at batch 1
the 64-row launch runs 24 programs (45 us a layer, run CI) at 255 registers a thread with spills; split 4 runs 96 at
183 registers without (`bench/probes/kernel_registers.py`)."""

SPLIT_FILL_PROGRAMS = 132
"""A D split only while the split launch's programs fit one an SM of the H200's 132: a split adds no work per
program where the launch is short of programs (batch 1: 24) but repeats the score's MMAs split times, so at batch 8
(184 programs unsplit) it would only add waves. Read at each call, like `D_SPLIT`."""


INVARIANT_FILL_PROGRAMS: int | None = 96
"""The batch-invariant table's `fill` (None: `FILL_PROGRAMS`, as the fast table's): below it the small launch. Read at
each call, like `D_SPLIT`. At batch 8 the 64-row launch runs 184 programs, a wave and a half of the H200's SMs (81 us a
layer, run CI); 96 would give batch 8 the large launch's 96 programs instead (38 us a layer at batch 1 with 12)."""


class InvariantSuffixAttention:
    """`Kernels.suffix_attention` whose result for a row does not depend on the batch: this module's kernel, which
    computes a query from its own row alone at any one launch configuration, with the large launch (`CONFIG`) at every
    size, and the small one where the large gives too few programs (batch 1 to ~20 at the 0.8B shape) only where
    `suffix_configs_agree` holds on the device for one of `SUFFIX_SMALL_CANDIDATES`, at a D split up to `D_SPLIT`
    where that split of it agrees too (`splits`: those of `SUFFIX_SPLITS` that do; every launch taken gives a row the
    same bits, so which one a batch's size picks changes none). The launches are checked at construction: a later
    change of the module's candidates does not reach this table."""

    def __init__(self, heads: tuple[int, int, int] | None, dtype: torch.dtype, device):
        self.large = CONFIG
        self.small = None
        self.splits: tuple[int, ...] = ()
        self.head_dim = heads[2] if heads is not None else None
        if heads is not None:
            self.small = next((c for c in SUFFIX_SMALL_CANDIDATES
                               if suffix_configs_agree(heads, dtype, device, self.large, c)), None)
        if self.small is not None and heads is not None and heads[2] > 16:
            self.splits = tuple(n for n in SUFFIX_SPLITS if launch(self.small)[4] == 1 and heads[2] % (16 * n) == 0
                                and suffix_configs_agree(heads, dtype, device, self.large, (*self.small[:4], n)))

    def small_launch(self, programs: int) -> tuple[int, ...] | None:
        """The small launch for a call whose small launch unsplit starts `programs` programs: at the largest checked
        split up to `D_SPLIT` that keeps them within `SPLIT_FILL_PROGRAMS`, else as checked."""
        split = max((n for n in self.splits if n <= D_SPLIT and programs * n <= SPLIT_FILL_PROGRAMS), default=1)
        return self.small if split == 1 else (*self.small[:4], split)

    def __call__(self, q, k, v, bank_k, bank_v, key_lengths, slots, gate, scale):
        small = self.small
        if small is not None and self.splits:
            B, Hq, T, _ = q.shape
            small = self.small_launch(triton.cdiv(Hq // k.shape[1] * T, small[0]) * k.shape[1] * B)
        return suffix_attention(q, k, v, bank_k, bank_v, key_lengths, slots, gate, scale, configs=(self.large, small),
                                fill=INVARIANT_FILL_PROGRAMS)

    def __repr__(self) -> str:
        # part of the table's name, and so of the scoring fingerprint: another launch, another kernel
        split = max((n for n in self.splits if n <= D_SPLIT), default=1)
        small = f", {self.small} below the fill" if self.small else " always"
        if split > 1:
            small += f" (D split up to {split} within {SPLIT_FILL_PROGRAMS} programs)"
        answers = fitted(ANSWER_CONFIG, self.head_dim) if self.head_dim else launch(ANSWER_CONFIG)
        answers = f"; answers {answers}" if answers[4] > 1 else ""
        return f"suffix attention {self.large}{small}{answers}"
