"""The Triton kernels compiled for the H200 (sm_90) without a GPU, checking the PTX for what the profile cannot
show by name: that rows of bf16 strided views load 16 bytes at a time. A stride listed in `do_not_specialize`
hides its alignment from Triton, which then loads 2 bytes at a time (this happened: every kernel here did, and
fla's SwiGLU, which addresses its halves as flat offsets, still does). Needs triton (with its bundled ptxas), not a
GPU, so it runs in CI (with this machine's Triton, 3.7.1 on 2026-12-07; the GPU machine's is 3.6)."""

import inspect
import os
import re

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("the interpreter replaces the compiler", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from engine.kernels import causal_conv  # noqa: E402
from engine.kernels import fused as tk  # noqa: E402


def _ptx(kernel, signature: dict, constants: dict, runtime_ints: dict, num_warps: int = 4, pdl: bool = False) -> str:
    """PTX of `kernel` specialised as a launch with these ints would be: multiples of 16 marked divisible (Triton's
    rule for arguments not in `do_not_specialize`), pointers 16-byte aligned (torch's allocations are)."""
    return _compiled(kernel, signature, constants, runtime_ints, num_warps, pdl).asm["ptx"]


def _compiled(kernel, signature: dict, constants: dict, runtime_ints: dict, num_warps: int = 4, pdl: bool = False,
              num_stages: int = 3):
    """`_ptx`'s compilation, the whole compiled kernel (its `metadata.shared`: bytes of shared memory)."""
    # constexprs left out take the kernel's defaults (Triton 3.7.1 does not fill them in: 6 of 9 tests failed here)
    defaults = {p.name: p.default for p in kernel.params if p.is_constexpr and p.name not in signature
                and p.default is not inspect.Parameter.empty}
    signature = {**signature, **{n: "constexpr" for n in defaults}}
    constants = {**defaults, **constants}
    names = list(signature)
    unspecialised = set(kernel.do_not_specialize) | {names[i] for i in kernel.do_not_specialize if isinstance(i, int)}
    aligned = [n for n, t in signature.items() if t.startswith("*")]
    aligned += [n for n, v in runtime_ints.items() if v % 16 == 0 and n not in unspecialised]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(kernel, signature, constexprs={(names.index(k),): v for k, v in constants.items()}, attrs=attrs)
    options = {"num_warps": num_warps, "launch_pdl": pdl, "num_stages": num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _scalar_bf16_loads(ptx: str) -> int:
    return len(re.findall(r"ld\.global(?:\.\w+)*\.b16\b", ptx))


def _ints(names, **values):
    return {n: values.get(n, 4096) for n in names}


def test_norm_kernels_load_strided_rows_in_16_byte_vectors():
    # an RMSNorm over q heads inside the fused projection: rows 256 apart, heads 8192 apart
    sig = {"X": "*bf16", "G": "*bf16", "W": "*fp32", "Y": "*bf16", "R": "*bf16", "n_rows": "i32", "heads": "i32",
           "x_outer": "i32", "x_inner": "i32", "g_outer": "i32", "g_inner": "i32", "eps": "fp32", "D": "constexpr",
           "BD": "constexpr", "BR": "constexpr", "KIND": "constexpr", "ADD_RESIDUAL": "constexpr"}
    ints = _ints(["n_rows", "heads", "x_outer", "x_inner", "g_outer", "g_inner"], n_rows=5888 * 16, heads=16,
                 x_outer=8224, x_inner=128)
    ptx = _ptx(tk._row_norm_kernel, sig, dict(D=128, BD=128, BR=tk._blocks(128)[1], KIND=tk.GATED, ADD_RESIDUAL=False),
               ints)
    assert _scalar_bf16_loads(ptx) == 0 and "ld.global.v4.b32" in ptx


def test_norm_weights_loaded_as_tiles_take_no_barrier_to_broadcast():
    # `NORM_WEIGHT_TILE`: the gated norm of 128-wide heads (a row within one warp) needs no barrier at all; the
    # residual norm of 1,024-wide rows keeps the 2 of its sum across a row's 4 warps
    sig = {"X": "*bf16", "G": "*bf16", "W": "*fp32", "Y": "*bf16", "R": "*bf16", "n_rows": "i32", "heads": "i32",
           "x_outer": "i32", "x_inner": "i32", "g_outer": "i32", "g_inner": "i32", "eps": "fp32", "D": "constexpr",
           "BD": "constexpr", "BR": "constexpr", "KIND": "constexpr", "ADD_RESIDUAL": "constexpr",
           "W_TILE": "constexpr"}
    names = ["n_rows", "heads", "x_outer", "x_inner", "g_outer", "g_inner"]
    launches = [(dict(D=128, BD=128, BR=tk._blocks(128)[1], KIND=tk.GATED, ADD_RESIDUAL=False),
                 _ints(names, n_rows=5888 * 16, heads=16, x_outer=8224, x_inner=128)),
                (dict(D=1024, BD=1024, BR=tk._blocks(1024)[1], KIND=tk.RMS, ADD_RESIDUAL=True),
                 _ints(names, n_rows=23552, heads=1, x_outer=1024, x_inner=1024))]
    barriers = [[_ptx(tk._row_norm_kernel, sig, {**constants, "W_TILE": tile}, ints).split(".entry")[1]
                 .count("bar.sync") for tile in (False, True)] for constants, ints in launches]
    assert barriers == [[1, 0], [4, 2]]


def test_rope_and_gate_kernels_load_strided_rows_in_16_byte_vectors():
    sig = {"X": "*bf16", "W": "*fp32", "COS": "*bf16", "SIN": "*bf16", "Y": "*bf16", "n_rows": "i32", "heads": "i32",
           "T": "i32", "x_outer": "i32", "x_inner": "i32", "c_batch": "i32", "c_time": "i32", "eps": "fp32",
           "D": "constexpr", "BD": "constexpr", "BR": "constexpr", "ROT": "constexpr"}
    ints = _ints(["n_rows", "heads", "T", "x_outer", "x_inner", "c_batch", "c_time"], n_rows=184 * 32 * 8, heads=8,
                 T=184, x_outer=8192, x_inner=512, c_batch=184 * 64, c_time=64)
    assert _scalar_bf16_loads(_ptx(tk._rms_norm_rope_kernel, sig, dict(D=256, BD=256, BR=16, ROT=64), ints)) == 0
    names = ["n_rows", "T", "Hq", "G", "P", "s_b", "s_h", "s_t", "l_b", "l_h", "l_t", "p_p", "p_h", "p_m", "m_p",
             "m_h", "m_m", "g_outer", "g_inner"]
    sig = {"O": "*bf16", "LSE": "*fp32", "OP": "*bf16", "LSEP": "*fp32", "GATE": "*bf16", "Y": "*bf16",
           **{n: "i32" for n in names}, "D": "constexpr", "BD": "constexpr", "BR": "constexpr", "MERGE": "constexpr"}
    ints = _ints(names, n_rows=184 * 32 * 8, T=184, Hq=8, G=4, P=1, s_b=8 * 184 * 256, s_h=184 * 256, s_t=256,
                 g_outer=8192, g_inner=512)
    assert _scalar_bf16_loads(_ptx(tk._gate_attention_kernel, sig, dict(D=256, BD=256, BR=16, MERGE=True), ints)) == 0


def test_conv_kernel_loads_the_projection_and_the_prefix_state_in_16_byte_vectors():
    # as launched: the tap-major weight's channel stride and the time-major bank's (`PrefixBank`) are 1, and Triton
    # 3.6 makes an int argument equal to 1 a constant (`native_specialize_impl(..., 1, ...)` -> ('constexpr', 1))
    sig = {"X": "*bf16", "W": "*bf16", "PREV": "*bf16", "PREV_INDEX": "*i64", "GATES": "*bf16", "Q": "*bf16",
           "K": "*bf16", "V": "*bf16", "BETA": "*bf16", "ALPHA": "*bf16", "A_LOG": "*fp32", "DT_BIAS": "*bf16",
           "T": "i32", "x_b": "i32", "x_t": "i32", "w_c": "constexpr", "w_k": "i32", "p_b": "i32", "p_c": "constexpr",
           "p_k": "i32", "g_b": "i32", "g_t": "i32", "eps": "fp32", "scale": "fp32", **{n: "constexpr" for n in ("HK", "HV", "DK", "DV", "KW", "BT", "BD", "NG",
                                                                     "BG", "HAS_PREV", "HAS_INDEX")}}
    ints = _ints(["T", "x_b", "x_t", "w_k", "p_b", "p_k", "g_b", "g_t"], T=184, x_b=184 * 8224, x_t=8224, w_k=6144,
                 p_b=3 * 6144, p_k=6144, g_b=184 * 8224, g_t=8224)
    for tile in (False, True):
        ptx = _ptx(causal_conv._conv_qkv_kernel, {**sig, "W_TILE": "constexpr"},
                   dict(w_c=1, p_c=1, HK=16, HV=16, DK=128, DV=128, KW=4, BT=8, BD=128, NG=16, BG=32, HAS_PREV=True,
                        HAS_INDEX=True, W_TILE=tile), ints, num_warps=2)
        assert "ld.global.v4.b32" in ptx and _scalar_bf16_loads(ptx) == 0
    # the weights loaded in the inputs' own layout: no conversion through shared memory, no barrier (13 without)
    assert "bar.sync" not in ptx and ".shared" not in ptx.split(".entry")[1]


def test_swiglu_kernel_loads_and_stores_in_16_byte_vectors():
    # the two halves of the 0.8B model's fused gate|up output: rows 7168 apart, 3584 wide
    sig = {"G": "*bf16", "U": "*bf16", "Y": "*bf16", "n_rows": "i32", "g_row": "i32", "u_row": "i32",
           "D": "constexpr", "BLOCK": "constexpr"}
    ptx = _ptx(tk._swiglu_kernel, sig, dict(D=3584, BLOCK=1024), _ints(["n_rows", "g_row", "u_row"], n_rows=5888,
                                                                        g_row=7168, u_row=7168))
    assert _scalar_bf16_loads(ptx) == 0 and "st.global.v4.b32" in ptx


def test_suffix_attention_kernel_loads_queries_keys_values_and_gate_in_16_byte_vectors():
    # the 0.8B shape at batch 128: q, k [B, H, 184, 256] contiguous, v and the gate strided views of the fused q|k|v
    # projection (5120 wide), the bank's K/V [S, 2, 512, 256]
    from engine.kernels import suffix_attention as sa

    names = ["T", "sq_b", "sq_h", "sq_t", "sk_b", "sk_h", "sk_t", "sv_b", "sv_h", "sv_t", "skp_s", "skp_h", "skp_n",
             "svp_s", "svp_h", "svp_n", "g_token", "g_head"]
    sig = {**{n: "*bf16" for n in ("Q", "K", "V", "KP", "VP")}, "PLENS": "*i32", "SLOTS": "*i64", "GATE": "*bf16",
           "Y": "*bf16", **{n: "i32" for n in names}, "scale": "fp32",
           **{n: "constexpr" for n in ("G", "D", "BM", "BN", "PRECISION", "KEY_CAP", "T_CAP", "PDL", "DSPLIT")}}
    ints = _ints(names, T=184, sq_b=8 * 184 * 256, sq_h=184 * 256, sq_t=256, sk_b=2 * 184 * 256, sk_h=184 * 256,
                 sk_t=256, sv_b=184 * 5120, sv_h=256, sv_t=5120, skp_s=2 * 512 * 256, skp_h=512 * 256, skp_n=256,
                 svp_s=2 * 512 * 256, svp_h=512 * 256, svp_n=256, g_token=5120, g_head=512)
    for config in (sa.CONFIG, (64, 64, 4, 2, 4)):          # and a D split's narrower value and gate columns
        BM, BN, warps, _stages, split = sa.launch(config)
        ptx = _ptx(sa._suffix_attention_kernel, sig, dict(G=4, D=256, BM=BM, BN=BN, PRECISION="tf32", KEY_CAP=0,
                                                          T_CAP=0, PDL=False, DSPLIT=split), ints, num_warps=warps)
        assert _scalar_bf16_loads(ptx) == 0 and "ld.global.v4.b32" in ptx, config



def test_answer_attention_kernel_loads_queries_keys_values_and_gate_in_16_byte_vectors():
    # the last layer at batch 128: q [S, 8, 1, 256] after RoPE, the gate a strided view of the answer rows' q|gate
    # projection (4096 wide), k and v as in the suffix attention
    from engine.kernels import suffix_attention as sa

    names = ["T", "sq_s", "sq_h", "sk_b", "sk_h", "sk_t", "sv_b", "sv_h", "sv_t", "skp_s", "skp_h", "skp_n", "svp_s",
             "svp_h", "svp_n", "g_s", "g_h"]
    sig = {**{n: "*bf16" for n in ("Q", "K", "V", "KP", "VP")}, "PLENS": "*i32",
           **{n: "*i64" for n in ("SLOTS", "ROWS", "STARTS", "COUNTS")}, "GATE": "*bf16", "Y": "*bf16",
           **{n: "i32" for n in names}, "scale": "fp32",
           **{n: "constexpr" for n in ("G", "D", "BM", "BN", "PRECISION", "KEY_CAP", "T_CAP", "DSPLIT")}}
    ints = _ints(names, T=184, sq_s=8 * 256, sq_h=256, sk_b=2 * 184 * 256, sk_h=184 * 256, sk_t=256, sv_b=184 * 1024,
                 sv_h=256, sv_t=1024, skp_s=2 * 512 * 256, skp_h=512 * 256, skp_n=256, svp_s=2 * 512 * 256,
                 svp_h=512 * 256, svp_n=256, g_s=4096, g_h=512)
    BM, BN, warps, _stages, split = sa.launch(sa.ANSWER_CONFIG)
    ptx = _ptx(sa._answer_attention_kernel, sig,
               dict(G=4, D=256, BM=BM, BN=BN, PRECISION="tf32", KEY_CAP=0, T_CAP=0, DSPLIT=split), ints,
               num_warps=warps)
    assert _scalar_bf16_loads(ptx) == 0 and "ld.global.v4.b32" in ptx

def _vocab_logsumexp_launches() -> list[tuple]:
    """(kernel, signature, constants, ints, warps, stages) of `engine.kernels.vocab_logsumexp`'s two kernels as launched
    for Qwen3.5's vocabulary (248,320 x 1,024 bf16) at 1,280 rows."""
    from engine.kernels import vocab_logsumexp as vl

    BM, BN, BK, warps, stages = vl.vocab_config(248_320, 1024)
    blocks = 248_320 // BN
    width = -(-blocks // vl.TABLE_ALIGN) * vl.TABLE_ALIGN
    tile = ({"X": "*bf16", "W": "*bf16", "P": "*fp32", "M": "i32", "N": "i32", "K": "constexpr", "sx": "i32",
             "sw": "i32", "sp": "i32", "BM": "constexpr", "BN": "constexpr", "BK": "constexpr",
             "PRECISION": "constexpr"},
            dict(K=1024, BM=BM, BN=BN, BK=BK, PRECISION="tf32"),
            _ints(["M", "N", "sx", "sw", "sp"], M=1280, N=248_320, sx=1024, sw=1024, sp=width), warps, stages)
    combine = ({"P": "*fp32", "Y": "*fp32", "sp": "i32", "NB": "constexpr", "WIDTH": "constexpr",
                "BLOCK": "constexpr"},
               dict(NB=blocks, WIDTH=width, BLOCK=triton.next_power_of_2(width)), {"sp": width}, 4, 3)
    return [(vl._block_logsumexp_kernel, *tile), (vl._combine_kernel, *combine)]


def test_vocab_logsumexp_runs_on_tensor_cores_within_shared_memory_and_combines_in_16_byte_loads():
    """The label mass's fused log-sum-exp: the tile's dots compile to Hopper's wgmma fed by cp.async stages, in the
    H200's 227 KB of shared memory; the combine kernel reads the partial table 16 bytes at a time."""
    (tile, *tile_args), (combine, *combine_args) = _vocab_logsumexp_launches()
    sig, constants, ints, warps, stages = tile_args
    compiled = _compiled(tile, sig, constants, ints, warps, num_stages=stages)
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async" in ptx
    assert compiled.metadata.shared <= 227 * 1024
    sig, constants, ints, warps, _stages = combine_args
    ptx = _ptx(combine, sig, constants, ints, warps)
    assert "ld.global.v4.b32" in ptx and "ld.global.b32" not in ptx


def _waits_before_touching_memory(ptx: str) -> bool:
    """Whether the kernel's first global load or store comes after `griddepcontrol.wait` (and it lets the next kernel
    launch): under programmatic dependent launch, the kernel ahead may still be writing this one's inputs."""
    body = ptx[ptx.index(".entry"):]
    wait = body.find("griddepcontrol.wait")
    first_access = min((i for i in (body.find("ld.global"), body.find("st.global")) if i >= 0), default=len(body))
    return 0 <= wait < first_access and "griddepcontrol.launch_dependents" in body


def test_kernels_under_pdl_wait_for_the_kernel_ahead_before_touching_memory():
    """`engine.kernels.pdl.PDL`: each kernel family of a scoring step, compiled as launched with it on, waits at
    its start; with it off (the default) no `griddepcontrol` instruction is compiled in."""
    from engine.kernels import delta_rule_inputs as dri
    from engine.kernels import indexed_delta_rule as idr

    swiglu = ({"G": "*bf16", "U": "*bf16", "Y": "*bf16", "n_rows": "i32", "g_row": "i32", "u_row": "i32",
               "D": "constexpr", "BLOCK": "constexpr", "PDL": "constexpr"},
              dict(D=3584, BLOCK=1024), _ints(["n_rows", "g_row", "u_row"], n_rows=5888, g_row=7168, u_row=7168))
    solve = ({"k": "*bf16", "g": "*fp32", "beta": "*fp32", "A": "*bf16", "T": "i32",
              **{n: "constexpr" for n in ("H", "HV", "K", "BT", "BC", "BK", "PRECISION", "PDL")}},
             dict(H=16, HV=16, K=128, BT=64, BC=16, BK=64, PRECISION="tf32"), {"T": 184})
    fused = ({**{n: "*bf16" for n in ("q", "k", "v", "w")}, "g": "*fp32", "o": "*bf16", "h0": "*fp32",
              "h0_index": "*i64", "scale": "fp32", "T": "i32",
              **{n: "constexpr" for n in ("NT", "H", "HV", "K", "V", "BT", "BV", "PDL")}},
             dict(NT=3, H=16, HV=16, K=128, V=128, BT=64, BV=64), {"T": 184})
    for kernel, (sig, constants, ints) in ((tk._swiglu_kernel, swiglu), (dri._solve_kernel, solve),
                                           (idr._fwd_h_o_indexed_kernel, fused)):
        on = _ptx(kernel, sig, {**constants, "PDL": True}, ints, pdl=True)
        off = _ptx(kernel, sig, {**constants, "PDL": False}, ints)
        assert _waits_before_touching_memory(on), kernel.fn.__name__
        assert "griddepcontrol" not in off, kernel.fn.__name__
    for kernel, sig, constants, ints, warps, _stages in _vocab_logsumexp_launches():
        sig = {**sig, "PDL": "constexpr"}
        assert _waits_before_touching_memory(_ptx(kernel, sig, {**constants, "PDL": True}, ints, warps, pdl=True))
        assert "griddepcontrol" not in _ptx(kernel, sig, {**constants, "PDL": False}, ints, warps)
