"""The health endpoint under real probes: a client that hangs up before its answer (a kubelet probe past its
``timeoutSeconds`` does this under load) is not an error, and leaves no traceback on the worker's stderr."""

from __future__ import annotations

import socket
import struct
import time
import urllib.request

from worker.devbroker.processes import free_port
from worker.ops.health import Health, serve


class _SlowHealth(Health):
    """Answers /readyz only after the probe below has given up and closed its socket."""

    def status(self) -> tuple[bool, str]:
        time.sleep(0.3)
        return super().status()


def _probe_that_hangs_up(port: int, path: str) -> None:
    """Send the request, then close at once with a reset (SO_LINGER 0), before reading anything."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as probe:
        probe.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def test_a_probe_that_hangs_up_leaves_no_traceback(capfd):
    port = free_port()
    server = serve(port, _SlowHealth())
    try:
        for path in ("/readyz", "/metrics", "/healthz", "/readyz", "/readyz"):
            _probe_that_hangs_up(port, path)
        time.sleep(1.0)  # every slow answer has been written to a closed socket by now
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
            assert response.status == 200  # the server still answers the next probe
    finally:
        server.shutdown()
    stderr = capfd.readouterr().err
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr and "ConnectionResetError" not in stderr, stderr
