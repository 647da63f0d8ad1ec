"""The embedded development broker: noida-db's Kafka service, run as a child process.

Used by ``decider broker``, ``decider demo`` and the test fixture, so the start/stop rules live here once.
noida-db's ``noida-db`` console script is a Python wrapper that runs the real binary as a child and does
not forward signals, so killing the wrapper would leave the broker running: we run the binary shipped
inside the ``noida_db`` package directly and stop it by its PID.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import IO

from worker.exceptions import FatalError


def broker_binary() -> Path:
    """Path of the noida-db executable inside the installed ``noida_db`` package."""
    try:
        path = Path(str(files("noida_db").joinpath("noida-db")))
    except ModuleNotFoundError as exc:
        raise FatalError("the embedded broker needs the noida-db package: pip install noida-db==0.2.3") from exc
    if not path.is_file():
        raise FatalError(f"noida-db binary not found at {path}; reinstall noida-db==0.2.3")
    if not os.access(path, os.X_OK):
        path.chmod(0o755)  # wheels do not always keep the executable bit
    return path


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class EmbeddedBroker:
    """One noida-db Kafka process. Use as a context manager, or call ``start()`` / ``stop()``.

    ``data_dir`` None means a fresh temporary directory, deleted on stop. ``log`` receives the
    broker's stdout/stderr (which include a harmless GLIBC version warning); None discards them.
    """

    port: int = 9092
    data_dir: str | None = None
    log: IO | None = None
    process: subprocess.Popen | None = field(default=None, init=False)
    _own_dir: str | None = field(default=None, init=False)

    @property
    def bootstrap(self) -> str:
        """The bootstrap servers string clients connect to."""
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> "EmbeddedBroker":
        """Start the broker and wait until it accepts Kafka connections."""
        if _port_open(self.port):
            raise FatalError(f"port {self.port} is already in use; pick another with --port")
        if self.data_dir is None:
            self._own_dir = tempfile.mkdtemp(prefix="decider-broker-")
        data_dir = self.data_dir or self._own_dir
        Path(data_dir).mkdir(parents=True, exist_ok=True)
        command = [str(broker_binary()), "start", "--only", "kafka", "--kafka-port", str(self.port), "--data-dir", data_dir]
        sink = self.log if self.log is not None else subprocess.DEVNULL
        # Its own session: a Ctrl-C in the terminal reaches us, and we decide when the broker stops.
        self.process = subprocess.Popen(command, stdout=sink, stderr=sink, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not _port_open(self.port):
            if self.process.poll() is not None:
                raise FatalError(f"the embedded broker exited with code {self.process.returncode} before listening on {self.port}")
            if time.monotonic() > deadline:
                self.stop()
                raise FatalError(f"the embedded broker did not listen on port {self.port} within {timeout_s:.0f} s")
            time.sleep(0.05)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the broker process by PID (SIGTERM, then SIGKILL) and delete a temporary data dir."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
            self._own_dir = None

    def __enter__(self) -> "EmbeddedBroker":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
