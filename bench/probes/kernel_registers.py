"""Registers, spills and shared memory of the attention kernels' launches, compiled for the H200 (sm_90a) without a
GPU: Triton's compiler and its bundled ptxas (`ptxas -v`) on the 0.8B shape (G = 4, head dim 256).

    python bench/probes/kernel_registers.py                       # the suffix and answers' launches, split and not
    python bench/probes/kernel_registers.py --launch 64,64,4,3,4  # one more suffix launch

A launch that spills keeps part of its accumulator in local memory, read and written at every key block; one whose
shared memory is over half the SM's 228 KB runs one program an SM. At batch 1 the batch-invariant table's 64-row
suffix launch (24 programs) and the answers' (2 programs) are such launches.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from engine.kernels import suffix_attention as sa  # noqa: E402

_SUFFIX_INTS = ["T", "sq_b", "sq_h", "sq_t", "sk_b", "sk_h", "sk_t", "sv_b", "sv_h", "sv_t", "skp_s", "skp_h", "skp_n",
                "svp_s", "svp_h", "svp_n", "g_token", "g_head"]
_ANSWER_INTS = ["T", "sq_s", "sq_h", "sk_b", "sk_h", "sk_t", "sv_b", "sv_h", "sv_t", "skp_s", "skp_h", "skp_n", "svp_s",
                "svp_h", "svp_n", "g_s", "g_h"]


def _signature(kind: str) -> dict:
    tensors = {n: "*bf16" for n in ("Q", "K", "V", "KP", "VP")}
    if kind == "suffix":
        sig = {**tensors, "PLENS": "*i32", "SLOTS": "*i64", "GATE": "*bf16", "Y": "*bf16",
               **{n: "i32" for n in _SUFFIX_INTS}}
    else:
        sig = {**tensors, "PLENS": "*i32", **{n: "*i64" for n in ("SLOTS", "ROWS", "STARTS", "COUNTS")},
               "GATE": "*bf16", "Y": "*bf16", **{n: "i32" for n in _ANSWER_INTS}}
    constants = ["G", "D", "BM", "BN", "PRECISION", "KEY_CAP", "T_CAP"] + (["PDL"] if kind == "suffix" else [])
    return {**sig, "scale": "fp32", **{n: "constexpr" for n in constants + ["DSPLIT"]}}


def report(kind: str, config: tuple[int, ...]) -> dict:
    """{registers, spill_stores, spill_loads, shared} of the `kind` ("suffix" | "answers") kernel at `config`."""
    kernel = sa._suffix_attention_kernel if kind == "suffix" else sa._answer_attention_kernel
    BM, BN, warps, stages, split = sa.launch(config, 256)
    sig = _signature(kind)
    names = list(sig)
    constants = dict(G=4, D=256, BM=BM, BN=BN, PRECISION="tf32", KEY_CAP=0, T_CAP=0, DSPLIT=split)
    if kind == "suffix":
        constants["PDL"] = False
    # pointers 16-byte aligned, as torch's allocations are, and the strides multiples of 16, as the 0.8B shape's are
    # (Triton specialises them so: only T is in `do_not_specialize`)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if t.startswith("*") or (t == "i32" and n != "T")}
    src = ASTSource(kernel, sig, constexprs={(names.index(k),): v for k, v in constants.items()}, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        Path(ptx).write_text(compiled.asm["ptx"])
        err = subprocess.run([str(ptxas), "-v", "-arch=sm_90a", ptx, "-o", os.devnull], capture_output=True,
                             text=True, check=True).stderr

    def number(pattern: str) -> int:
        found = re.search(pattern, err)
        return int(found.group(1)) if found else 0

    return {"registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"), "shared": compiled.metadata.shared}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launch", action="append", default=[], help="another suffix launch: BM,BN,warps,stages[,split]")
    args = ap.parse_args(argv)
    launches = [("suffix", sa.CONFIG), ("suffix", (64, 64, 4, 2)), ("suffix", (64, 64, 4, 2, 2)),
                ("suffix", (64, 64, 4, 2, 4)), ("answers", sa.ANSWER_CONFIG[:4]), ("answers", (*sa.ANSWER_CONFIG[:4], 4))]
    launches += [("suffix", tuple(int(x) for x in spec.split(","))) for spec in args.launch]
    rows = []
    print("| kernel | launch | registers | spill stores / loads (bytes) | shared memory (KB) |")
    print("|---|---|---|---|---|")
    for kind, config in launches:
        r = {"kernel": kind, "launch": config, **report(kind, config)}
        rows.append(r)
        print(f"| {kind} | {config} | {r['registers']} | {r['spill_stores']} / {r['spill_loads']} | "
              f"{r['shared'] / 1024:.0f} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
