"""Programmatic dependent launch (PDL) for the Triton kernels of the wing: the switch, and the two pieces every kernel
module here calls (`pdl_launch` at the launch, `await_previous_kernel` first in the kernel).
"""
from __future__ import annotations

import triton
import triton.language as tl

PDL = False
"""Programmatic dependent launch (Hopper and later) for the Triton kernels of a scoring step: a kernel may start while
the one before it finishes, each of its programs waiting first (`griddepcontrol.wait`) until that kernel's writes are
visible, then letting the next kernel launch. Meant to hide part of the gap between kernels: at batch 1 a step's ~380
kernels take 1.87 ms on the H200 and its graph replays in 2.2 (runs AN, AX). Off: on the H200 CUDA graphs capture it
and it gives the same bits (`tests/engine/test_gpu.py -k pdl`, run AW), but it saved nothing in whole steps timed in
one process (`bench/probes/variant_ab.py`, run AW): 2.232 against 2.215 ms at batch 1, 5.008 against 4.971 at 8, 60.435
against 60.419 at 128; with the workers' deterministic table 2.881 against 2.900, 5.024 against 5.083, 62.107 against
61.939. A step's chains of Triton kernels are short: cuBLAS's GEMMs, between them, launch without the attribute.
Read when a kernel is launched, so a CUDA graph keeps the setting it was captured under."""


def pdl_launch() -> dict:
    """The launch arguments that turn on `PDL` for a kernel taking `PDL: tl.constexpr = False` and calling
    `await_previous_kernel(PDL)` first: none while it is off, so the kernels compile as they would without it."""
    return {"PDL": True, "launch_pdl": True} if PDL else {}


@triton.jit
def await_previous_kernel(PDL: tl.constexpr):
    # before the program's first load or store: under PDL the kernel ahead may still be writing this kernel's inputs,
    # or reading what it is about to overwrite
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
