"""A TEST DOUBLE of Confluent Schema Registry, for tests whose workers run as subprocesses (where the
client's in-process ``mock://`` registry cannot be shared). It is not a registry for users: they run the
real one (``docker-compose.yml``: ``confluentinc/cp-schema-registry``).

It answers the REST calls confluent-kafka's ``SchemaRegistryClient`` makes for what decider does
(register, lookup, get by id, versions, latest, compatibility test, config), with the registry's error
codes, keeps everything in memory, and binds to 127.0.0.1 on a free port, in a thread (``RegistryDouble``) or a child process
(``registry_double_process``, for worker subprocesses across a session). Registering
checks BACKWARD compatibility against the subject's latest version (the registry's default) with the
Apache Avro library's reader/writer rules, the rules the registry itself applies. Optional basic auth
(``users={"name": "password"}``) answers 401 to a wrong or missing ``Authorization`` header.

    with RegistryDouble() as registry:
        client = SchemaRegistryClient({"url": registry.url})
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator
from urllib.parse import parse_qs, unquote, urlsplit

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"
COMPATIBILITY_LEVELS = ("NONE", "BACKWARD", "BACKWARD_TRANSITIVE", "FORWARD", "FORWARD_TRANSITIVE", "FULL", "FULL_TRANSITIVE")


class RegistryError(Exception):
    """An error answer: HTTP status, the registry's error code, a message."""

    def __init__(self, status: int, code: int, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def avro_compatibility_problems(reader: str, writer: str) -> list[str]:
    """Why data written with ``writer`` cannot be read with ``reader`` (Avro's resolution rules); [] if it can."""
    import avro.compatibility
    import avro.schema

    result = avro.compatibility.ReaderWriterCompatibilityChecker().get_compatibility(
        avro.schema.parse(reader), avro.schema.parse(writer))
    if result.compatibility is avro.compatibility.SchemaCompatibilityType.compatible:
        return []
    return sorted(result.messages) + [f"at {', '.join(sorted(result.locations))}"]


class RegistryState:
    """Subjects, versions and ids; every method raises ``RegistryError`` as the registry would answer."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.schemas: dict[int, str] = {}  # id -> schema text as first registered
        self.ids_by_canonical: dict[str, int] = {}
        self.subjects: dict[str, list[int]] = {}  # subject -> schema id per version (version = index + 1)
        self.compatibility = "BACKWARD"
        self.subject_compatibility: dict[str, str] = {}

    @staticmethod
    def canonical(schema: str) -> str:
        try:
            return json.dumps(json.loads(schema), sort_keys=True, separators=(",", ":"))
        except ValueError:
            raise RegistryError(422, 42201, "Invalid schema: not JSON") from None

    def register(self, subject: str, schema: str) -> int:
        canonical = self.canonical(schema)
        try:
            import avro.schema

            avro.schema.parse(schema)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the registry's 42201
            raise RegistryError(422, 42201, f"Invalid schema: {exc}") from None
        with self.lock:
            versions = self.subjects.get(subject, [])
            known = self.ids_by_canonical.get(canonical)
            if known is not None and known in versions:
                return known
            if versions:
                self._check_compatible(subject, schema, versions)
            schema_id = known if known is not None else max(self.schemas, default=0) + 1
            self.schemas[schema_id] = schema
            self.ids_by_canonical[canonical] = schema_id
            self.subjects.setdefault(subject, []).append(schema_id)
            return schema_id

    def _check_compatible(self, subject: str, schema: str, versions: list[int]) -> None:
        level = self.subject_compatibility.get(subject, self.compatibility)
        if level == "NONE":
            return
        against = versions if level.endswith("TRANSITIVE") else versions[-1:]
        problems = []
        for old in (self.schemas[i] for i in against):
            if level.startswith(("BACKWARD", "FULL")):
                problems += avro_compatibility_problems(schema, old)
            if level.startswith(("FORWARD", "FULL")):
                problems += avro_compatibility_problems(old, schema)
        if problems:
            raise RegistryError(409, 409, f"Schema being registered is incompatible with an earlier schema for subject "
                                          f"\"{subject}\", details: {problems}")

    def lookup(self, subject: str, schema: str) -> dict[str, Any]:
        canonical = self.canonical(schema)
        with self.lock:
            versions = self._versions(subject)
            schema_id = self.ids_by_canonical.get(canonical)
            if schema_id not in versions:
                raise RegistryError(404, 40403, "Schema not found")
            return self._version_answer(subject, versions.index(schema_id) + 1)

    def by_id(self, schema_id: int) -> dict[str, Any]:
        with self.lock:
            if schema_id not in self.schemas:
                raise RegistryError(404, 40403, "Schema not found")
            return {"schema": self.schemas[schema_id]}

    def version(self, subject: str, version: str) -> dict[str, Any]:
        with self.lock:
            versions = self._versions(subject)
            number = len(versions) if version in ("latest", "-1") else int(version)
            if not 1 <= number <= len(versions):
                raise RegistryError(404, 40402, "Version not found.")
            return self._version_answer(subject, number)

    def _versions(self, subject: str) -> list[int]:
        if subject not in self.subjects:
            raise RegistryError(404, 40401, f"Subject '{subject}' not found.")
        return self.subjects[subject]

    def _version_answer(self, subject: str, number: int) -> dict[str, Any]:
        schema_id = self.subjects[subject][number - 1]
        return {"subject": subject, "version": number, "id": schema_id, "schema": self.schemas[schema_id]}

    def test_compatibility(self, subject: str, version: str, schema: str) -> bool:
        with self.lock:
            if subject not in self.subjects:
                return True
            try:
                self._check_compatible(subject, schema, self.subjects[subject][-1:] if version == "latest"
                                       else [self.subjects[subject][int(version) - 1]])
            except RegistryError:
                return False
            return True


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: tests read assertions, not access logs
        pass

    def do_GET(self) -> None:
        self._answer("GET")

    def do_POST(self) -> None:
        self._answer("POST")

    def do_PUT(self) -> None:
        self._answer("PUT")

    def do_DELETE(self) -> None:
        self._answer("DELETE")

    def _answer(self, method: str) -> None:
        url = urlsplit(self.path)
        path, query = unquote(url.path).strip("/"), parse_qs(url.query)
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else {}
        self.server.requests.append((method, path))
        try:
            self._check_auth()
            status, answer = 200, route(self.server.state, method, path, query, body)
        except RegistryError as exc:
            status, answer = exc.status, {"error_code": exc.code, "message": exc.message}
        payload = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _check_auth(self) -> None:
        if not self.server.users:
            return
        header = self.headers.get("Authorization", "")
        if header.startswith("Basic "):
            user, _, password = base64.b64decode(header[6:]).decode().partition(":")
            if self.server.users.get(user) == password:
                return
        raise RegistryError(401, 401, "Unauthorized")


def route(state: RegistryState, method: str, path: str, query: dict[str, list[str]], body: dict[str, Any]) -> Any:
    """The answer to one REST call (the subset of the registry's API the client uses for decider)."""
    if body.get("schemaType", "AVRO") != "AVRO":
        raise RegistryError(422, 42201, "this test double speaks AVRO only")
    routes = [
        ("POST", r"subjects/(?P<s>[^/]+)/versions", lambda m: {"id": state.register(m["s"], body["schema"])}),
        ("POST", r"subjects/(?P<s>[^/]+)", lambda m: state.lookup(m["s"], body["schema"])),
        ("GET", r"schemas/ids/(?P<id>\d+)", lambda m: state.by_id(int(m["id"]))),
        ("GET", r"subjects/(?P<s>[^/]+)/versions/(?P<v>latest|-?\d+)", lambda m: state.version(m["s"], m["v"])),
        ("GET", r"subjects/(?P<s>[^/]+)/versions", lambda m: list(range(1, len(state._versions(m["s"])) + 1))),
        ("GET", r"subjects", lambda m: sorted(state.subjects)),
        ("DELETE", r"subjects/(?P<s>[^/]+)", lambda m: _delete(state, m["s"])),
        ("POST", r"compatibility/subjects/(?P<s>[^/]+)/versions/(?P<v>latest|\d+)",
         lambda m: {"is_compatible": state.test_compatibility(m["s"], m["v"], body["schema"])}),
        ("GET", r"config", lambda m: {"compatibilityLevel": state.compatibility}),
        ("GET", r"config/(?P<s>[^/]+)", lambda m: {"compatibilityLevel": state.subject_compatibility.get(m["s"], state.compatibility)}),
        ("PUT", r"config", lambda m: _set_level(state, None, body)),
        ("PUT", r"config/(?P<s>[^/]+)", lambda m: _set_level(state, m["s"], body)),
    ]
    for verb, pattern, handle in routes:
        match = re.fullmatch(pattern, path)
        if verb == method and match:
            return handle(match.groupdict())
    raise RegistryError(404, 404, f"HTTP 404 Not Found: {method} /{path} (not implemented by the test double)")


def _delete(state: RegistryState, subject: str) -> list[int]:
    with state.lock:
        versions = state._versions(subject)
        del state.subjects[subject]
        return list(range(1, len(versions) + 1))


def _set_level(state: RegistryState, subject: str | None, body: dict[str, Any]) -> dict[str, str]:
    level = str(body.get("compatibility", "")).upper()
    if level not in COMPATIBILITY_LEVELS:
        raise RegistryError(422, 42203, f"Invalid compatibility level {level!r}")
    if subject is None:
        state.compatibility = level
    else:
        state.subject_compatibility[subject] = level
    return {"compatibility": level}


class _Server(ThreadingHTTPServer):
    # Handlers answer HTTP/1.0 (one request per connection), so stop() can join them all: no thread of the
    # double outlives its ``with`` block in the test process.
    daemon_threads = False
    block_on_close = True

    def __init__(self, users: dict[str, str] | None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.state = RegistryState()
        self.users = dict(users or {})
        self.requests: list[tuple[str, str]] = []


class RegistryDouble:
    """The test double, serving in a thread of this process; ``url`` once started, ``requests`` lists calls seen."""

    def __init__(self, users: dict[str, str] | None = None) -> None:
        self._server = _Server(users)
        self._thread = threading.Thread(target=self._server.serve_forever, name="registry-double", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def state(self) -> RegistryState:
        return self._server.state

    @property
    def requests(self) -> list[tuple[str, str]]:
        return self._server.requests

    def start(self) -> "RegistryDouble":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> "RegistryDouble":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def registry_double_process() -> Iterator[str]:
    """The double in a child process (``python -m tests.registry_double``), for a whole test session: its URL.

    A child keeps the double's threads out of the test process (some tests watch that process's garbage
    collector); it is stopped by its PID when the block ends."""
    child = subprocess.Popen([sys.executable, "-m", "tests.registry_double"], cwd=Path(__file__).resolve().parents[1],
                             stdout=subprocess.PIPE, text=True)
    try:
        url = child.stdout.readline().strip()
        if not url.startswith("http://"):
            raise RuntimeError(f"the registry test double did not start (exit code {child.wait(10)})")
        yield url
    finally:
        child.terminate()
        child.wait(10)
        child.stdout.close()


def main() -> None:
    """``python -m tests.registry_double``: serve until SIGTERM or Ctrl-C, after printing the URL."""
    double = RegistryDouble().start()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(double.url, flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        double.stop()


if __name__ == "__main__":
    main()
