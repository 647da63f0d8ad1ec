"""The layering, checked on the source with ``ast`` (imports inside functions count too):
- ``engine/`` imports nothing of Kafka, the worker or the Avro contracts;
- each layered package's wings import one way: a module imports from its own wing or a lower one (``LAYERS``):
  ``worker/``'s wings (``WORKER_LAYERS``); ``engine/``'s kernel wing below the model, prompt, prefix bank, graphs and
  scoring, with the bucket sizes below both and the kernel table on top of the wing (``ENGINE_LAYERS``); ``bench/``'s
  benchmarks below its probes (``BENCH_LAYERS``);
- nothing outside the engine reaches into its kernel wing;
- no import cycle among the project's modules (``engine``, ``worker``, ``schemas``, ``bench``, ``tests``), a name a
  package re-exports counting as an import of the module that defines it;
- no module (production, benchmark or test) is longer than ``MAX_MODULE_LINES``;
- no production module reads a test-only environment variable (a key naming TEST, FAULT or INJECT)."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "worker", "schemas")
"""The production packages."""
EVERY_PACKAGE = (*PACKAGES, "bench", "tests")
"""Every package of the repository's Python: the production ones, the benchmarks and the tests."""
TEST_ONLY_ENV = re.compile(r"TEST|FAULT|INJECT", re.IGNORECASE)
MAX_MODULE_LINES = 400

WORKER_LAYERS = (
    "worker.exceptions",     # the error types every wing raises
    "worker.ops",            # metrics, liveness, health endpoint, logs, ports: every wing above reports here
    "worker.config_file",    # the TOML file and secret redaction (the registry's settings are redacted by it)
    "worker.formats",        # record types, input mapping, output formats, the Schema Registry client
    "worker.config",         # the frozen configuration: it holds the input mapping and the registry's settings
    "worker.kafka_clients",  # client settings (reporting to liveness and metrics) and topic admin
    "worker.stream",         # the loop, its steps, replay
    "worker.devbroker",      # the embedded development broker: only the CLI starts it
    "worker.cli",            # the command line
    "worker.__main__",       # python -m worker
)
"""``worker/``'s wings and top-level modules, bottom to top (a module or a package and everything in it)."""

ENGINE_LAYERS = (
    "engine.errors",         # the error types every wing raises
    "engine.buckets",        # the bucket sizes: the graph manager captures them, the kernel table checks GEMMs at them
    "engine.kernels",        # the kernel wing: one module per table and per kernel family
    "engine.kernels.table",  # the kernel table and its selector: the wing's one way in from above
    "engine",                # the model, prompt, prefix bank, graphs and scoring, and the package's API
)
"""``engine/``'s wings, bottom to top; a module belongs to the longest that names it (``engine.kernels.table`` is not
in ``engine.kernels``'s wing, ``engine.model`` is in ``engine``'s)."""

BENCH_LAYERS = (
    "bench",                 # the benchmarks a user runs, and the helpers they share
    "bench.probes",          # one-off probes of the workshop: they may use the benchmarks' helpers, never the reverse
)
"""``bench/``'s wings, bottom to top."""

LAYERS = {"worker": WORKER_LAYERS, "engine": ENGINE_LAYERS, "bench": BENCH_LAYERS}
"""The layered packages and their wings."""


