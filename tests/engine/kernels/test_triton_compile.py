"""The delta rule's input kernels (`engine.kernels.delta_rule_inputs`) compiled for the H200 (sm_90) on the CPU, at the
launches `engine.kernels.cuda_fast` pins, down to the cubin (Triton's bundled ptxas). Their bit tests run here under
Triton's interpreter, which accepts code the compiler refuses: in run EU a `tl.cdiv` of two constexprs was a tensor
once compiled, `tl.static_range` refused it, and the only machine that compiled the kernel was the GPU's, a device call
later. This compiles each launch with the compiler instead, without a GPU: with a runtime value in that
`tl.static_range` the one-launch tests here fail and the interpreter's pass. (The GPU machine runs Triton 3.6, this one
what torch's wheel brings, 3.7.1 on 2026-12-07, whose compiler takes EU's `tl.cdiv` itself: a difference between the
two can still pass here and fail there.)"""
from __future__ import annotations

import os
import re

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("the interpreter replaces the compiler", allow_module_level=True)

from engine.kernels import decay  # noqa: E402
from engine.kernels import delta_rule_inputs as dri  # noqa: E402
from tests.engine.kernels.test_triton_ptx import _compiled  # noqa: E402

# The 0.8B shape's Gated DeltaNet: 16 key and value heads of 128 columns, fla's 64-token chunks.
SHAPE = dict(H=16, HV=16, K=128, V=128, BT=64)
LAUNCHES = {  # engine.kernels.cuda_fast's (it imports fla, which this machine may lack: checked below where it is)
    "WY_LAUNCH": ((64, 1), (4, 3)),
    "WY_SMALL_LAUNCH": ((64, 2), (2, 4)),
    "FUSED_WY_SMALL_LAUNCH": (64, 2, 4),
}


def _cubin(kernel, signature: dict[str, str], constants: dict, num_warps: int, num_stages: int = 3) -> bytes:
    """The kernel compiled as launched at 184 tokens a row (`T`, which no kernel here specialises on)."""
    return _compiled(kernel, signature, constants, {"T": 184}, num_warps, num_stages=num_stages).asm["cubin"]


def _signature(pointers: dict[str, str], ints: tuple[str, ...], constexprs: tuple[str, ...]) -> dict[str, str]:
    return {**pointers, **{n: "i32" for n in ints}, **{n: "constexpr" for n in constexprs}}


def test_the_launches_here_are_cuda_fasts():
    cuda_fast = pytest.importorskip("engine.kernels.cuda_fast", reason="fla is not installed")
    assert {name: getattr(cuda_fast, name) for name in LAUNCHES} == LAUNCHES


def _decay_signature() -> dict[str, str]:
    return {**_signature({"a": "*bf16", "b": "*bf16", "A_log": "*fp32", "dt_bias": "*bf16", "g": "*fp32",
                          "beta": "*fp32"}, ("T", "row_stride", "token_stride"), ()), "scale": "fp32",
            "H": "constexpr", "BT": "constexpr", "PDL": "constexpr"}


def test_decay_and_beta_compiles():
    assert _cubin(decay._decay_and_beta_kernel, _decay_signature(), dict(H=SHAPE["HV"], BT=SHAPE["BT"], PDL=False),
                  decay.DECAY_WARPS)


@pytest.mark.parametrize("launch", ["WY_LAUNCH", "WY_SMALL_LAUNCH"])
def test_the_solve_and_w_u_kernels_compile(launch):
    (bk, solve_warps), (warps, stages) = LAUNCHES[launch]
    solve = _signature({"k": "*bf16", "g": "*fp32", "beta": "*fp32", "A": "*bf16"}, ("T",),
                       ("H", "HV", "K", "BT", "BC", "BK", "PRECISION", "PDL"))
    solve_constants = dict(H=SHAPE["H"], HV=SHAPE["HV"], K=SHAPE["K"], BT=SHAPE["BT"], BC=16, BK=bk, PRECISION="tf32",
                           PDL=False)
    assert _cubin(dri._solve_kernel, solve, solve_constants, solve_warps)
    w_u = _signature({n: "*fp32" if n in ("beta", "g") else "*bf16" for n in ("k", "v", "beta", "w", "u", "A", "g")},
                     ("T",), ("H", "HV", "K", "V", "BT", "BK", "BV", "PDL"))
    w_u_constants = dict(SHAPE, BK=dri.W_U_BLOCK, BV=dri.W_U_BLOCK, PDL=False)
    assert _cubin(dri._w_u_kernel, w_u, w_u_constants, warps, stages)


