"""The worker's HTTP endpoint on --metrics-port: Prometheus ``/metrics``, liveness ``/healthz``, readiness ``/readyz``.

Readiness follows the loop's events: ready once the topics were checked, the model loaded and the schema
table caught up (the ``schemas_loaded`` event, which the loop emits only after the other two); not ready
again once the loop stops; and not ready while the broker is unreachable or a commit is stuck
(``worker.ops.liveness``), since then nothing the worker consumes can commit. Liveness answers 503 once a Kafka call
overran its own timeout: the transaction watchdog then ends the process (exit 5) unless the call returns.
"""

from __future__ import annotations

import errno
import logging
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from worker.ops import liveness
from worker.exceptions import ConfigError
from worker.ops.ports import in_use_message

_LOG = logging.getLogger("decider.health")

class Health:
    """Readiness state, updated from the worker's events (``on_event``) and read by the HTTP handler."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ready = False
        self.reason = "starting: checking topics, loading the model and the schema table"

    def on_event(self, kind: str, info: dict[str, Any]) -> None:
        """Sink for ``Worker(on_event=...)``."""
        with self._lock:
            if kind == "model_loaded":
                self.reason = "starting: model loaded, reading the schema table"
            elif kind == "schemas_loaded":
                self.ready, self.reason = True, "ready"
            elif kind == "stopped":
                self.ready, self.reason = False, "stopping"

    def status(self) -> tuple[bool, str]:
        """(ready, why) at this moment."""
        with self._lock:
            ready, reason = self.ready, self.reason
        problem = (liveness.BROKER.readiness_problem() or liveness.PROGRESS.readiness_problem()) if ready else None
        return (False, problem) if problem else (ready, reason)

    @staticmethod
    def alive() -> tuple[bool, str]:
        """(alive, why): not alive once the process is about to be ended by the watchdog."""
        problem = liveness.BROKER.liveness_problem()
        return (False, problem) if problem else (True, "ok")


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        """A client that hung up before its answer (a probe past its own timeout) is not an error: a debug line,
        not socketserver's traceback on stderr."""
        error = sys.exc_info()[1]
        if isinstance(error, ConnectionError):  # BrokenPipeError, ConnectionResetError, ConnectionAbortedError
            _LOG.debug("health client %s went away before its answer: %s", client_address, error)
        else:
            super().handle_error(request, client_address)


class _IPv6Server(_Server):
    address_family = socket.AF_INET6


def serve(port: int, health: Health, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """Serve the three paths on ``host:port`` from a daemon thread; returns the server (``shutdown()`` stops it).

    The default host answers this machine only; a scraper elsewhere (another container) needs ``0.0.0.0``.
    ``ConfigError`` when the address cannot be bound (taken port, unknown host), naming what to change."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                alive, reason = health.alive()
                self._reply(200 if alive else 503, reason.encode() + b"\n")
            elif path == "/readyz":
                ready, reason = health.status()
                self._reply(200 if ready else 503, reason.encode() + b"\n")
            else:
                self._reply(404, b"not found: /metrics, /healthz or /readyz\n")

        def _reply(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # scrapes every few seconds would flood the worker's log
            pass

    server_class = _IPv6Server if ":" in host else _Server
    try:
        server = server_class((host, port), Handler)
    except OverflowError:
        raise ConfigError(f"--metrics-port {port}: ports are 1 to 65535") from None
    except OSError as exc:
        raise ConfigError(_bind_problem(host, port, exc)) from None
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="decider-http", daemon=True).start()
    return server


def _bind_problem(host: str, port: int, error: OSError) -> str:
    if error.errno == errno.EADDRINUSE:
        return in_use_message(port, "--metrics-port")
    if error.errno == errno.EACCES:
        return f"--metrics-port {port}: permission denied (ports below 1024 need privileges); pick a port above 1023"
    if isinstance(error, socket.gaierror) or error.errno == errno.EADDRNOTAVAIL:
        return (f"--metrics-host {host!r}: not an address of this machine ({error.strerror}); "
                "use 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)")
    return f"--metrics-host {host} --metrics-port {port}: cannot listen there: {error.strerror or error}"