def _modules(root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Every module of ``packages`` (the production ones unless told) under ``root``, by dotted name."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()
EVERY_MODULE = _modules(packages=EVERY_PACKAGE)


def _absolute(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from ... import`` statement in ``package`` names, relative imports made absolute."""
    if not node.level:
        return node.module or ""
    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(anchor + ([node.module] if node.module else []))


@functools.lru_cache(maxsize=None)
def _imported(name: str, path: Path, top_level_only: bool = False) -> tuple[tuple[str, str | None, str], ...]:
    """What module ``name`` (at ``path``) imports, wherever the statement is (``top_level_only``: only at the
    top of the module): ``(module, None, bound)`` for ``import module`` and ``(module, imported, bound)`` for
    ``from module import imported``, with the name each binds."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in (tree.body if top_level_only else ast.walk(tree)):
        if isinstance(node, ast.Import):
            found.extend((alias.name, None, alias.asname or alias.name.partition(".")[0]) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            found.extend((base, alias.name, alias.asname or alias.name) for alias in node.names)
    return tuple(found)     # parsed once per module: the checks ask for the same modules' imports again and again


def _imports(name: str, path: Path) -> set[str]:
    """Names ``name`` imports, resolved to absolute dotted names, wherever the import statement is."""
    imported = _imported(name, path)
    # `from worker.stream import loop` imports worker.stream.loop
    return {module for module, _, _ in imported} | {f"{module}.{n}" for module, n, _ in imported if n}


def _defining_module(modules: dict[str, Path], module: str, name: str, seen: frozenset[str] = frozenset()) -> str:
    """Where ``from module import name`` takes ``name`` from: the module ``module.name`` if there is one; else, where
    ``module`` re-exports ``name`` (``engine/__init__.py``'s ``from engine.schema_engine import SchemaEngine``), the
    module it comes from, followed on; else ``module`` itself."""
    if f"{module}.{name}" in modules:
        return f"{module}.{name}"
    if module in modules and module not in seen:
        for source, imported, bound in _imported(module, modules[module], top_level_only=True):
            if bound == name:
                return source if imported is None else _defining_module(modules, source, imported, seen | {module})
    return module


def _project_edges(modules: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """Module -> the project modules it imports: a name imported from a module counts as the module that defines it."""
    modules = MODULES if modules is None else modules
    edges = {}
    for name, path in modules.items():
        targets = set()
        for module, imported, _ in _imported(name, path):
            target = module if imported is None else _defining_module(modules, module, imported)
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
        edges[name] = targets
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles a depth-first walk of ``edges`` finds, each as its path back to where it started."""
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for target in sorted(edges.get(node, ())):
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target, stack + [target])
        state[node] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    return cycles


def _layer(module: str) -> int | None:
    """The index in its package's ``LAYERS`` of the wing ``module`` belongs to (the longest that names it); None
    outside them (``worker`` itself, a package without wings)."""
    layers = LAYERS.get(module.partition(".")[0], ())
    named = [i for i, layer in enumerate(layers) if module == layer or module.startswith(layer + ".")]
    return max(named, key=lambda i: len(layers[i])) if named else None


def _back_edges(edges: dict[str, set[str]]) -> list[str]:
    """Imports from one wing of a layered package to a higher wing of the same package."""
    return sorted(f"{module} -> {target}" for module, targets in edges.items() for target in targets
                  if module.partition(".")[0] == target.partition(".")[0]
                  and _layer(module) is not None and _layer(target) is not None and _layer(target) > _layer(module))


def test_the_module_list_is_the_project():
    assert {"engine", "engine.schema_engine", "engine.kernels.table", "worker.stream.loop", "worker.cli.app",
            "schemas"} <= set(MODULES)
    assert {"bench.stream_bench", "bench.probes.kernel_probe", "tests.test_architecture"} <= set(EVERY_MODULE)


def test_engine_imports_nothing_of_kafka_the_worker_or_the_contracts():
    offenders = {name: sorted(i for i in _imports(name, path) if i.split(".")[0] in ("worker", "confluent_kafka", "schemas", "fastavro"))
                 for name, path in MODULES.items() if name.split(".")[0] == "engine"}
    assert {name: found for name, found in offenders.items() if found} == {}


def test_every_module_of_a_layered_package_is_in_a_layer():
    assert [name for name in EVERY_MODULE if name.partition(".")[0] in LAYERS and "." in name
            and _layer(name) is None] == []


def test_the_wings_import_one_way():
    assert _back_edges(_project_edges(EVERY_MODULE)) == []


def test_nothing_outside_the_engine_reaches_into_its_kernel_wing():
    """The worker (and the contracts) use the engine's API; the kernel table is the engine's to choose."""
    edges = _project_edges(MODULES)
    assert sorted(f"{module} -> {target}" for module, targets in edges.items()
                  if module.partition(".")[0] != "engine"
                  for target in targets if target.startswith("engine.kernels")) == []


def test_no_import_cycle_among_the_projects_modules():
    assert _cycles(_project_edges(EVERY_MODULE)) == []


def test_no_module_is_longer_than_the_limit():
    lengths = {name: len(path.read_text(encoding="utf-8").splitlines()) for name, path in EVERY_MODULE.items()}
    assert {name: n for name, n in lengths.items() if n > MAX_MODULE_LINES} == {}


def _write(root: Path, files: dict[str, str]) -> None:
    for relative, source in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(source)


def test_the_wing_check_catches_an_import_up_the_layers(tmp_path):
    """Imports up the layers are found, at the top of a module or inside a function; the CLI starting the development
    broker is not one."""
    _write(tmp_path, {
        "worker/__init__.py": "",
        "worker/cli/app.py": "def main():\n    pass\n",
        "worker/cli/demo.py": "from worker.devbroker.embedded_broker import EmbeddedBroker\n",
        "worker/devbroker/embedded_broker.py": "class EmbeddedBroker:\n    pass\n",
        "worker/stream/loop.py": "def run():\n    from worker.cli.app import main\n",
        "worker/stream/batcher.py": "from worker.formats import records\n",
        "worker/stream/replay.py": "from worker.devbroker.embedded_broker import EmbeddedBroker\n",
        "worker/formats/records.py": "from worker.stream.batcher import Cycle\n",
    })
    assert _back_edges(_project_edges(_modules(tmp_path, ("worker",)))) == [
        "worker.formats.records -> worker.stream.batcher", "worker.stream.loop -> worker.cli.app",
        "worker.stream.replay -> worker.devbroker.embedded_broker"]


def test_the_wing_check_catches_an_import_up_the_engines_and_benchs_layers(tmp_path):
    """A kernel importing the graph manager or the kernel table, and a benchmark importing a probe, are imports up the
    layers; the table importing a kernel family, the graph manager the bucket sizes, a probe a benchmark's helper and
    the model the table are not."""
    _write(tmp_path, {
        "engine/__init__.py": "from engine.schema_engine import SchemaEngine as SchemaEngine\n",
        "engine/schema_engine.py": "from engine.graphs import GraphManager\n\nclass SchemaEngine:\n    pass\n",
        "engine/graphs.py": "from engine import buckets\n\nclass GraphManager:\n    pass\n",
        "engine/buckets.py": "B_BUCKETS = (1, 2)\n",
        "engine/model.py": "from engine.kernels.table import select_kernels\n",
        "engine/kernels/__init__.py": "",
        "engine/kernels/table.py": "from engine.kernels import fused\n\ndef select_kernels():\n    pass\n",
        "engine/kernels/fused.py": "def rows():\n    from engine.graphs import GraphManager\n",
        "engine/kernels/cuda_fast.py": ("from engine import SchemaEngine\n"
                                        "from engine.kernels.table import select_kernels\n"),
        "engine/kernels/cuda_deterministic.py": "from engine.buckets import B_BUCKETS\n",
        "bench/__init__.py": "",
        "bench/stream_bench.py": "from bench.probes.kernel_probe import gpu_ms\n",
        "bench/engine_bench.py": "def timed():\n    pass\n",
        "bench/probes/__init__.py": "",
        "bench/probes/kernel_probe.py": "from bench.engine_bench import timed\n\ndef gpu_ms():\n    pass\n",
    })
    assert _back_edges(_project_edges(_modules(tmp_path, ("engine", "bench")))) == [
        "bench.stream_bench -> bench.probes.kernel_probe", "engine.kernels.cuda_fast -> engine.kernels.table",
        "engine.kernels.cuda_fast -> engine.schema_engine", "engine.kernels.fused -> engine.graphs"]


def test_the_cycle_check_follows_a_packages_re_exports(tmp_path):
    """``from pkg import Thing``, where ``pkg/__init__.py`` re-exports ``Thing`` from ``pkg.core``, is an import of
    ``pkg.core``: a module that ``pkg.core`` imports closes a cycle with it (as ``from engine import SchemaEngine`` in
    ``engine/prompt.py`` would). Importing a submodule through its package is not an import of the package."""
    _write(tmp_path, {
        "pkg/__init__.py": "from pkg.core import Thing as Thing\n",
        "pkg/core.py": "from pkg.helper import helps\n\nclass Thing:\n    pass\n",
        "pkg/helper.py": "def helps():\n    from pkg import Thing\n",
        "pkg/leaf.py": "from pkg import helper\n",
    })
    edges = _project_edges(_modules(tmp_path, ("pkg",)))
    assert edges == {"pkg": {"pkg.core"}, "pkg.core": {"pkg.helper"}, "pkg.helper": {"pkg.core"}, "pkg.leaf": {"pkg.helper"}}
    assert _cycles(edges) == [["pkg.core", "pkg.helper", "pkg.core"]]


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
