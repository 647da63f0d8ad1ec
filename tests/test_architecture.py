"""The layering, checked on the source with ``ast`` (imports inside functions count too):
- ``engine/`` imports nothing of Kafka, the worker or the Avro contracts;
- no import cycle among the project's modules (``engine``, ``worker``, ``schemas``);
- no production module reads a test-only environment variable (a key naming TEST, FAULT or INJECT)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "worker", "schemas")
TEST_ONLY_ENV = re.compile(r"TEST|FAULT|INJECT", re.IGNORECASE)


def _modules() -> dict[str, Path]:
    """Every module of the production packages, by dotted name."""
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Names ``name`` imports, resolved to absolute dotted names, wherever the import statement is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # `from worker.stream import loop` imports worker.stream.loop
    return names


def _project_edges() -> dict[str, set[str]]:
    """Module -> the project modules it imports (an imported name inside a module counts as that module)."""
    edges = {}
    for name, path in MODULES.items():
        targets = set()
        for imported in _imports(name, path):
            while imported and imported not in MODULES:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        edges[name] = targets
    return edges


def test_the_module_list_is_the_project():
    assert {"engine", "engine.schema_engine", "worker.stream.loop", "worker.cli.app", "schemas"} <= set(MODULES)


def test_engine_imports_nothing_of_kafka_the_worker_or_the_contracts():
    offenders = {name: sorted(i for i in _imports(name, path) if i.split(".")[0] in ("worker", "confluent_kafka", "schemas", "fastavro"))
                 for name, path in MODULES.items() if name.split(".")[0] == "engine"}
    assert {name: found for name, found in offenders.items() if found} == {}


def test_no_import_cycle_among_the_projects_modules():
    edges = _project_edges()
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for target in sorted(edges[node]):
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target, stack + [target])
        state[node] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    # A package's __init__ re-exporting its modules is not a cycle of the modules themselves.
    cycles = [c for c in cycles if not any(m in PACKAGES for m in c)]
    assert cycles == []


def _environment_keys(tree: ast.AST) -> list[str]:
    """Environment variable names a module reads: keys of ``os.environ[...]``, ``os.environ.get/setdefault/pop(...)``
    and ``os.getenv(...)``, and typer/click options' ``envvar=``; a key held in a module-level string constant counts."""
    constants = {target.id: node.value.value for node in getattr(tree, "body", []) if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                 for target in node.targets if isinstance(target, ast.Name)}

    def value(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        return constants.get(node.id) if isinstance(node, ast.Name) else None

    keys = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and _is_environ(node.value):
            keys.append(value(node.slice))
        elif isinstance(node, ast.Call):
            func = node.func
            reads = (isinstance(func, ast.Attribute) and func.attr in ("get", "setdefault", "pop") and _is_environ(func.value)) \
                or (isinstance(func, ast.Attribute) and func.attr == "getenv") or (isinstance(func, ast.Name) and func.id == "getenv")
            if reads and node.args:
                keys.append(value(node.args[0]))
            keys.extend(value(k.value) for k in node.keywords if k.arg == "envvar")
    return [k for k in keys if k is not None]


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (isinstance(node, ast.Name) and node.id in ("environ", "env"))


def test_no_production_module_reads_a_test_only_environment_variable():
    read = {name: _environment_keys(ast.parse(path.read_text(encoding="utf-8"))) for name, path in MODULES.items()}
    assert any(read.values()), "the scan finds no environment read at all: it is broken"
    assert {name: [k for k in keys if TEST_ONLY_ENV.search(k)] for name, keys in read.items()
            if any(TEST_ONLY_ENV.search(k) for k in keys)} == {}


def test_the_checks_catch_what_they_look_for(tmp_path):
    """The scanners themselves: an engine import of Kafka and test-only variables, however they are read, are found."""
    source = ("import os\nimport typer\nfrom confluent_kafka import Consumer\nFAULT_ENV = 'DECIDER_FAULT_INJECT_SCORING'\n\n"
              "def f(environ):\n    a = os.environ.get(FAULT_ENV)\n    b = environ['DECIDER_TEST_MODE']\n"
              "    return typer.Option(None, envvar='DECIDER_INJECT_X'), os.getenv('HOME')\n")
    keys = _environment_keys(ast.parse(source))
    assert sorted(keys) == ["DECIDER_FAULT_INJECT_SCORING", "DECIDER_INJECT_X", "DECIDER_TEST_MODE", "HOME"]
    assert [k for k in keys if TEST_ONLY_ENV.search(k)] == ["DECIDER_FAULT_INJECT_SCORING", "DECIDER_TEST_MODE", "DECIDER_INJECT_X"]
    path = tmp_path / "m.py"
    path.write_text(source)
    assert "confluent_kafka.Consumer" in _imports("engine.m", path)
