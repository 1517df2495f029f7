"""Driver: the user's own modules a logged model needs, found in its pickle and shipped in
the MLflow Model's ``code/`` folder (``mlflow_model.save_model``).

A saved stage's ``objects.pkl`` (a cloudpickle) refers by name to every class and function
that cloudpickle did not pickle by value: those of installed packages, and those of the
user's own modules (a model class, a ``decode_fn``, a loss in a module beside the
script, or shipped with ``--py-files`` / ``SparkContext.addPyFile``), which a process that
loads the model elsewhere does not have. ``pickled_modules`` reads those names from the
pickle's opcodes without unpickling it; ``own_modules`` keeps the modules that are the
user's own: imported here from a file that is not of the standard library, nor of an
installed distribution (``importlib.metadata``), nor under site-packages; with the modules
of this kind that their source imports (``ast``), and their packages' init files.
``write_tree`` writes their files into a folder as the packages lay them out, from which
MLflow copies them into the model's ``code/`` folder, which it puts first on ``sys.path``
before loading the model (``mlflow.pyfunc.load_model``, ``spark_udf``, ``mlflow models
serve``; ``spark_estimator.mlflow.load_model`` too).

Modules that the pickle does not name and their sources do not import by a literal
``import`` (``importlib.import_module(name)``), data files, and code outside Python
modules are not found: ``code_paths`` ships them.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import os
import pickletools
import sys
import sysconfig
from collections.abc import Iterable
from functools import cache
from importlib import metadata as importlib_metadata
from types import ModuleType

log = logging.getLogger(__name__)
# cloudpickle's functions that import a module given by name (a module object in a pickle)
_SUBIMPORTS = {"subimport", "dynamic_subimport"}
_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING",
               "BINSTRING", "SHORT_BINSTRING"}  # fmt: skip
_GET_OPS = {"GET", "BINGET", "LONG_BINGET"}
_PUT_OPS = {"PUT", "BINPUT", "LONG_BINPUT"}
_SUBIMPORT = object()  # what pickled_modules pushes for one of them
SKIPPED = ("__main__", "spark_estimator")  # pickled by value; this package (installed)


def pickled_modules(data: bytes) -> set[str]:
    """The modules a pickle imports (its GLOBAL and STACK_GLOBAL opcodes' modules, and the
    modules cloudpickle's ``subimport`` imports by name), read from its opcodes: nothing
    in it runs."""
    modules: set[str] = set()
    memo: dict[int, object] = {}
    pushed: list[object] = [None, None]  # each value pushed: a string, _SUBIMPORT or None
    calls_subimport = False  # the last global pushed is subimport: its argument comes next
    for opcode, arg, _ in pickletools.genops(data):
        op = opcode.name
        if op == "MEMOIZE":
            memo[len(memo)] = pushed[-1]
            continue
        if op in _PUT_OPS:
            memo[arg] = pushed[-1]
            continue
        value = None
        if op in _STRING_OPS:
            value = arg.decode("latin-1") if isinstance(arg, bytes) else arg
        elif op in _GET_OPS:
            value = memo.get(arg)
        elif op in ("GLOBAL", "STACK_GLOBAL"):
            module, qualname = arg.split(" ", 1) if op == "GLOBAL" else pushed[-2:]
            if isinstance(module, str):
                modules.add(module)
            value = _SUBIMPORT if qualname in _SUBIMPORTS else None
        if value is _SUBIMPORT:
            calls_subimport = True
        elif calls_subimport and isinstance(value, str):
            modules.add(value)
            calls_subimport = False
        pushed.append(value)
    return {m for m in modules if m}


@cache
def _installed_top_names() -> frozenset[str]:
    """The top-level import names of the installed distributions."""
    return frozenset(importlib_metadata.packages_distributions())


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots |= {p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")}
    return tuple(os.path.realpath(r) + os.sep for r in roots if r)


def _own(name: str, library_roots: tuple[str, ...]) -> ModuleType | None:
    """The module ``name`` where it is the user's own (see the module), else None."""
    top = name.partition(".")[0]
    if (
        top in SKIPPED
        or top in sys.stdlib_module_names
        or top in sys.builtin_module_names
        or top in _installed_top_names()
    ):
        return None
    module = sys.modules.get(name)
    origin = getattr(module, "__file__", None)
    if module is None or not origin:
        return None
    return None if os.path.realpath(origin).startswith(library_roots) else module


def _imported_names(module: ModuleType) -> set[str]:
    """The modules ``module``'s source imports by an ``import`` statement (at any depth),
    relative ones resolved; ``from a import b`` gives ``a`` and ``a.b``."""
    source = _read(module)
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # not Python source (an extension module)
        return set()
    package = module.__package__ or ""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            try:
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            except (ImportError, ValueError):
                continue
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def own_modules(names: Iterable[str]) -> dict[str, ModuleType]:
    """Of the modules ``names``, the user's own, with their own parent packages and the
    own modules they import, recursively; by name."""
    roots = _library_roots()
    found: dict[str, ModuleType] = {}
    pending = list(names)
    while pending:
        name = pending.pop()
        if name in found:
            continue
        module = _own(name, roots)
        if module is None:
            continue
        found[name] = module
        parts = name.split(".")
        pending += [".".join(parts[:i]) for i in range(1, len(parts))]
        pending += sorted(_imported_names(module))
    return found


def _read(module: ModuleType) -> bytes:
    """A module's file: from the disk, or from the archive its loader reads (a zip shipped
    with ``--py-files``)."""
    try:
        with open(module.__file__, "rb") as f:
            return f.read()
    except OSError:
        return module.__loader__.get_data(module.__file__)


def relative_path(name: str, module: ModuleType) -> str:
    """Where module ``name``'s file goes under a ``sys.path`` folder: the file ``c`` in the
    folder ``a/b`` for ``a.b.c``, the package ``a.b``'s init file in ``a/b``."""
    parts = name.split(".")
    filename = os.path.basename(module.__file__)
    if hasattr(module, "__path__"):  # a package: its __init__ file
        return os.path.join(*parts, filename)
    return os.path.join(*parts[:-1], filename)


def write_tree(modules: dict[str, ModuleType], folder: str) -> list[str]:
    """Write the files of ``modules`` into ``folder`` as their packages lay them out; the
    paths of the top-level files and folders written (what ``code_paths`` takes)."""
    tops = set()
    for name, module in sorted(modules.items()):
        try:
            data = _read(module)
        except (OSError, AttributeError, ImportError) as e:  # a loader that cannot give it
            log.warning("module %s is not shipped with the model: %s cannot be read (%s)",
                        name, module.__file__, e)  # fmt: skip
            continue
        target = os.path.join(folder, relative_path(name, module))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as f:
            f.write(data)
        tops.add(os.path.join(folder, relative_path(name, module).split(os.sep)[0]))
    return sorted(tops)


def inferred_code_paths(pickle_path: str, folder: str) -> list[str]:
    """The user's own modules that the pickle at ``pickle_path`` needs (see the module),
    written into ``folder``: the top-level files and folders to ship."""
    with open(pickle_path, "rb") as f:
        names = pickled_modules(f.read())
    return write_tree(own_modules(names), folder)
