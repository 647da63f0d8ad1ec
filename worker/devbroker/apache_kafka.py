"""Apache Kafka 4.4, pinned, as a single-node KRaft broker+controller run as a child process.

The real broker behind the test suite, the benches and ``decider broker --kafka``. Its jars come from Maven
Central through ``worker/devbroker/kafka/pom.xml`` (``kafka_2.13`` 4.4.0 and a log4j2 binding): ``resolve_kafka``
runs Maven once and keeps the runtime classpath in a cache directory (``DECIDER_KAFKA_HOME``, default
``~/.cache/decider/kafka-4.4.0``); ``dev/setup.sh`` does that on a fresh machine. It needs Java 17 or newer.

``ApacheKafka`` formats a fresh log directory (``kafka.tools.StorageTool format --standalone``), starts
``kafka.Kafka`` on free loopback ports with one-node settings (internal topics of one partition and replication 1,
no initial rebalance delay, the consumer protocol's session and heartbeat minimums lowered so that tests can move
a killed worker's partitions in seconds, a small heap), waits until an Admin metadata call answers, and stops it
cleanly (SIGTERM: a controlled shutdown). ``kill()`` is a SIGKILL that keeps the directory, and ``start()`` on an
existing directory restarts on the same log: Kafka writes every acknowledged record to its log before it answers,
so a process kill loses nothing the page cache holds (a power cut is another matter: one node, no replicas).

The broker never outlives the process that started it: as for the embedded broker, the kernel sends it SIGTERM
when the starting thread dies, and a ``worker.devbroker.reaper`` process stops it if we are SIGKILLed. A broker
that fails to start keeps its directory, and the error names its log.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Mapping

from worker.devbroker.processes import cache_home, dies_with_this_thread, end_process, free_port
from worker.devbroker.reaper import Reaper
from worker.exceptions import ConfigError, FatalError
from worker.ops.ports import in_use_message, port_open

KAFKA_VERSION = "4.4.0"
HOME_ENV = "DECIDER_KAFKA_HOME"
MIN_JAVA = 17  # Kafka 4's broker runs on Java 17 and newer
_BROKER_JAR = f"kafka_2.13-{KAFKA_VERSION}.jar"
_READY_LINE = "Kafka Server started"


def kafka_home(environ: Mapping[str, str] = os.environ) -> Path:
    """Where the broker's jars are kept: ``$DECIDER_KAFKA_HOME``, else ``$XDG_CACHE_HOME/decider/kafka-4.4.0``."""
    return cache_home(f"kafka-{KAFKA_VERSION}", HOME_ENV, environ)


def java_problem() -> str | None:
    """Why this machine cannot run the broker's JVM (None if it can): no ``java``, or one older than 17."""
    java = shutil.which("java")
    if java is None:
        return "no java on PATH (Apache Kafka needs Java 17 or newer)"
    try:
        version = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30).stderr
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{java} -version failed ({exc})"
    found = re.search(r'version "(\d+)(?:\.(\d+))?', version)
    if found is None:
        return f"cannot tell the version of {java}: {version.strip().splitlines()[:1]}"
    major = int(found.group(1)) if found.group(1) != "1" else int(found.group(2) or 0)  # "1.8.0" is Java 8
    return None if major >= MIN_JAVA else f"{java} is Java {major}; Apache Kafka {KAFKA_VERSION} needs {MIN_JAVA} or newer"


def installed(home: Path | None = None) -> bool:
    """Whether the pinned broker's jars are in ``home`` (default ``kafka_home()``)."""
    return ((home or kafka_home()) / "libs" / _BROKER_JAR).is_file()


def kafka_problem(home: Path | None = None) -> str | None:
    """Why ``ApacheKafka`` cannot start here (None if it can), in one line that says the fix."""
    problem = java_problem()
    if problem is None and not installed(home):
        problem = (f"Apache Kafka {KAFKA_VERSION}'s jars are not in {home or kafka_home()} "
                   f"(bash dev/setup.sh, or decider broker --kafka, fetches them with Maven)")
    return problem


