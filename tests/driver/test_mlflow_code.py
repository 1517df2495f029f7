"""mlflow_code: the user's own modules named in a pickle (by reference, or as module objects
through cloudpickle's subimport), found with their packages and the own modules they import,
written as their packages lay them out; installed, standard and by-value code left out."""

from __future__ import annotations

import importlib
import pickle
import sys
import textwrap
import zipfile
from pathlib import Path

import cloudpickle
import numpy as np
import pytest

from spark_estimator.driver import mlflow_code


@pytest.fixture
def own_code(tmp_path):
    """A package ``shop_<id>`` (``nets`` importing ``.layers`` relatively and the loose
    module ``tools_<id>``) in a folder on sys.path for the test only."""
    tag = tmp_path.name.replace("-", "_")
    src = tmp_path / "src"
    package = src / f"shop_{tag}"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "layers.py").write_text("def double(x):\n    return 2 * x\n")
    (package / "nets.py").write_text(
        textwrap.dedent(
            f"""
            import json
            import numpy
            from . import layers
            import tools_{tag}

            class Net:
                def __call__(self, x):
                    return layers.double(x)
            """
        )
    )
    (src / f"tools_{tag}.py").write_text("def decode(row, augment):\n    return row\n")
    sys.path.insert(0, str(src))
    try:
        yield (
            tag,
            importlib.import_module(f"shop_{tag}.nets"),
            importlib.import_module(f"tools_{tag}"),
        )
    finally:
        sys.path.remove(str(src))
        for name in [n for n in sys.modules if tag in n]:
            del sys.modules[name]


def test_the_modules_a_pickle_names_are_read_without_unpickling_it(own_code):
    tag, nets, tools = own_code

    def by_value(row):  # pickled by value: the module object it uses by name
        return tools.decode(row, None)

    data = cloudpickle.dumps({"net": nets.Net(), "f": by_value, "dtype": np.float32})
    found = mlflow_code.pickled_modules(data)
    assert {f"shop_{tag}.nets", f"tools_{tag}", "numpy"} <= found
    assert "__main__" not in found and f"shop_{tag}.layers" not in found  # not in the pickle
    # a plain pickle's GLOBAL opcodes (protocol 0) too
    assert f"shop_{tag}.nets" in mlflow_code.pickled_modules(pickle.dumps(nets.Net, protocol=0))


def test_own_modules_come_with_their_packages_and_own_imports_installed_ones_left_out(
    own_code, tmp_path
):
    tag, nets, _ = own_code
    found = mlflow_code.own_modules([f"shop_{tag}.nets", "numpy", "json", "spark_estimator"])
    assert sorted(found) == [
        f"shop_{tag}",
        f"shop_{tag}.layers",
        f"shop_{tag}.nets",
        f"tools_{tag}",
    ]
    tops = mlflow_code.write_tree(found, str(tmp_path / "code"))
    assert [Path(p).name for p in tops] == [f"shop_{tag}", f"tools_{tag}.py"]
    written = sorted(
        str(p.relative_to(tmp_path / "code")) for p in (tmp_path / "code").rglob("*.py")
    )
    assert written == [
        f"shop_{tag}/__init__.py",
        f"shop_{tag}/layers.py",
        f"shop_{tag}/nets.py",
        f"tools_{tag}.py",
    ]
    assert (tmp_path / "code" / f"shop_{tag}" / "nets.py").read_text() == Path(
        nets.__file__
    ).read_text()


def test_a_module_imported_from_a_zip_as_py_files_ships_is_written_from_the_archive(tmp_path):
    tag = tmp_path.name.replace("-", "_")
    archive = tmp_path / "deps.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr(f"zipped_{tag}/__init__.py", "")
        z.writestr(f"zipped_{tag}/net.py", "class Net:\n    pass\n")
    sys.path.insert(0, str(archive))
    try:
        module = importlib.import_module(f"zipped_{tag}.net")
        names = mlflow_code.pickled_modules(cloudpickle.dumps(module.Net()))
        tops = mlflow_code.write_tree(mlflow_code.own_modules(names), str(tmp_path / "code"))
    finally:
        sys.path.remove(str(archive))
        for name in [n for n in sys.modules if tag in n]:
            del sys.modules[name]
    assert [Path(p).name for p in tops] == [f"zipped_{tag}"]
    shipped = tmp_path / "code" / f"zipped_{tag}" / "net.py"
    assert shipped.read_text() == "class Net:\n    pass\n"
