"""The package's layout rule (docs/architecture.md), read from the imports of its modules:
every import statement, at load time or inside a function (or under ``TYPE_CHECKING``),
is an edge of the package's import graph. The graph has no cycle, and no module imports
from a layer above its own: ``shared/``, ``store``, ``callbacks`` and ``decoding`` at the
bottom; ``worker/``, ``horovod/`` and ``distributed`` (code on the ranks) above them;
``driver/`` above those; the public fronts that drive a fit or a run on top. ``driver/``
imports ``worker/`` only for the entry points it runs or ships to tasks."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "spark_estimator"
NAME = "spark_estimator"

# the worker modules the driver hands to Spark jobs (or, for the loss probe, runs itself)
ENTRY_POINTS = {
    f"{NAME}.worker.job": "the function of every barrier job's tasks",
    f"{NAME}.worker.task": "a fit's task",
    f"{NAME}.worker.run_task": "a task of run(fn)",
    f"{NAME}.worker.predict": "transform's mapInArrow function",
    f"{NAME}.worker.data.parquet_writer": "materialize's mapInArrow function",
    f"{NAME}.worker.data.table_stats": "the in-place checks' mapInArrow function",
    f"{NAME}.worker.loop.loss": "the loss the probe batch runs (LossFailed)",
    f"{NAME}.worker.loop.probe": "the loss on the driver's probe batch",
}

# The layers, lowest first: a module imports from its own layer and those below. Each
# entry is a folder of the package, a top-level module, or "" for the package itself.
LAYERS = [
    # plain data and helpers both sides use; the store and the callbacks, built on the
    # driver and run on the ranks; the helpers of a decode_fn
    {"shared", "store", "callbacks", "decoding"},
    # code on the ranks: the tasks, and the APIs of code on the ranks (Horovod's, run(fn)'s)
    {"worker", "horovod", "distributed"},
    # the driver process's machinery
    {"driver"},
    # the public fronts that drive a fit, a transform, a run or a tuning study (or log and
    # serve a fitted model: mlflow, pyfunc), and the package's lazy names
    # (spark_estimator.TorchEstimator, ...)
    {
        "estimator",
        "lightning_estimator",
        "model",
        "runner",
        "launcher",
        "mlflow",
        "pyfunc",
        "tuning",
        "",
    },
]
# the imports from a lower layer to a higher one there are, each with its reason
UPWARD = {
    # hvd.run, Horovod's launcher (horovod.run), runs on the driver and calls run(); it
    # imports it when called, so that the ranks' ``import spark_estimator.horovod`` does not
    (f"{NAME}.horovod.launch", f"{NAME}.runner"): "hvd.run, on the driver",
}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = modules()


def _target(name: str) -> str | None:
    """The package module ``name`` is, or lies in (``a.b.Class`` -> ``a.b``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> set[str]:
    """The package modules ``module``'s import statements name, wherever they are: at load
    time, in functions, under ``if TYPE_CHECKING:``. ``from p import n`` names the module
    ``p.n`` where there is one, else ``p`` (where ``n`` is defined)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found.update(t for t in map(_target, names) if t and t != module)
    return found


def _packages(module: str) -> set[str]:
    """The packages above ``module``, whose ``__init__`` runs before it."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def dependencies(module: str) -> set[str]:
    """What loading ``module``'s imports runs: the modules it imports and the packages
    above them (not its own, which have run before it)."""
    found = imports(module)
    found |= {p for t in found for p in _packages(t)} - _packages(module) - {module}
    return found


def graph() -> dict[str, set[str]]:
    return {m: dependencies(m) for m in MODULES}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``edges``: its strongly connected components (modules that
    reach each other), each sorted."""
    reach = {}
    for start in edges:
        seen, todo = set(), list(edges[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(edges.get(m, ()))
        reach[start] = seen
    components = {
        frozenset({m} | {t for t in reach[m] if m in reach.get(t, ())})
        for m in edges
        if m in reach[m]
    }
    return sorted(sorted(c) for c in components)


def in_folder(module: str, folder: str) -> bool:
    return module.startswith(f"{NAME}.{folder}.") or module == f"{NAME}.{folder}"


def _top(module: str) -> str:
    """``module``'s folder or name under the package ("" for the package itself)."""
    return module.removeprefix(NAME).removeprefix(".").split(".")[0]


def layer(module: str) -> int:
    """The index in LAYERS of ``module``'s layer."""
    (found,) = [i for i, names in enumerate(LAYERS) if _top(module) in names]
    return found


def test_every_module_has_one_layer():
    placed = [name for names in LAYERS for name in names]
    assert len(placed) == len(set(placed))
    assert [m for m in MODULES if _top(m) not in placed] == [], "place it in LAYERS"


def test_no_module_imports_from_a_layer_above_its_own():
    """So ``worker/`` and ``horovod/`` (on the ranks) never import ``driver/`` or the
    fronts, ``shared/`` imports neither side, and ``driver/`` never the fronts."""
    found = {(m, t) for m in MODULES for t in imports(m) if layer(t) > layer(m)}
    assert found - set(UPWARD) == set(), "an import from a lower layer to a higher one"
    assert set(UPWARD) - found == set(), "gone: take it out of UPWARD"


def test_the_package_has_no_import_cycle():
    found = {
        " <-> ".join(c): sorted((m, t) for m in c for t in dependencies(m) if t in c)
        for c in cycles(graph())
    }
    assert found == {}


def test_the_driver_imports_worker_code_only_for_the_entry_points_of_its_jobs():
    crossing = {
        (m, t)
        for m in MODULES
        if in_folder(m, "driver")
        for t in imports(m)
        if in_folder(t, "worker") and t not in ENTRY_POINTS
    }
    assert crossing == set()
    used = {t for m in MODULES if not in_folder(m, "worker") for t in imports(m)}
    assert set(ENTRY_POINTS) <= used, "an entry point nothing outside worker/ uses"


def test_the_horovod_api_builds_on_its_ground_floor():
    """``horovod.core`` (rank information, reduce ops) imports nothing of ``horovod/``;
    the others import it, not each other, for those."""
    core = f"{NAME}.horovod.core"
    assert not any(in_folder(t, "horovod") for t in imports(core))
    assert f"{NAME}.worker.comm.rendezvous" in imports(core)
    for module in ("basics", "process_sets", "joined", "collectives"):
        assert core in imports(f"{NAME}.horovod.{module}")


def test_the_rule_sees_imports():
    """The walk finds relative, absolute, in-function and TYPE_CHECKING imports, and the
    cycle and layer checks find what they look for (else the rules above pass vacuously)."""
    assert f"{NAME}.worker.task" in imports(f"{NAME}.driver.training_job")
    assert f"{NAME}.horovod.joined" in imports(f"{NAME}.horovod.collectives")
    assert f"{NAME}.runner" in imports(f"{NAME}.horovod.launch")  # in a function
    assert f"{NAME}.worker.comm.fsdp" in imports(f"{NAME}.distributed")  # in a function
    assert f"{NAME}.estimator" in imports(NAME)  # under TYPE_CHECKING
    assert {f"{NAME}.worker", f"{NAME}.worker.comm"} <= dependencies(f"{NAME}.horovod.core")
    assert f"{NAME}.horovod" not in dependencies(f"{NAME}.horovod.core")
    assert cycles({"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": set(), "e": {"e"}}) == [
        ["a", "b", "c"],
        ["e"],
    ]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert layer(f"{NAME}.shared.spec") < layer(f"{NAME}.horovod.core") < layer(NAME)
    assert layer(f"{NAME}.worker.task") < layer(f"{NAME}.driver.fit") < layer(f"{NAME}.model")
