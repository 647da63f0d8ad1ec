"""The embedded development broker: noida-db's Kafka service, run as a child process.

Used by ``decider broker``, ``decider demo`` and the test fixture, so the start/stop rules live here once.
noida-db's ``noida-db`` console script is a Python wrapper that runs the real binary as a child and does
not forward signals, so killing the wrapper would leave the broker running: we run the binary shipped
inside the ``noida_db`` package directly and stop it by its PID.

The broker never outlives the process that started it, however that process ends:
- a clean stop (``stop()``, the context manager) sends SIGTERM, then SIGKILL, and deletes a temporary data dir;
- on Linux the kernel sends the broker SIGTERM when its parent dies (``PR_SET_PDEATHSIG``), SIGKILL included;
- a ``worker.devbroker.reaper`` process, which outlives a SIGKILL of ours, then makes sure the broker is gone (SIGKILL after
  a grace period; on other systems it is the only guard) and deletes the temporary data dir.

Durability: noida-db is a development broker, not crash-durable. After ``kill -9`` of the broker and a restart on
the same data dir it has lost records whose produce it had acknowledged; a clean stop keeps them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import IO

from worker.exceptions import ConfigError, FatalError
from worker.ops.ports import in_use_message, port_open
from worker.devbroker.processes import dies_with_this_thread, end_process
from worker.devbroker.reaper import Reaper


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


@dataclass
class EmbeddedBroker:
    """One noida-db Kafka process. Use as a context manager, or call ``start()`` / ``stop()``.

    ``data_dir`` None means a fresh temporary directory, deleted on stop (or by the reaper, if this process
    is killed). ``log`` receives the broker's stdout/stderr (which include a harmless GLIBC version warning);
    None discards them.
    """

    port: int = 9092
    data_dir: str | None = None
    log: IO | None = None
    process: subprocess.Popen | None = field(default=None, init=False)
    _own_dir: str | None = field(default=None, init=False)
    _reaper: Reaper | None = field(default=None, init=False)

    @property
    def bootstrap(self) -> str:
        """The bootstrap servers string clients connect to."""
        return f"127.0.0.1:{self.port}"

    @property
    def data_path(self) -> str | None:
        """The directory the running broker keeps its data in."""
        return self.data_dir or self._own_dir

    def start(self, timeout_s: float = 20.0) -> "EmbeddedBroker":
        """Start the broker and wait until it accepts Kafka connections."""
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"--port {self.port}: ports are 1 to 65535")
        if port_open(self.port):
            raise ConfigError(in_use_message(self.port, "--port"))
        if self.data_dir is None:
            self._own_dir = tempfile.mkdtemp(prefix="decider-broker-")
        try:
            Path(self.data_path).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self.stop()
            raise ConfigError(f"--data-dir {self.data_path}: cannot use it as a directory ({exc.strerror})") from None
        command = [str(broker_binary()), "start", "--only", "kafka", "--kafka-port", str(self.port), "--data-dir", self.data_path]
        sink = self.log if self.log is not None else subprocess.DEVNULL
        # Its own session: a Ctrl-C in the terminal reaches us, and we decide when the broker stops.
        self.process = subprocess.Popen(command, stdout=sink, stderr=sink, stdin=subprocess.DEVNULL, start_new_session=True,
                                        preexec_fn=dies_with_this_thread())
        self._reaper = Reaper([self.process.pid], [self._own_dir] if self._own_dir else [])
        try:
            self._wait_listening(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_listening(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not port_open(self.port):
            if self.process.poll() is not None:
                raise FatalError(f"the embedded broker exited with code {self.process.returncode} "
                                 f"before listening on {self.port}")
            if time.monotonic() > deadline:
                raise FatalError(f"the embedded broker did not listen on port {self.port} within {timeout_s:.0f} s")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the broker, as a crash would; a given ``data_dir`` stays for a ``start()`` (noida-db may have
        lost acknowledged records in it: see the module's docstring)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if self.data_dir is not None:
            self.stop()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the broker process by PID (SIGTERM, then SIGKILL) and delete a temporary data dir."""
        if self.process is not None:
            end_process(self.process, signal.SIGTERM, timeout_s)
        self.process = None
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
            self._own_dir = None
        if self._reaper is not None:
            self._reaper.release()
            self._reaper = None

    def __enter__(self) -> "EmbeddedBroker":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
