"""``decider broker`` (the embedded broker) and ``decider broker --kafka`` (Apache Kafka): the broker it starts dies
with it, however it is stopped, and leaves no temporary data dir; a taken port is reported with what holds it."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import brokers
from worker.devbroker.processes import free_port

REPO = Path(__file__).resolve().parents[3]
KINDS = [pytest.param([], id="embedded"),
         pytest.param(["--kafka"], id="kafka", marks=pytest.mark.skipif(
             brokers.kafka_problem() is not None and not os.environ.get("CI"), reason=str(brokers.kafka_problem())))]


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting to be reaped is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False


def _start_broker_command(tmp_path: Path, own_group: bool, kind: list[str]) -> tuple[subprocess.Popen, int, Path]:
    """Run ``decider broker`` with its temporary dirs under ``tmp_path``; -> (command, broker pid, temp root)."""
    temp_root = tmp_path / "tmp"
    temp_root.mkdir()
    env = {**os.environ, "TMPDIR": str(temp_root)}
    command = subprocess.Popen([sys.executable, "-m", "worker", "broker", *kind, "--port", str(free_port())], cwd=REPO, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=own_group)
    banner = command.stdout.readline()
    match = re.search(r"\(pid (\d+)\) listening", banner)
    assert match, (banner, command.stderr.read() if command.poll() is not None else "")
    broker_pid = int(match.group(1))
    assert _running(broker_pid) and len(list(temp_root.iterdir())) == 1
    return command, broker_pid, temp_root


def _wait_until(condition, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGKILL", "SIGKILL to the process group"])
def test_stopping_the_command_stops_the_broker_and_deletes_its_data(tmp_path, how, kind):
    own_group = how.endswith("group")
    command, broker_pid, temp_root = _start_broker_command(tmp_path, own_group, kind)
    try:
        if own_group:
            os.killpg(command.pid, signal.SIGKILL)
        else:
            command.send_signal(getattr(signal, how))
        returncode = command.wait(40)
        assert returncode == (-signal.SIGKILL if how.startswith("SIGKILL") else 0), command.stderr.read()
        assert _wait_until(lambda: not _running(broker_pid), 30), f"broker pid {broker_pid} outlived the command ({how})"
        assert _wait_until(lambda: not any(temp_root.iterdir()), 30), list(temp_root.iterdir())
    finally:
        if _running(broker_pid):
            os.kill(broker_pid, signal.SIGKILL)
        if command.poll() is None:
            command.kill()


@pytest.mark.parametrize("kind", KINDS)
def test_a_taken_port_names_the_process_holding_it(tmp_path, kind):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "worker", "broker", *kind, "--port", str(port)], cwd=REPO,
                                env={**os.environ, "TMPDIR": str(tmp_path)}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"port {port} is already in use by pid {os.getpid()} (" in lines[0], result.stderr
    assert "--port" in lines[0] and not list(tmp_path.iterdir())


@pytest.mark.parametrize("kind", KINDS)
def test_a_data_dir_that_cannot_be_one_is_one_line(tmp_path, kind):
    (tmp_path / "a-file").write_text("")
    result = subprocess.run([sys.executable, "-m", "worker", "broker", *kind, "--port", str(free_port()), "--data-dir",
                             str(tmp_path / "a-file")], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip() == f"error: --data-dir {tmp_path / 'a-file'}: cannot use it as a directory (File exists)"