@pytest.mark.parametrize("parts", [1, 2, 4])
def test_the_one_launch_solve_and_w_u_compiles_in_every_split(parts):
    bk, warps, stages = LAUNCHES["FUSED_WY_SMALL_LAUNCH"]
    blocks = (SHAPE["K"] + dri.W_U_BLOCK - 1) // dri.W_U_BLOCK + (SHAPE["V"] + dri.W_U_BLOCK - 1) // dri.W_U_BLOCK
    sig = _signature({n: "*fp32" if n in ("g", "beta") else "*bf16" for n in ("k", "v", "g", "beta", "A", "w", "u")},
                     ("T",), ("H", "HV", "K", "V", "BT", "BC", "BK", "PRECISION", "W_U_BK", "PARTS", "COUNT"))
    sig = {**sig, "a_part_stride": "i32", "PDL": "constexpr"}
    constants = dict(SHAPE, BC=16, BK=bk, PRECISION="tf32", W_U_BK=dri.W_U_BLOCK, PARTS=parts, COUNT=blocks // parts,
                     PDL=False)
    assert _cubin(dri._solve_w_u_kernel, sig, constants, warps, stages)


def _scan_layouts(ttgir: str) -> list[str]:
    """The layouts (their definitions, not their names) of every scan's operand in a kernel's TTGIR."""
    aliases = dict(re.findall(r"^(#\w+) = (.*)$", ttgir, flags=re.M))
    scanned = re.findall(r'"tt\.scan"\(%[\w.]+\).*?\(tensor<\d+xf32, (#\w+)>\)', ttgir, flags=re.S)
    return [aliases[name] for name in scanned]


def test_the_conv_launchs_decay_scans_its_chunks_in_the_decay_kernels_layout():
    """The decay's scan over a chunk sums in a tree that follows the layout of the values scanned. The conv's small
    launch (`causal_conv.conv_qkv_decay`, batch 1) runs `decay.decay_chunk` beside the conv; the decay's own kernel
    (larger batches) runs it alone: compiled, both must scan in one layout, or batch 1's decay would not be batch
    8's."""
    from engine.kernels import causal_conv

    conv_sig = {"X": "*bf16", "W": "*bf16", "PREV": "*bf16", "PREV_INDEX": "*i64", "GATES": "*bf16", "Q": "*bf16",
                "K": "*bf16", "V": "*bf16", "BETA": "*fp32", "ALPHA": "*fp32", "A_LOG": "*fp32", "DT_BIAS": "*bf16",
                "T": "i32", "x_b": "i32", "x_t": "i32", "w_c": "constexpr", "w_k": "i32", "p_b": "i32",
                "p_c": "constexpr", "p_k": "i32", "g_b": "i32", "g_t": "i32", "eps": "fp32", "scale": "fp32",
                **{n: "constexpr" for n in ("HK", "HV", "DK", "DV", "KW", "BT", "BD", "NG", "BG", "HAS_PREV",
                                            "HAS_INDEX", "W_TILE", "GATE_COPY", "DECAY", "CHUNK")}}
    tokens, warps = causal_conv.CONV_SMALL_CONFIG
    conv = _compiled(causal_conv._conv_qkv_kernel, conv_sig,
                     dict(w_c=1, p_c=1, HK=16, HV=16, DK=128, DV=128, KW=4, BT=tokens, BD=128, NG=16, BG=32,
                          HAS_PREV=True, HAS_INDEX=True, W_TILE=causal_conv.CONV_WEIGHT_TILE, GATE_COPY=False,
                          DECAY=True, CHUNK=SHAPE["BT"]),
                     dict(T=184, x_b=184 * 8224, x_t=8224, w_k=6144, p_b=3 * 6144, p_k=6144, g_b=184 * 8224, g_t=8224),
                     warps)
    alone = _compiled(decay._decay_and_beta_kernel, _decay_signature(), dict(H=16, BT=SHAPE["BT"], PDL=False),
                      dict(T=184, row_stride=184 * 16, token_stride=16), decay.DECAY_WARPS)
    assert warps == decay.DECAY_WARPS
    in_conv, in_decay = _scan_layouts(conv.asm["ttgir"]), _scan_layouts(alone.asm["ttgir"])
    assert len(in_conv) == len(in_decay) == 1 and in_conv == in_decay
