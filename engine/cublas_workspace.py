"""cuBLAS without a workspace, set before the process's first GEMM.

cuBLAS given a workspace picks split-K and stream-K kernels at some row counts, and each clears a slice of its
workspace with a memset first: 41 memsets before 41 GEMMs in a step, each followed by a ~3.7 us gap (run DC,
bench/README.md). Without one, the same GEMMs run in the same time, the memsets and their gaps are gone (a step from its
first kernel: 2,243 -> 2,217 us at batch 1, 4,987 -> 4,727 at batch 8 on an H100, two processes of each, run DD), and
every projection shape is batch-invariant as one GEMM (run CU), so the deterministic table needs no blocked down
projection.

torch reads both variables once a process, when it first makes a cuBLAS (or cuBLASLt) workspace, so they are set when
`engine` is imported, before any model is loaded. A value already in the environment is the user's choice and stands;
`DECIDER_CUBLAS_WORKSPACE=default` keeps cuBLAS's own workspace (the A/B arm of `bench/gpu_session.sh
workspace-timelines`).
"""
from __future__ import annotations

import os

NO_WORKSPACE = {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"}
OPT_OUT = "DECIDER_CUBLAS_WORKSPACE"


def configure(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Put `NO_WORKSPACE` into `environ` (default: `os.environ`) unless the user set either variable or opted out;
    returns the variables it set (empty when it left the environment alone)."""
    environ = os.environ if environ is None else environ
    if environ.get(OPT_OUT) == "default" or any(name in environ for name in NO_WORKSPACE):
        return {}
    environ.update(NO_WORKSPACE)
    return dict(NO_WORKSPACE)


def describe(environ: dict[str, str] | None = None) -> str:
    """The workspace setting in effect, for the engine's load log."""
    environ = os.environ if environ is None else environ
    chosen = {name: environ[name] for name in NO_WORKSPACE if name in environ}
    return ", ".join(f"{k}={v}" for k, v in chosen.items()) if chosen else "cuBLAS's default workspace"
