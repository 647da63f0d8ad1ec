"""The engine package's layering: it imports nothing of Kafka, the worker or the Avro schemas, and no engine module
imports another that imports it back (directly or through others), at module level or inside a function."""
import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "engine"
FORBIDDEN = ("worker", "confluent_kafka", "schemas", "fastavro")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _graph() -> dict[str, set[str]]:
    mods = {f"engine.{p.stem}": _imports(p) for p in ENGINE.glob("*.py") if p.stem != "__init__"}
    return {m: {i for i in imps if i in mods} for m, imps in mods.items()}


def test_engine_imports_nothing_of_kafka_worker_or_schemas():
    for p in ENGINE.glob("*.py"):
        bad = {i for i in _imports(p) if i.split(".")[0] in FORBIDDEN}
        assert not bad, f"{p.name} imports {sorted(bad)}"


def test_no_import_cycle_among_engine_modules():
    graph = _graph()

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph[start]:
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cycles = sorted(m for m in graph if reaches(m, m, {m}))
    assert not cycles, f"modules on an import cycle: {cycles}"


def test_the_cycle_check_sees_a_cycle():
    graph = _graph()
    assert "engine.kernels" in graph["engine.model"]        # the check reads imports at all
