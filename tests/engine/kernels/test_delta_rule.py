"""The suffix pass's delta rule: engine.kernels.indexed_delta_rule (the state and output kernels reading prefix states
by index), engine.kernels.delta_rule_inputs (decay, beta and the WY matrix in fewer launches) and
engine.kernels.cuda_fast around them (fla's forward, its fixed and pinned launches), against fla and PyTorch references.
Runs on the GPU, or on a CPU through Triton's interpreter (`tests/engine/kernels/test_fused.py` says how)."""

import pytest
import torch

from tests.engine.kernels.triton_device import require, same_across_tiles

ON_GPU, DEV = require()

pytestmark = pytest.mark.gpu


def _chunk_states_reference(k, w, u, g, bank, index, chunk):
    """fla's chunked state recurrence written out in PyTorch, one (row, value head) at a time, with its roundings:
    the state stored per chunk and multiplied in k's dtype, the new values rounded before the state update."""
    B, T, H, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    NT = -(-T // chunk)
    h = torch.empty(B, NT, HV, K, V, dtype=k.dtype)
    v_new = torch.empty(B, T, HV, V, dtype=u.dtype)
    for b in range(B):
        for hv in range(HV):
            state = bank[index[b], hv].float().clone()
            kh = k[b, :, hv // (HV // H)]
            for c in range(NT):
                t = slice(c * chunk, min((c + 1) * chunk, T))
                h[b, c, hv] = state.to(k.dtype)
                nv = u[b, t, hv].float() - w[b, t, hv].float() @ state.to(k.dtype).float()
                v_new[b, t, hv] = nv.to(u.dtype)
                g_c = g[b, t, hv].float()
                g_last = g_c[-1]
                scaled = (nv * torch.exp2(g_last - g_c)[:, None]).to(k.dtype).float()
                state = state * torch.exp2(g_last) + kh[t].float().T @ scaled
    return h, v_new


def _wy_inputs(B, K, dtype, seed, T=70, H=2, HV=4, V=64, S=4):
    """Random inputs of the delta rule's state kernel, on the CPU: q, k [B, T, H, K] (L2-normalised), the WY
    representation w [B, T, HV, K] and u [B, T, HV, V], the chunked log2 decay [B, T, HV] (a cumulative sum of
    negative steps restarting every chunk; T = 70: a last chunk cut short) and a bank of S float32 states."""
    from engine.kernels.indexed_delta_rule import CHUNK

    g = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1).to(dtype) for _ in range(2))
    w = (torch.randn(B, T, HV, K, generator=g) * 0.1).to(dtype)
    u = torch.randn(B, T, HV, V, generator=g).to(dtype)
    steps = -torch.rand(B, T, HV, generator=g) * 0.3
    decay = torch.cat([c.cumsum(1) for c in steps.split(CHUNK, dim=1)], dim=1)
    return q, k, w, u, decay, torch.randn(S, HV, K, V, generator=g) * 0.5


@pytest.mark.parametrize("dtype", [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton 3.6's "
                 "interpreter multiplies bf16 tiles wrongly (tl.dot of two bf16 16 x 16 tiles is off by 3e10)"))])
