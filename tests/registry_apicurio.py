"""A real Schema Registry for the tests: Apicurio Registry 3.3.3 (in-memory storage), through its Confluent-compatible
API (``/apis/ccompat/v7``), which confluent-kafka's ``SchemaRegistryClient`` and serdes speak.

Confluent's own registry is not served from Maven Central; Apicurio's ``apicurio-registry-app`` ``-all.tar.gz`` is
(a Quarkus application: ``quarkus-run.jar`` beside its ``lib/``). It needs Java 21 or newer: the ``java`` on PATH if
it is, else the newest JDK under ``/usr/lib/jvm`` (``DECIDER_REGISTRY_JAVA`` names one). ``dev/setup.sh`` fetches it
into ``~/.cache/decider/apicurio-3.3.3`` (``DECIDER_APICURIO_HOME``) with Maven, as it does Kafka's jars;
``python -m tests.registry_apicurio fetch`` is that step alone.

Measured here (2 cores, loaded): ready in ~18 s, ~240 MB resident.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator, Mapping

from worker.devbroker.processes import cache_home, dies_with_this_thread, end_process, free_port
from worker.devbroker.reaper import Reaper

APICURIO_VERSION = "3.3.3"
ARTIFACT = f"io.apicurio:apicurio-registry-app:{APICURIO_VERSION}:tar.gz:all"
HOME_ENV, JAVA_ENV = "DECIDER_APICURIO_HOME", "DECIDER_REGISTRY_JAVA"
MIN_JAVA = 21  # its classes are Java 21's (class file version 65)
CCOMPAT = "/apis/ccompat/v7"


def apicurio_home(environ: Mapping[str, str] = os.environ) -> Path:
    """Where the registry is unpacked: ``$DECIDER_APICURIO_HOME``, else ``~/.cache/decider/apicurio-3.3.3``."""
    return cache_home(f"apicurio-{APICURIO_VERSION}", HOME_ENV, environ)


def _java_major(java: str) -> int:
    try:
        version = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30).stderr
    except (OSError, subprocess.TimeoutExpired):
        return 0
    found = re.search(r'version "(\d+)', version)
    return int(found.group(1)) if found else 0


def registry_java(environ: Mapping[str, str] = os.environ) -> str | None:
    """A ``java`` of version 21 or newer: the one named, the one on PATH, else the newest under /usr/lib/jvm."""
    candidates = [environ.get(JAVA_ENV), shutil.which("java")]
    candidates += sorted((str(path) for path in Path("/usr/lib/jvm").glob("*/bin/java")), reverse=True)
    good = [java for java in candidates if java and _java_major(java) >= MIN_JAVA]
    return max(good, key=_java_major) if good else None


def problem() -> str | None:
    """Why the registry cannot start here (None if it can), in one line."""
    if registry_java() is None:
        return f"no Java {MIN_JAVA}+ for Apicurio Registry (set {JAVA_ENV})"
    if not (apicurio_home() / "quarkus-run.jar").is_file():
        return f"Apicurio Registry {APICURIO_VERSION} is not in {apicurio_home()} (bash dev/setup.sh fetches it)"
    return None


def fetch() -> Path:
    """Unpack the registry into ``apicurio_home()`` (Maven fetches the tarball the first time)."""
    home = apicurio_home()
    if (home / "quarkus-run.jar").is_file():
        return home
    home.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=home.parent) as scratch:
        command = ["mvn", "-q", "-B", "dependency:copy", f"-Dartifact={ARTIFACT}", f"-DoutputDirectory={scratch}"]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"Maven could not fetch {ARTIFACT}:\n{(result.stdout + result.stderr)[-2000:]}")
        unpacked = Path(scratch) / "app"
        with tarfile.open(next(Path(scratch).glob("*.tar.gz"))) as archive:
            archive.extractall(unpacked, filter="data")
        shutil.rmtree(home, ignore_errors=True)
        unpacked.rename(home)
    return home


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/subjects", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


@contextlib.contextmanager
def apicurio_process(log_path: Path, timeout_s: float = 180.0) -> Iterator[str]:
    """Apicurio Registry on a free loopback port for the ``with`` block; yields its Confluent-compatible URL.
    Its in-memory store starts empty each time. Its log goes to ``log_path``, and a failed start names it."""
    why = problem()
    if why is not None:
        raise RuntimeError(why)
    port = free_port()
    # Its management interface (health, metrics) is fixed at build time to be on, at 0.0.0.0:9000: a free loopback
    # port instead, so that two registries (or anything on 9000) do not collide.
    command = [registry_java(), "-Xmx384m", "-XX:+UseSerialGC", f"-Dquarkus.http.port={port}",
               "-Dquarkus.http.host=127.0.0.1", "-Dquarkus.management.host=127.0.0.1",
               f"-Dquarkus.management.port={free_port()}",
               "-Dquarkus.banner.enabled=false", "-jar", str(apicurio_home() / "quarkus-run.jar")]
    url = f"http://127.0.0.1:{port}{CCOMPAT}"
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   cwd=apicurio_home(), start_new_session=True, preexec_fn=dies_with_this_thread())
    reaper = Reaper([process.pid], [])
    try:
        deadline = time.monotonic() + timeout_s
        while not _answers(url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Apicurio Registry did not answer on {url} within {timeout_s:.0f} s "
                                   f"(exit code {process.poll()}); its log: {log_path}")
            time.sleep(0.25)
        yield url
    finally:
        end_process(process, timeout_s=20)
        reaper.release()


if __name__ == "__main__":
    if sys.argv[1:] != ["fetch"]:
        sys.exit("usage: python -m tests.registry_apicurio fetch")
    print(f"Apicurio Registry {APICURIO_VERSION}: {fetch()}")