def resolve_kafka(home: Path | None = None, quiet: bool = True) -> Path:
    """The directory holding the broker's runtime classpath, fetched with Maven from the packaged pom the first time.

    Maven builds in a scratch copy of the pom (the installed package may be read-only) and the classpath moves into
    place whole, so an interrupted fetch leaves no half-filled cache."""
    home = home or kafka_home()
    libs = home / "libs"
    if installed(home):
        return libs
    if shutil.which("mvn") is None:
        raise ConfigError(f"fetching Apache Kafka {KAFKA_VERSION} needs Apache Maven (mvn) on PATH, and Java {MIN_JAVA}+")
    home.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix="build-", dir=home))
    try:
        shutil.copy(str(files("worker.devbroker").joinpath("kafka/pom.xml")), build / "pom.xml")
        command = ["mvn", "-B", *(["-q"] if quiet else []), "-f", str(build / "pom.xml"), "package"]
        result = subprocess.run(command, capture_output=quiet, text=True)
        if result.returncode != 0:
            tail = "\n".join(((result.stdout or "") + (result.stderr or "")).strip().splitlines()[-15:])
            raise FatalError(f"Maven could not fetch Apache Kafka {KAFKA_VERSION} (exit {result.returncode}):\n{tail}")
        shutil.rmtree(libs, ignore_errors=True)
        (build / "target" / "libs").rename(libs)
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return libs


def cluster_id() -> str:
    """A fresh KRaft cluster id: a random UUID, base64url without padding, never starting with '-' (an option to the
    command line that takes it), as Kafka's own ``Uuid.randomUuid`` makes them."""
    while True:
        candidate = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not candidate.startswith("-"):
            return candidate


def server_properties(port: int, controller_port: int, log_dir: Path, overrides: Mapping[str, str] = {}) -> dict[str, str]:
    """One node as broker and controller on 127.0.0.1, with what a single node needs to run transactions."""
    settings = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.bootstrap.servers": f"127.0.0.1:{controller_port}",
        "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "log.dirs": str(log_dir),
        # One node: the internal topics cannot be replicated, and transactions need their state log. One partition
        # each, so that the first group or transaction does not wait for 50 partitions to be created.
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "transaction.state.log.num.partitions": "1",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "group.initial.rebalance.delay.ms": "0",
        # KIP-848's consumer protocol: the broker owns the session timeout (45 s by default, and no less than 45 s
        # unless lowered here). Tests move a killed worker's partitions after 6 s, as --session-timeout-ms 6000 does
        # on the classic protocol.
        "group.consumer.min.session.timeout.ms": "6000",
        "group.consumer.session.timeout.ms": "6000",
        "group.consumer.min.heartbeat.interval.ms": "1000",
        "group.consumer.heartbeat.interval.ms": "1000",
        # After a SIGKILL the controller fences the killed incarnation's registration once its session times out:
        # sooner than the default 9 s, so that a restart settles before clients have much to retry.
        "broker.session.timeout.ms": "3000",
        "broker.heartbeat.interval.ms": "500",
        # Topics are decider's to create, with their partition counts and cleanup policies.
        "auto.create.topics.enable": "false",
        "num.partitions": "1",
    }
    settings.update(overrides)
    return settings


GC_FLAGS = {
    # Kafka's own choice (kafka-run-class.sh). Its young collections stop the broker: on the H100 machine's capacity
    # run EQ every ~2.7 s for 10.6 ms (p50; up to 26), a stall inside the transactions of a 25 ms budget
    "g1": (["-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20"], "gc"),
    # ZGC collects concurrently: under a worker-like load on this project's CPU machine its pauses were at most 0.06 ms
    # (Java 17) and 0.03 ms (Java 25, generational), G1's 15 ms at the median (bench/probes/broker_gc_probe.py;
    # bench/README.md, "The broker's collector"). Its pauses are logged by gc+phases
    "zgc": (["-XX:+UseZGC"], "gc,gc+phases"),
}
"""The broker JVM's collector flags and the log tags that put each pause on a line of the broker's log
(``bench.tail_causes.broker_pauses`` reads them), by ``ApacheKafka.gc``."""