@pytest.mark.parametrize("K", [16, 64, 128])
def test_chunk_states_indexed_starts_each_row_from_its_bank_entry(K, dtype):
    """The delta rule's state kernel for a suffix pass: row b starts from prefix bank entry index[b], read in place
    (rows sharing an entry, entries no row reads), grouped value heads, a last chunk cut short; against the
    recurrence in PyTorch, and bit for bit against the same kernel given each row's state copied out."""
    from engine.kernels.indexed_delta_rule import CHUNK, chunk_states_indexed

    B = 3
    _, k, w, u, decay, bank = _wy_inputs(B, K, dtype, seed=11)
    index = torch.tensor([2, 0, 2])
    on = lambda *ts: [t.to(DEV) for t in ts]  # noqa: E731
    h, v_new = chunk_states_indexed(*on(k, w, u, decay, bank, index))
    want_h, want_v = _chunk_states_reference(k, w, u, decay, bank, index, CHUNK)
    torch.testing.assert_close(h.cpu().float(), want_h.float(), atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(v_new.cpu().float(), want_v.float(), atol=3e-2, rtol=2e-2)
    copied = chunk_states_indexed(*on(k, w, u, decay, bank[index].contiguous(), torch.arange(B)))
    assert torch.equal(copied[0], h) and torch.equal(copied[1], v_new)
    # the launch configuration (fla autotunes it) does not change how a column is summed: the same bits
    for config in ((32, 2, 2), (64, 2, 2), (32, 4, 2), (16, 2, 2)):
        other = chunk_states_indexed(*on(k, w, u, decay, bank, index), config=config)
        assert same_across_tiles(other[0], h) and same_across_tiles(other[1], v_new), config


def test_delta_rule_indexed_is_flas_delta_rule_from_the_copied_states(monkeypatch):
    """The suffix pass's delta rule (fla's forward with the indexed state kernel) against fla's
    `chunk_gated_delta_rule` given the per-row copies of the bank's states it avoids."""
    pytest.importorskip("fla")
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from engine.kernels import cuda_fast

    g = torch.Generator().manual_seed(12)
    B, T, H, HV, K, V, S = 5, 184, 16, 16, 128, 128, 3
    dtype = torch.bfloat16
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1).to(DEV, dtype)
            for _ in range(2))
    v = torch.randn(B, T, HV, V, generator=g).to(DEV, dtype)
    a, b = (torch.randn(B, T, HV, generator=g).to(DEV, dtype) for _ in range(2))
    A_log = torch.randn(HV, generator=g).to(DEV)
    dt_bias = torch.randn(HV, generator=g).to(DEV)
    bank = (torch.randn(S, HV, K, V, generator=g) * 0.5).to(DEV)
    index = torch.tensor([1, 1, 0, 2, 1], device=DEV)

    want, _ = chunk_gated_delta_rule(q, k, v, g=a, beta=b, initial_state=bank[index], output_final_state=False,
                                     use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                     use_beta_sigmoid_in_kernel=True)

    def indexed(fused_output, wy_launch):
        monkeypatch.setattr(cuda_fast, "FUSED_OUTPUT", fused_output)
        monkeypatch.setattr(cuda_fast, "WY_LAUNCH", wy_launch)
        return cuda_fast.delta_rule_indexed(q, k, v, a, b, A_log, dt_bias, bank, index)

    # fla's WY kernels through its entry point and its output kernel: the same arithmetic in the same order as fla's
    # whole forward, at whatever launches its autotuners hold (the state kernel's launch does not change a column's
    # sums), so the same bits
    got = indexed(False, None)
    assert torch.equal(got, want), f"max |diff| {(got.float() - want.float()).abs().max().item():.3g}"
    # fused, the output's sums over the key dimension run in 64-wide steps (fla's output kernel may take 128 at once);
    # the fixed WY launches may split K K^T's sums otherwise than the launch fla's autotuner holds
    for name, fused_output, wy_launch in (("fused", True, None), ("fixed WY", False, cuda_fast.WY_LAUNCH),
                                          ("as run", True, cuda_fast.WY_LAUNCH)):
        other = indexed(fused_output, wy_launch)
        print(f"{name} against fla: max |diff| {(other.float() - want.float()).abs().max():.3g}")
        torch.testing.assert_close(other.float(), want.float(), atol=2e-2, rtol=2e-2)
    # the small grid's solve and w/u in one launch (240 solve programs here): the bits of the two kernels
    as_run = indexed(True, cuda_fast.WY_LAUNCH)
    monkeypatch.setattr(cuda_fast, "FUSED_WY_SMALL_LAUNCH", (64, 2, 4))
    assert torch.equal(indexed(True, cuda_fast.WY_LAUNCH), as_run)


