"""The package's layout rule (docs/architecture.md), read from the imports of its modules:
``worker/`` (and ``horovod/``, the API for code on the ranks) runs in Spark tasks and never
imports ``driver/`` or the public fronts that drive a fit; ``driver/`` imports ``worker/``
only for the entry points it runs or ships to tasks; ``shared/`` imports neither; no two
modules import each other at load time, directly or through others."""

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
    f"{NAME}.worker.loop.loss": "the loss the probe batch runs (LossFailed)",
    f"{NAME}.worker.loop.probe": "the loss on the driver's probe batch",
}
# public fronts of the driver side: a task has no use for them
DRIVER_FRONTS = {f"{NAME}.{m}" for m in ("estimator", "lightning_estimator", "model", "runner")}


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


def _type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def imports(module: str, load_time_only: bool = False) -> set[str]:
    """The package modules ``module`` imports (at load time only: not inside functions or
    ``if TYPE_CHECKING:``)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and load_time_only:
                continue
            if isinstance(node, ast.If) and load_time_only and _type_checking(node):
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                visit(ast.iter_child_nodes(node))
                continue
            found.update(t for t in map(_target, names) if t and t != module)

    visit(ast.parse(path.read_text()).body)
    return found


def in_folder(module: str, folder: str) -> bool:
    return module.startswith(f"{NAME}.{folder}.") or module == f"{NAME}.{folder}"


def crossings(folder: str, forbidden) -> set[tuple[str, str]]:
    """(module, target) for each import of a module of ``folder`` that ``forbidden`` names."""
    return {(m, t) for m in MODULES if in_folder(m, folder) for t in imports(m) if forbidden(t)}


def test_worker_code_never_imports_the_driver():
    assert crossings("worker", lambda t: in_folder(t, "driver") or t in DRIVER_FRONTS) == set()


def test_the_horovod_api_runs_on_the_ranks_and_never_imports_the_driver():
    # but hvd.run, Horovod's launcher (horovod.run), which runs on the driver, calls run()
    launcher = {(f"{NAME}.horovod.launch", f"{NAME}.runner")}
    found = crossings("horovod", lambda t: in_folder(t, "driver") or t in DRIVER_FRONTS)
    assert found - launcher == set()
    assert f"{NAME}.worker.comm.rendezvous" in imports(f"{NAME}.horovod.basics")


def test_the_driver_imports_worker_code_only_for_the_entry_points_of_its_jobs():
    assert crossings("driver", lambda t: in_folder(t, "worker") and t not in ENTRY_POINTS) == set()
    used = {t for m in MODULES if not in_folder(m, "worker") for t in imports(m)}
    assert set(ENTRY_POINTS) <= used, "an entry point nothing outside worker/ uses"


def either_side(module: str) -> bool:
    return in_folder(module, "driver") or in_folder(module, "worker") or module in DRIVER_FRONTS


def test_shared_code_imports_neither_side():
    assert crossings("shared", either_side) == set()


def test_no_module_imports_itself_through_others_at_load_time():
    graph = {m: imports(m, load_time_only=True) for m in MODULES}
    cycles = []

    def walk(module, path, seen):
        for target in graph[module]:
            if target == path[0]:
                cycles.append(path + [target])
            elif target not in seen:
                seen.add(target)
                walk(target, path + [target], seen)

    for module in sorted(graph):
        walk(module, [module], {module})
    # a package's __init__ importing its own modules is not a cycle of the code
    cycles = [c for c in cycles if not any(MODULES[m].name == "__init__.py" for m in c)]
    assert cycles == []


def test_the_rule_sees_imports():
    """The walk finds relative, absolute and nested imports (else the rules above pass
    vacuously)."""
    assert f"{NAME}.worker.task" in imports(f"{NAME}.driver.fit")
    assert f"{NAME}.shared.spec" in imports(f"{NAME}.worker.loop.train", load_time_only=True)
    assert imports(f"{NAME}.worker.loop.train") >= imports(
        f"{NAME}.worker.loop.train", load_time_only=True
    )
