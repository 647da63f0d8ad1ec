"""What the local brokers' launchers need of their child process: a free loopback port, a child that dies with the
thread that started it, its end (a signal, then SIGKILL), and the cache directory its jars are fetched into."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable, Mapping

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def dies_with_this_thread() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking the kernel to SIGTERM the child when the thread that started it ends (Linux's
    ``PR_SET_PDEATHSIG`` follows the forking thread, not the process: start the broker from a thread that
    lives as long as it should); None where there is no prctl."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before the fork: the child only calls it
    parent = os.getpid()

    def die_with_parent() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the prctl: no signal will come
            os._exit(1)

    return die_with_parent


def end_process(process: subprocess.Popen, signum: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
    """Send ``signum`` to a running ``process`` and wait for it; SIGKILL after ``timeout_s``."""
    if process.poll() is not None:
        return
    process.send_signal(signum)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def cache_home(name: str, env_var: str, environ: Mapping[str, str] = os.environ) -> Path:
    """Where a fetched tool is kept: ``$env_var``, else ``$XDG_CACHE_HOME/decider/NAME`` (``~/.cache/decider/NAME``)."""
    if environ.get(env_var):
        return Path(environ[env_var]).expanduser()
    return Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "decider" / name