def test_decay_and_beta_are_flas_gate_cumsum_and_sigmoid_in_one_kernel():
    """`decay.decay_and_beta` against the formulas (a last chunk cut short, several heads and rows), read from a and b
    contiguous or as views of one projection (the same bits), and on a GPU with fla bit for bit against fla's two
    kernels it replaces."""
    from engine.kernels.decay import decay_and_beta

    g = torch.Generator().manual_seed(21)
    B, T, H, chunk, scale = 2, 150, 3, 64, 1.4426950408889634
    a, b = (torch.randn(B, T, H, generator=g).to(torch.bfloat16) for _ in range(2))
    A_log, dt_bias = torch.randn(H, generator=g), torch.randn(H, generator=g)
    decay, beta = decay_and_beta(a.to(DEV), b.to(DEV), A_log.to(DEV), dt_bias.to(DEV), chunk, scale)
    assert decay.dtype == beta.dtype == torch.float32
    gate = -A_log.exp() * torch.nn.functional.softplus(a.float() + dt_bias)
    want = torch.cat([c.cumsum(1) for c in gate.split(chunk, dim=1)], dim=1) * scale
    torch.testing.assert_close(decay.cpu(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(beta.cpu(), b.float().sigmoid(), atol=1e-6, rtol=1e-6)
    projection = torch.cat([torch.randn(B, T, 5, generator=g).to(torch.bfloat16), b, a], dim=-1).to(DEV)
    strided = decay_and_beta(projection[..., 5 + H:], projection[..., 5:5 + H], A_log.to(DEV), dt_bias.to(DEV), chunk,
                             scale)
    assert torch.equal(strided[0], decay) and torch.equal(strided[1], beta)
    with pytest.raises(ValueError, match="one layout"):
        decay_and_beta(projection[..., 5 + H:], b.to(DEV), A_log.to(DEV), dt_bias.to(DEV), chunk, scale)
    if torch.cuda.is_available() and _has_fla():
        from fla.ops.common.gate import fused_beta_sigmoid
        from fla.ops.gated_delta_rule.gate import gdn_gate_chunk_cumsum
        from engine.kernels.table import fla_kernels
        fla_kernels()           # fla's gate kernel pinned to its first launch, as the engine runs it
        on = lambda t: t.to(DEV)  # noqa: E731
        assert torch.equal(decay, gdn_gate_chunk_cumsum(g=on(a), A_log=on(A_log), chunk_size=chunk, scale=scale,
                                                        dt_bias=on(dt_bias)))
        assert torch.equal(beta, fused_beta_sigmoid(on(b)))


@pytest.mark.parametrize("T", [100, 40], ids=["chunk-cut-short", "one-short-chunk"])
def test_merged_solve_inverts_each_chunks_decayed_kkt(T):
    """`delta_rule_inputs.solve_into` (fla's fused K K^T + solve, its four substitutions in one loop) against the
    inverse computed in PyTorch, chunk by chunk, grouped value heads, the last chunk cut short (40 tokens: the fourth
    diagonal block has no token at all); on a GPU with fla, bit for bit against fla's kernel at the same launches."""
    from engine.kernels.delta_rule_inputs import solve_into

    g = torch.Generator().manual_seed(23)
    B, H, HV, K, chunk = 2, 2, 4, 128, 64
    dtype = torch.float32 if not torch.cuda.is_available() else torch.bfloat16
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    beta, decay = torch.rand(B, T, HV, generator=g), -torch.rand(B, T, HV, generator=g).cumsum(1) * 0.1
    A = torch.zeros(B, T, HV, chunk, device=DEV, dtype=dtype)
    solve_into(A, k.to(DEV, dtype), decay.to(DEV), beta.to(DEV), chunk, (64, 2))
    kv = k.to(dtype).float().repeat_interleave(HV // H, dim=2)
    for start in range(0, T, chunk):
        c = slice(start, min(start + chunk, T))
        n = c.stop - start
        kc = kv[:, c].permute(0, 2, 1, 3)                                   # [B, HV, n, K]
        gc = decay[:, c].permute(0, 2, 1)                                   # [B, HV, n]
        a = (kc @ kc.transpose(-1, -2)) * torch.exp2(gc[..., :, None] - gc[..., None, :])
        a = a.tril(-1) * beta[:, c].permute(0, 2, 1)[..., :, None]
        want = torch.linalg.inv(torch.eye(n) + a)
        got = A[:, c, :, :n].permute(0, 2, 1, 3).cpu().float().tril()
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    if torch.cuda.is_available() and _has_fla():
        from engine.kernels import cuda_fast
        for launch in (cuda_fast.WY_LAUNCH[0], cuda_fast.WY_SMALL_LAUNCH[0]):
            ours, theirs = torch.zeros_like(A), torch.zeros_like(A)
            solve_into(ours, k.to(DEV, dtype), decay.to(DEV), beta.to(DEV), chunk, launch)
            cuda_fast.solve_into(theirs, k.to(DEV, dtype), decay.to(DEV), beta.to(DEV), launch)
            assert torch.equal(ours, theirs), launch


def _has_fla() -> bool:
    try:
        import fla  # noqa: F401
    except ImportError:
        return False
    return True


def test_w_u_reads_only_the_lower_triangle_of_the_solved_matrix():
    """`delta_rule_inputs.w_u_into` with NaN above each chunk's diagonal of A (memory the solve never writes) gives
    w and u of the lower triangle (grouped value heads, a last chunk cut short); on a GPU with fla, the bits of fla's
    w/u kernel given the zero-filled A at the same launch."""
    from engine.kernels.delta_rule_inputs import w_u_into

    g = torch.Generator().manual_seed(22)
    B, T, H, HV, K, V, chunk = 2, 100, 2, 4, 32, 16, 64
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    v = torch.randn(B, T, HV, V, generator=g)
    beta, decay = torch.rand(B, T, HV, generator=g), -torch.rand(B, T, HV, generator=g).cumsum(1) * 0.1
    lower = torch.randn(B, T, HV, chunk, generator=g) * 0.1
    rows = torch.arange(T) % chunk                                   # a token's row inside its chunk
    above = torch.arange(chunk)[None, :] > rows[:, None]             # [T, chunk]
    A = lower.masked_fill(above[None, :, None, :], float("nan"))
    zeroed = lower.masked_fill(above[None, :, None, :], 0.0)
    dtype = torch.float32 if not torch.cuda.is_available() else torch.bfloat16
    on = lambda *ts: [t.to(DEV, dtype) for t in ts]  # noqa: E731
    k_, v_, A_, zeroed_ = on(k, v, A, zeroed)
    beta_, decay_ = beta.to(DEV), decay.to(DEV)
    w, u = torch.empty(B, T, HV, K, device=DEV, dtype=dtype), torch.empty(B, T, HV, V, device=DEV, dtype=dtype)
    w_u_into(w, u, k_, v_, beta_, A_, decay_, chunk, (4, 3))
    kv = k.repeat_interleave(HV // H, dim=2)
    want_w, want_u = torch.empty(B, T, HV, K), torch.empty(B, T, HV, V)
    for start in range(0, T, chunk):
        c = slice(start, min(start + chunk, T))
        n = c.stop - start
        a_c = zeroed[:, c, :, :n].permute(0, 2, 1, 3)                 # [B, HV, n, n]
        bv = (v[:, c] * beta[:, c, :, None]).permute(0, 2, 1, 3)
        bk = (kv[:, c] * (beta[:, c] * torch.exp2(decay[:, c]))[..., None]).permute(0, 2, 1, 3)
        want_u[:, c] = (a_c @ bv).permute(0, 2, 1, 3)
        want_w[:, c] = (a_c @ bk).permute(0, 2, 1, 3)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(w.cpu().float(), want_w, atol=tol, rtol=tol)
    torch.testing.assert_close(u.cpu().float(), want_u, atol=tol, rtol=tol)
    if torch.cuda.is_available() and _has_fla():
        from engine.kernels import cuda_fast
        fla_w, fla_u = torch.empty_like(w), torch.empty_like(u)
        cuda_fast.w_u_into(fla_w, fla_u, k_, v_, beta_, zeroed_, decay_, (4, 3))
        assert torch.equal(w, fla_w) and torch.equal(u, fla_u)


def test_only_a_grid_of_few_programs_shares_each_chunks_w_and_u_among_programs(monkeypatch):
    from engine.kernels import delta_rule_inputs
    from engine.kernels.delta_rule_inputs import w_u_parts

    # batch 1 (48 programs of 184 tokens x 16 heads), 2 and 3 of the 0.8B model: only batch 1 is split
    assert [w_u_parts(programs, 4) for programs in (48, 63, 64, 96, 144)] == [4, 4, 1, 1, 1]
    assert w_u_parts(48, 3) == 1 and w_u_parts(48, 6) == 2      # parts divide the blocks
    monkeypatch.setattr(delta_rule_inputs, "W_U_SPLIT_BELOW", 0)
    assert w_u_parts(48, 4) == 1                                # 0 turns it off


@pytest.mark.parametrize("T", [184, 100, 40], ids=["three-chunks", "chunk-cut-short", "one-short-chunk"])
def test_solve_and_w_u_in_one_launch_give_the_two_kernels_bits(T):
    """`delta_rule_inputs.solve_w_u_into` (the solve and w/u as one program a chunk) against `solve_into` then
    `w_u_into` at the suffix pass's launches: the same w, u and lower triangle of A, bit for bit, at each of the one
    launch's configurations (grouped value heads; 40 tokens: the last diagonal blocks have no token)."""
    from engine.kernels.delta_rule_inputs import solve_into, solve_w_u_into, w_u_into

    g = torch.Generator().manual_seed(24)
    B, H, HV, K, V, chunk = 2, 2, 4, 128, 128, 64
    dtype = torch.float32 if not torch.cuda.is_available() else torch.bfloat16
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1).to(DEV, dtype)
    v = torch.randn(B, T, HV, V, generator=g).to(DEV, dtype)
    beta = torch.rand(B, T, HV, generator=g).to(DEV)
    decay = (-torch.rand(B, T, HV, generator=g).cumsum(1) * 0.05).to(DEV)
    lower = torch.arange(chunk, device=DEV)[None, :] <= (torch.arange(T, device=DEV) % chunk)[:, None]   # [T, chunk]
    A = torch.zeros(B, T, HV, chunk, device=DEV, dtype=dtype)
    solve_into(A, k, decay, beta, chunk, (64, 2))
    w, u = torch.empty(B, T, HV, K, device=DEV, dtype=dtype), torch.empty(B, T, HV, V, device=DEV, dtype=dtype)
    w_u_into(w, u, k, v, beta, A, decay, chunk, (2, 4))
    # BK as the solve's: it splits K K^T's sums; a chunk's w and u blocks shared among 2 or 4 programs, each solving
    # the chunk into its own scratch (4 column blocks here: 2 of w, 2 of u)
    for launch, parts in (((64, 2, 4), 1), ((64, 1, 3), 1), ((64, 4, 3), 1), ((64, 2, 4), 2), ((64, 2, 4), 4)):
        A1 = torch.full((parts * B, *A.shape[1:]), float("nan"), device=DEV, dtype=dtype)   # above the diagonal the
        w1, u1 = torch.full_like(w, float("nan")), torch.full_like(u, float("nan"))       # launch leaves A as it was
        solve_w_u_into(w1, u1, A1, k, v, decay, beta, chunk, launch, parts)
        assert torch.equal(w1, w) and torch.equal(u1, u), (launch, parts)
        for A_part in A1.split(B):
            assert torch.equal(A_part.masked_fill(~lower[None, :, None, :], 0), A.masked_fill(~lower[None, :, None, :], 0))
    with pytest.raises(ValueError, match="3 parts of 4 column blocks"):
        solve_w_u_into(w1, u1, torch.empty(3 * B, *A.shape[1:], device=DEV, dtype=dtype), k, v, decay, beta, chunk,
                       (64, 2, 4), 3)


@pytest.mark.parametrize("rows", [1, 8], ids=["small-grid", "large-grid"])
def test_fixed_wy_launches_give_flas_w_and_u(rows):
    """`cuda_fast.WY_LAUNCH` / `WY_SMALL_LAUNCH` (batch 1 starts 48 solve programs, batch 8 384) against fla's
    `chunk_gated_delta_rule_fwd_intra` (autotuned, or pinned if an engine was built); and the same bits from one call
    to the next."""
    pytest.importorskip("fla")
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.gated_delta_rule.gate import gdn_gate_chunk_cumsum
    from fla.ops.utils.constant import RCP_LN2

    from engine.kernels import cuda_fast

    g = torch.Generator().manual_seed(5)
    T, H, HV, K, V = 184, 16, 16, 128, 128
    k = torch.nn.functional.normalize(torch.randn(rows, T, H, K, generator=g), dim=-1).to(DEV, torch.bfloat16)
    v = torch.randn(rows, T, HV, V, generator=g).to(DEV, torch.bfloat16)
    beta = torch.rand(rows, T, HV, generator=g).to(DEV, torch.bfloat16)
    a = torch.randn(rows, T, HV, generator=g).to(DEV, torch.bfloat16)
    decay = gdn_gate_chunk_cumsum(g=a, A_log=torch.randn(HV, generator=g).to(DEV), chunk_size=64, scale=RCP_LN2,
                                  dt_bias=torch.randn(HV, generator=g).to(DEV))
    want_w, want_u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=decay, beta=beta, chunk_size=64)
    w, u = cuda_fast._wy_representation(k, v, decay, beta)
    for got, want in ((w, want_w), (u, want_u)):
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    again = cuda_fast._wy_representation(k, v, decay, beta)
    assert torch.equal(again[0], w) and torch.equal(again[1], u)


def test_flas_autotuned_kernels_run_one_pinned_launch_untimed():
    """`cuda_fast.pin_autotuned_launches`: each autotuned fla kernel on the engine's paths keeps one candidate, the
    one asked for where fla offers it, and fla's whole forward then runs without timing any (what makes two
    processes compute a prefix with the same bits)."""
    pytest.importorskip("fla")
    from engine.kernels import cuda_fast

    launches = cuda_fast.pin_autotuned_launches()
    assert launches == cuda_fast.pin_autotuned_launches()            # idempotent
    for kernel, settings in cuda_fast.PINNED_LAUNCHES:
        (config,) = kernel.fn.configs
        assert launches[kernel.fn.base_fn.__name__] == str(config)
        candidates = cuda_fast._CANDIDATES[kernel]
        offered = [c for c in candidates if all((getattr(c, key) if key.startswith("num_") else c.kwargs.get(key))
                                                == value for key, value in settings.items())]
        # the launch asked for where fla offers it on this device, else fla's first candidate
        assert config is (offered or candidates)[0], kernel
    if DEV != "cuda":
        return          # Triton's interpreter cannot run fla's loops
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    g = torch.Generator().manual_seed(3)
    q, k = (torch.nn.functional.normalize(torch.randn(2, 130, 4, 64, generator=g), dim=-1).to(DEV, torch.bfloat16)
            for _ in range(2))
    v = torch.randn(2, 130, 8, 64, generator=g).to(DEV, torch.bfloat16)
    a, b = (torch.randn(2, 130, 8, generator=g).to(DEV, torch.bfloat16) for _ in range(2))
    chunk_gated_delta_rule(q, k, v, g=a, beta=b, output_final_state=True, use_gate_in_kernel=True,
                           A_log=torch.randn(8, device=DEV), dt_bias=torch.randn(8, device=DEV),
                           use_beta_sigmoid_in_kernel=True)
    assert all(not kernel.fn.cache for kernel, _ in cuda_fast.PINNED_LAUNCHES)


def _chunk_outputs_reference(q, k, h, v_new, g, scale, chunk):
    """fla's output kernel written out in PyTorch: per chunk, q h (the state entering it) and the chunk's own causal
    q k^T applied to its new values, both decayed by the gate."""
    B, T, H, K = q.shape
    HV, V = v_new.shape[2], v_new.shape[3]
    o = torch.empty(B, T, HV, V, dtype=v_new.dtype)
    for b in range(B):
        for hv in range(HV):
            qh, kh = q[b, :, hv // (HV // H)].float(), k[b, :, hv // (HV // H)].float()
            for c in range(-(-T // chunk)):
                t = slice(c * chunk, min((c + 1) * chunk, T))
                g_c = g[b, t, hv].float()
                inter = (qh[t] @ h[b, c, hv].float()) * torch.exp2(g_c)[:, None]
                A = (qh[t] @ kh[t].T) * torch.exp2(g_c[:, None] - g_c[None, :])
                A = torch.tril(A).to(v_new.dtype).float()
                o[b, t, hv] = (inter * scale + (A @ v_new[b, t, hv].float()) * scale).to(v_new.dtype)
    return o


@pytest.mark.parametrize("dtype", [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton 3.6's "
                 "interpreter multiplies bf16 tiles wrongly"))])
@pytest.mark.parametrize("K", [16, 128])
def test_chunk_outputs_indexed_fuses_the_state_and_output_kernels(K, dtype):
    """The delta rule's fused state-and-output kernel: the output of the state kernel followed by fla's output
    kernel (written out in PyTorch), rows starting from their bank entries."""
    from engine.kernels.indexed_delta_rule import CHUNK, chunk_outputs_indexed, chunk_states_indexed

    q, k, w, u, decay, bank = _wy_inputs(3, K, dtype, seed=13)
    index = torch.tensor([3, 0, 3])
    on = lambda *ts: [t.to(DEV) for t in ts]  # noqa: E731
    scale = K ** -0.5
    got = chunk_outputs_indexed(*on(q, k, w, u, decay, bank, index), scale).cpu()
    h, v_new = (t.cpu() for t in chunk_states_indexed(*on(k, w, u, decay, bank, index)))
    want = _chunk_outputs_reference(q, k, h, v_new, decay, scale, CHUNK)
    tol = 1e-4 if dtype == torch.float32 and DEV == "cpu" else 3e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    # (128, 8, 2) needs more shared memory than the H200 has for float32 tiles
    for config in ((32, 4, 2), (32, 2, 2), (16, 2, 2)) + (((128, 8, 2),) if dtype == torch.bfloat16 else ()):
        assert same_across_tiles(chunk_outputs_indexed(*on(q, k, w, u, decay, bank, index), scale,
                                                        config=config).cpu(), got), config
