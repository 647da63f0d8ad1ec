"""A TCP proxy that delays every Kafka request and response by D ms: a slower broker, for the benchmarks only.

    python -m bench.latency_proxy --upstream 127.0.0.1:9092 --listen 127.0.0.3:19092 --delay-ms 2 [--stats FILE]

Clients given ``--listen`` as their bootstrap reach the broker only through the proxy, D ms each way (a round trip
costs 2D more), which is what a replicated cluster in one zone adds to every produce, offset commit and transaction
step. A broker tells its clients where to connect in its Metadata, FindCoordinator and DescribeCluster responses (its
own bound address): the proxy rewrites that address to its own in those responses, so that no connection goes around
it. The rewrite replaces the host string and port in place; the listen host must be as long as the upstream host
(``127.0.0.1`` -> ``127.0.0.3``), so no frame changes size.

Frames are delayed, not bytes: each whole frame is held until D after its last byte arrived, then sent, in order, so
that pipelined requests keep flowing (a delay, not a bandwidth cap). With ``--stats`` the proxy writes, when it is
stopped (SIGTERM), the frames it forwarded and the delay it actually added (p50/p99/max), so that a report can show
the D that was applied rather than the one asked for.
"""
from __future__ import annotations

import argparse
import json
import queue
import signal
import socket
import struct
import sys
import threading
import time
from pathlib import Path

# Kafka api keys whose responses carry broker addresses: Metadata, FindCoordinator, DescribeCluster.
ADDRESS_APIS = {3, 10, 60}
_FRAME_HEADER = struct.Struct(">i")


def host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def address_bytes(host: str, port: int) -> bytes:
    """How a broker address stands in a response: the host string's bytes followed by the port as an int32."""
    return host.encode() + struct.pack(">i", port)


class Frames:
    """Cuts a byte stream into Kafka frames (int32 size, then that many bytes)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        frames = []
        while len(self._buffer) >= 4:
            size = _FRAME_HEADER.unpack_from(self._buffer)[0]
            if len(self._buffer) < 4 + size:
                break
            frames.append(bytes(self._buffer[:4 + size]))
            del self._buffer[:4 + size]
        return frames


class DelayStats:
    """The delay each forwarded frame actually got, across all connections."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.delays_ms: list[float] = []
        self.rewrites = 0

    def add(self, delay_ms: float) -> None:
        with self._lock:
            self.delays_ms.append(delay_ms)

    def summary(self, asked_ms: float) -> dict:
        with self._lock:
            delays = sorted(self.delays_ms)
        pick = lambda q: round(delays[int(q * (len(delays) - 1))], 3) if delays else None  # noqa: E731
        return dict(delay_ms=asked_ms, frames=len(delays), added_p50_ms=pick(0.5), added_p99_ms=pick(0.99),
                    added_max_ms=pick(1.0), address_rewrites=self.rewrites)


class Direction(threading.Thread):
    """One direction of one connection: read frames from ``source``, send each to ``sink`` ``delay_s`` after it came.

    Requests (``requests`` None) note each frame's correlation id and api key in ``api_of``; responses look theirs up
    there and get their broker address rewritten (``rewrite``) when their api carries one."""

    def __init__(self, source: socket.socket, sink: socket.socket, delay_s: float, stats: DelayStats,
                 api_of: dict[int, int], is_request: bool, rewrite: tuple[bytes, bytes]) -> None:
        super().__init__(daemon=True)
        self.source, self.sink, self.delay_s, self.stats = source, sink, delay_s, stats
        self.api_of, self.is_request, self.rewrite = api_of, is_request, rewrite
        self._due: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send, daemon=True)

    def run(self) -> None:
        self._sender.start()
        frames = Frames()
        try:
            while data := self.source.recv(1 << 20):
                arrived = time.perf_counter()
                for frame in frames.feed(data):
                    self._due.put((arrived + self.delay_s, arrived, self._rewritten(frame)))
        except OSError:
            pass
        self._due.put(None)

    def _rewritten(self, frame: bytes) -> bytes:
        if self.is_request:
            api_key, correlation = struct.unpack_from(">h", frame, 4)[0], struct.unpack_from(">i", frame, 8)[0]
            self.api_of[correlation] = api_key
            return frame
        correlation = struct.unpack_from(">i", frame, 4)[0]
        if self.api_of.pop(correlation, None) in ADDRESS_APIS and self.rewrite[0] in frame:
            self.stats.rewrites += 1
            return frame.replace(*self.rewrite)
        return frame

    def _send(self) -> None:
        try:
            while (item := self._due.get()) is not None:
                due, arrived, frame = item
                wait = due - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                self.sink.sendall(frame)
                self.stats.add((time.perf_counter() - arrived) * 1000)
        except OSError:
            pass
        for sock in (self.sink, self.source):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def serve(listen: tuple[str, int], upstream: tuple[str, int], delay_ms: float, stats: DelayStats,
          ready: threading.Event | None = None) -> None:
    """Accept clients on ``listen`` and proxy each to ``upstream`` with ``delay_ms`` each way, until the process ends."""
    if len(listen[0]) != len(upstream[0]):
        raise SystemExit(f"latency_proxy: the listen host {listen[0]!r} must be as long as the upstream host "
                         f"{upstream[0]!r} (the broker's address is rewritten in place)")
    rewrite = (address_bytes(*upstream), address_bytes(*listen))
    server = socket.create_server(listen)
    if ready is not None:
        ready.set()
    while True:
        client, _ = server.accept()
        broker = socket.create_connection(upstream)
        for sock in (client, broker):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        api_of: dict[int, int] = {}
        Direction(client, broker, delay_ms / 1000, stats, api_of, True, rewrite).start()
        Direction(broker, client, delay_ms / 1000, stats, api_of, False, rewrite).start()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upstream", required=True, help="the broker, HOST:PORT")
    ap.add_argument("--listen", required=True, help="HOST:PORT to accept clients on (host as long as the upstream's)")
    ap.add_argument("--delay-ms", type=float, required=True, help="added to each request and each response")
    ap.add_argument("--stats", help="write the delays actually added here (JSON) when stopped")
    args = ap.parse_args(argv)
    stats = DelayStats()

    def stop(*_):
        if args.stats:
            Path(args.stats).write_text(json.dumps(stats.summary(args.delay_ms)))
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"latency_proxy: {args.listen} -> {args.upstream}, +{args.delay_ms} ms each way", flush=True)
    serve(host_port(args.listen), host_port(args.upstream), args.delay_ms, stats)


if __name__ == "__main__":
    main()
