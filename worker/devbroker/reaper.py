"""Clean-up that outlives this process: stop a child process and delete directories once this process is gone,
however it went (SIGKILL included).

A SIGKILL runs no signal handler, ``finally`` or ``atexit``, so the clean-up runs in a small separate process
(plain Python, standard library only, in its own session so that a signal sent to our process group misses it).
It blocks reading a pipe whose only writer is this process; the kernel closes that pipe when this process exits
for any reason, and the reaper then stops the child, deletes the directories and exits. A clean shutdown does its
own clean-up and calls ``release()``, after which the reaper finds nothing left to do.

Run as a script (``python reaper.py --pid N --remove DIR ...``) by ``Reaper``; it imports nothing of decider.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

_GRACE_S = 5.0  # how long a child gets to exit on SIGTERM before SIGKILL


class Reaper:
    """Starts the reaper process for ``pids`` (stopped: SIGTERM, then SIGKILL) and ``paths`` (deleted)."""

    def __init__(self, pids: list[int], paths: list[str]) -> None:
        command = [sys.executable, "-I", os.path.abspath(__file__)]
        command += [arg for pid in pids for arg in ("--pid", f"{pid}:{_start_time(pid) or ''}")]
        command += [arg for path in paths for arg in ("--remove", path)]
        # close_fds (the default) keeps the pipe's write end out of every other child, so that only this
        # process's exit closes it.
        self._process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, start_new_session=True)

    def release(self, timeout_s: float = 10.0) -> None:
        """Let the reaper act now (after a clean shutdown there is nothing left for it) and wait for it."""
        if self._process.stdin is not None and not self._process.stdin.closed:
            self._process.stdin.close()
        try:
            self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def _stat_fields(pid: int) -> list[bytes] | None:
    """/proc/PID/stat's fields after the command name (state first), or None off Linux or once the pid is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None


def _start_time(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot, Linux): with the pid, names one process even if the pid is
    reused later."""
    fields = _stat_fields(pid)
    return fields[19].decode() if fields else None


def _alive(pid: int, start_time: str | None) -> bool:
    """Whether the process ``pid`` that started at ``start_time`` runs (a zombie does not: it only waits to be
    reaped by its new parent)."""
    fields = _stat_fields(pid)
    if fields is not None:
        return fields[0] != b"Z" and (start_time is None or fields[19].decode() == start_time)
    if os.path.isdir("/proc"):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop(pid: int, start_time: str | None) -> None:
    if not _alive(pid, start_time):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + _GRACE_S
    while _alive(pid, start_time) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(pid, start_time):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        while _alive(pid, start_time) and time.monotonic() < deadline + _GRACE_S:
            time.sleep(0.05)


def main(argv: list[str]) -> None:
    """Wait for the owner to go (stdin closes), then stop ``--pid`` processes and delete ``--remove`` paths."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pid", action="append", default=[], help="PID:START_TIME (START_TIME may be empty)")
    parser.add_argument("--remove", action="append", default=[])
    args = parser.parse_args(argv)
    while sys.stdin.buffer.read(4096):
        pass
    for spec in args.pid:
        pid, start_time = spec.split(":", 1)
        _stop(int(pid), start_time or None)
    for path in args.remove:
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
