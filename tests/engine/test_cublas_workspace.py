"""cuBLAS without a workspace unless the user chose otherwise (engine.cublas_workspace; on the GPU: run DD)."""
import os
import subprocess
import sys

from engine import cublas_workspace


def test_it_sets_no_workspace_where_nothing_was_chosen():
    environ = {"PATH": "/bin"}
    assert cublas_workspace.configure(environ) == cublas_workspace.NO_WORKSPACE
    assert environ == {"PATH": "/bin", "CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"}
    assert cublas_workspace.describe(environ) == "CUBLAS_WORKSPACE_CONFIG=:0:0, CUBLASLT_WORKSPACE_SIZE=0"


def test_the_users_own_setting_or_opt_out_stands():
    for chosen in ({"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, {"CUBLASLT_WORKSPACE_SIZE": "1024"},
                   {"DECIDER_CUBLAS_WORKSPACE": "default"}):
        environ = dict(chosen)
        assert cublas_workspace.configure(environ) == {}
        assert environ == chosen
    assert cublas_workspace.describe({}) == "cuBLAS's default workspace"
    assert cublas_workspace.describe({"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == "CUBLAS_WORKSPACE_CONFIG=:4096:8"


def test_importing_the_engine_sets_it_before_any_model_loads():
    # a fresh interpreter: torch reads the variables at the process's first GEMM, which an import must precede
    env = {k: v for k, v in os.environ.items() if k not in (*cublas_workspace.NO_WORKSPACE, cublas_workspace.OPT_OUT)}
    code = "import os, engine; print(os.environ.get('CUBLAS_WORKSPACE_CONFIG'), os.environ.get('CUBLASLT_WORKSPACE_SIZE'))"
    run = lambda extra: subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True,
                                       text=True, check=True).stdout.split()
    assert run({}) == [":0:0", "0"]
    assert run({"DECIDER_CUBLAS_WORKSPACE": "default"}) == ["None", "None"]