@dataclass
class ApacheKafka:
    """One Apache Kafka broker+controller process. Use as a context manager, or call ``start()`` / ``stop()``.

    ``directory`` None means a fresh temporary directory, deleted on a clean stop. It holds ``server.properties``,
    ``server.log`` (the broker's output) and ``data/`` (the log). ``port`` and ``controller_port`` 0 mean free
    ones, chosen once, so that a restart listens where clients already look. ``settings`` override
    ``server_properties``'s. ``cpus`` confines the broker to that many of this machine's cores (None: all of them).
    ``gc`` is the JVM's collector, a key of ``GC_FLAGS``.
    """

    port: int = 0
    controller_port: int = 0
    directory: str | None = None
    heap_mb: int = 512
    cpus: int | None = None
    gc: str = "zgc"
    settings: Mapping[str, str] = field(default_factory=dict)
    home: Path | None = None
    process: subprocess.Popen | None = field(default=None, init=False)
    _own_dir: str | None = field(default=None, init=False)
    _reapers: list[Reaper] = field(default_factory=list, init=False)
    _log: object = field(default=None, init=False)

    @property
    def bootstrap(self) -> str:
        """The bootstrap servers string clients connect to."""
        return f"127.0.0.1:{self.port}"

    @property
    def path(self) -> Path:
        """The broker's directory (properties, ``server.log``, ``data/``)."""
        return Path(self.directory or self._own_dir)

    @property
    def log_path(self) -> Path:
        """The broker's own log (its stdout and stderr)."""
        return self.path / "server.log"

    def __post_init__(self) -> None:
        if self.gc not in GC_FLAGS:
            raise ValueError(f"the broker's gc must be one of {', '.join(GC_FLAGS)}, not {self.gc!r}")

    def start(self, timeout_s: float = 90.0) -> "ApacheKafka":
        """Format the log directory if it is new, start the broker, and wait until an Admin metadata call answers."""
        problem = kafka_problem(self.home)
        if problem is not None:
            raise ConfigError(problem)
        self.port, self.controller_port = self.port or free_port(), self.controller_port or free_port()
        for port in (self.port, self.controller_port):
            if port_open(port):
                raise ConfigError(in_use_message(port, "--port"))
        if self.directory is None and self._own_dir is None:
            self._own_dir = tempfile.mkdtemp(prefix="decider-kafka-")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--data-dir {self.path}: cannot use it as a directory ({exc.strerror})") from None
        properties = self._write_properties()
        if not (self.path / "data" / "meta.properties").is_file():
            self._format(properties)
        log_start = self.log_path.stat().st_size if self.log_path.is_file() else 0
        self._launch(properties)
        try:
            self._wait_ready(timeout_s, log_start)
        except BaseException:
            self._halt(signal.SIGKILL)
            if self._own_dir is not None:  # its directory goes with the reaper: the log stays, beside it
                shutil.copy(self.log_path, f"{self._own_dir}.log")
            self._release_reapers()
            raise
        return self

    def _classpath(self) -> str:
        return str((self.home or kafka_home()) / "libs" / "*")

    def _write_properties(self) -> Path:
        properties = self.path / "server.properties"
        settings = server_properties(self.port, self.controller_port, self.path / "data", self.settings)
        properties.write_text("".join(f"{key}={value}\n" for key, value in settings.items()))
        return properties

    def _format(self, properties: Path) -> None:
        command = ["java", "-cp", self._classpath(), "kafka.tools.StorageTool", "format", "--standalone",
                   f"--cluster-id={cluster_id()}", "-c", str(properties)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        with open(self.log_path, "a") as log:
            log.write(result.stdout + result.stderr)
        if result.returncode != 0:
            raise FatalError(f"formatting Kafka's log directory {self.path / 'data'} failed (exit {result.returncode}); "
                             f"see {self.log_path}")

    def _launch(self, properties: Path) -> None:
        log_config = files("worker.devbroker").joinpath("kafka/log4j2.yaml")
        # Each collection's pause on a line of the broker's log: a stall of the clients' broker calls is then told
        # apart from one of their own (on the GPU machine, transactions slowed for ~10 ms every ~1.5 s at 1,250 states/s)
        flags, tags = GC_FLAGS[self.gc]
        command = ["java", f"-Xms{self.heap_mb}m", f"-Xmx{self.heap_mb}m", *flags,
                   f"-Xlog:{tags}:stdout:utctime", *self._cpu_flags(), "-Djava.awt.headless=true",
                   f"-Dlog4j2.configurationFile={log_config}", "-cp", self._classpath(), "kafka.Kafka", str(properties)]
        self._log = open(self.log_path, "ab")
        # Its own session: a Ctrl-C in the terminal reaches us, and we decide when the broker stops.
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True, preexec_fn=self._in_child())
        self._reapers.append(Reaper([self.process.pid], [self._own_dir] if self._own_dir else []))

    def _cpu_flags(self) -> list[str]:
        """The JVM sized as if it had ``cpus`` processors (its GC and JIT threads; None: all of this machine's). A
        broker beside the worker otherwise runs its collections on every core: G1 with ~13 parallel threads on a
        16-core GPU machine, a pause every ~1.5 s at 1,250 states/s, while the worker's threads waited for a core."""
        return [] if self.cpus is None else [f"-XX:ActiveProcessorCount={self.cpus}"]

    def _in_child(self):
        """What the broker's process does before it runs Java: die with the thread that started it, and with ``cpus``
        run on the last ``cpus`` of this process's cores only (set before the JVM starts, so every thread of it
        inherits them), as a broker on a machine of its own would leave the rest to the clients."""
        dies = dies_with_this_thread()
        if self.cpus is None:
            return dies
        cores = set(sorted(os.sched_getaffinity(0))[-self.cpus:])

        def in_child() -> None:
            dies()
            os.sched_setaffinity(0, cores)
        return in_child

    def _started_since(self, log_start: int) -> bool:
        """Whether the log holds this start's 'Kafka Server started' line (past ``log_start`` bytes: earlier starts on
        the same directory wrote theirs before)."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(log_start)
                return _READY_LINE.encode() in log.read()
        except OSError:
            return False

    def _wait_ready(self, timeout_s: float, log_start: int) -> None:
        """Until this start's 'Kafka Server started' line and an Admin metadata answer. The line matters after a
        SIGKILL: the restarted node answers metadata while its controller still holds the killed incarnation's
        broker registration, which it fences some seconds later (every partition leaderless for a moment, the
        group coordinator unloaded and loaded again); the line comes after that."""
        from confluent_kafka.admin import AdminClient

        deadline = time.monotonic() + timeout_s
        while not port_open(self.port) or not self._started_since(log_start):
            self._check_running(deadline, timeout_s)
            time.sleep(0.1)
        admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})
        while True:
            self._check_running(deadline, timeout_s)
            try:
                if admin.list_topics(timeout=2).brokers:
                    return
            except Exception:  # noqa: BLE001 - KafkaException while the broker is still starting
                time.sleep(0.1)

    def _check_running(self, deadline: float, timeout_s: float) -> None:
        if self.process.poll() is not None:
            raise FatalError(f"Apache Kafka exited with code {self.process.returncode} before answering on "
                             f"{self.bootstrap}; its log: {self._kept_log()}\n{self.log_tail()}")
        if time.monotonic() > deadline:
            raise FatalError(f"Apache Kafka did not answer on {self.bootstrap} within {timeout_s:.0f} s; "
                             f"its log: {self._kept_log()}\n{self.log_tail()}")

    def _kept_log(self) -> str:
        return f"{self._own_dir}.log" if self._own_dir is not None else str(self.log_path)

    def log_tail(self, lines: int = 12) -> str:
        """The last lines of the broker's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the broker, as a crash would: no controlled shutdown; the directory stays for a ``start()``."""
        self._halt(signal.SIGKILL)

    def stop(self, timeout_s: float = 30.0) -> None:
        """A controlled shutdown (SIGTERM, then SIGKILL after ``timeout_s``); a temporary directory is deleted."""
        self._halt(signal.SIGTERM, timeout_s)
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
            self._own_dir = None
        self._release_reapers()

    def _halt(self, signum: int, timeout_s: float = 30.0) -> None:
        if self.process is not None:
            end_process(self.process, signum, timeout_s)
        self.process = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def _release_reapers(self) -> None:
        while self._reapers:  # one a start: a kill() and start() leave the first waiting for the process's exit
            self._reapers.pop().release()

    def __enter__(self) -> "ApacheKafka":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def main(argv: list[str]) -> int:
    """``python -m worker.devbroker.apache_kafka fetch``: resolve the jars (``dev/setup.sh`` runs it); exit 3 with
    one line where Java or Maven is missing."""
    if argv != ["fetch"]:
        print("usage: python -m worker.devbroker.apache_kafka fetch", file=sys.stderr)
        return 2
    problem = java_problem()
    if problem is None and shutil.which("mvn") is None:
        problem = "no mvn on PATH (Apache Maven fetches the broker's jars from Maven Central)"
    if problem is not None:
        print(f"Apache Kafka {KAFKA_VERSION} not fetched: {problem}", file=sys.stderr)
        return 3
    print(f"Apache Kafka {KAFKA_VERSION}: {resolve_kafka(quiet=True)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
