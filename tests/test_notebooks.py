"""The notebooks in notebooks/ run from top to bottom in a Jupyter kernel and learn.

Each runs in a kernel of this test's Python (a kernelspec written for sys.executable, so
the notebook sees the same torch, pyspark and spark-estimator), with matplotlib's inline
backend: figures become PNG outputs, and nothing tries to open a window.
"""

import importlib.util
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")  # test tools of the default stack only
write_kernel_spec = pytest.importorskip("ipykernel.kernelspec").write_kernel_spec
NotebookClient = pytest.importorskip("nbclient").NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
KERNEL = "spark-estimator-tests"


@pytest.fixture(scope="module")
def jupyter_path(tmp_path_factory):
    """A folder whose kernels/ holds a kernelspec running this Python."""
    root = tmp_path_factory.mktemp("jupyter")
    write_kernel_spec(
        path=root / "kernels" / KERNEL,
        overrides={
            "display_name": KERNEL,
            "env": {"MPLBACKEND": "module://matplotlib_inline.backend_inline"},
        },
    )
    return root


def run_notebook(
    name: str, jupyter_path: Path, cwd: Path, monkeypatch
) -> tuple[str, int, list[str]]:
    """Execute notebooks/``name`` in a fresh kernel; its stdout, how many figures it drew
    and the saved text of its progress widgets (what static viewers show). A cell that
    raises fails the test with that cell's error."""
    monkeypatch.setenv("JUPYTER_PATH", str(jupyter_path))
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(
        nb,
        kernel_name=KERNEL,
        timeout=600,
        resources={"metadata": {"path": str(cwd)}},
    ).execute()
    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    text = "".join(out.text for out in outputs if out.output_type == "stream")
    figures = sum("image/png" in out.get("data", {}) for out in outputs)
    bars = [  # the text of the progress widgets, as saved
        o.data["text/plain"]
        for o in outputs
        if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
    ]
    return text, figures, bars


@pytest.mark.parametrize("name", sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")))
def test_notebooks_are_committed_without_outputs(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code and all(cell.outputs == [] and cell.execution_count is None for cell in code)


def test_quickstart_notebook(jupyter_path, tmp_path, monkeypatch):
    text, figures, bars = run_notebook("quickstart.ipynb", jupyter_path, tmp_path, monkeypatch)
    if importlib.util.find_spec("ipywidgets"):  # the first fit's bar, saved as it ended
        assert bars and "epoch 6/6: 100%" in bars[0], bars
    history = re.findall(r"^epoch (\d+): train loss ([0-9.]+)", text, re.M)
    assert [int(epoch) for epoch, _ in history] == list(range(1, 7))
    assert float(history[-1][1]) < float(history[0][1])
    assert figures == 1
    accuracy = float(re.search(r"held-out accuracy: ([0-9.]+) on \d+ images", text).group(1))
    assert accuracy >= 0.85, text  # 0.95 when measured
    assert "loaded model gives the same predictions: True" in text
    lightning = re.findall(r"^lightning epoch (\d+): val_acc ([0-9.]+)", text, re.M)
    assert [int(epoch) for epoch, _ in lightning][:3] == [1, 2, 3], text
    accuracy = float(re.search(r"lightning held-out accuracy: ([0-9.]+)", text).group(1))
    assert accuracy >= 0.85, text
    tuned = re.search(r"^tuning: best trial (\d), \{'width': (\d+), 'lr': [0-9.e-]+\}", text, re.M)
    assert tuned and int(tuned.group(2)) in (8, 16, 32), text


def test_tabular_regression_notebook(jupyter_path, tmp_path, monkeypatch):
    text, figures, _ = run_notebook("tabular_regression.ipynb", jupyter_path, tmp_path, monkeypatch)
    assert figures == 2
    found = re.search(r"held-out RMSE: ([0-9.]+)  R\^2: (-?[0-9.]+) on \d+ rows", text)
    rmse, r2 = float(found.group(1)), float(found.group(2))
    baseline = float(re.search(r"baseline RMSE \(always the training mean\): ([0-9.]+)", text)[1])
    assert r2 >= 0.3 and rmse < 0.85 * baseline, text


def in_repository_layout(tmp_path: Path) -> Path:
    """A folder ``notebooks/`` (the cwd to run a notebook in) with ``examples/`` beside it,
    as in the repository: the notebooks that import an example's data helpers find it
    there, and what they write stays out of the repository."""
    (tmp_path / "examples").symlink_to(NOTEBOOKS.parent / "examples")
    (tmp_path / "notebooks").mkdir()
    return tmp_path / "notebooks"


def test_image_classification_notebook(jupyter_path, tmp_path, monkeypatch):
    pytest.importorskip("PIL")
    cwd = in_repository_layout(tmp_path)
    text, figures, _ = run_notebook("image_classification.ipynb", jupyter_path, cwd, monkeypatch)
    assert figures == 2  # the augmented crops, the history
    history = re.findall(r"^epoch (\d+): train loss ([0-9.]+)", text, re.M)
    assert [int(epoch) for epoch, _ in history] == list(range(1, 7)), text
    assert float(history[-1][1]) < float(history[0][1]) / 2, text
    accuracy = float(re.search(r"held-out accuracy: ([0-9.]+) on \d+ images", text).group(1))
    assert accuracy >= 0.8, text  # chance: 1/3
    assert sorted(p.name for p in cwd.iterdir()) == []


def test_text_classification_notebook(jupyter_path, tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    cwd = in_repository_layout(tmp_path)
    text, figures, _ = run_notebook("text_classification.ipynb", jupyter_path, cwd, monkeypatch)
    assert figures == 1
    assert re.search(r"'The stadum was too fast' -> \['the', 'st[^]]*'##", text)  # a typo's pieces
    history = re.findall(r"^epoch (\d+): train loss ([0-9.]+)", text, re.M)
    assert [int(epoch) for epoch, _ in history] == list(range(1, 6)), text
    accuracy = float(re.search(r"held-out accuracy: ([0-9.]+) on \d+ sentences", text).group(1))
    assert accuracy >= 0.75, text  # chance: 1/4
    assert sorted(p.name for p in cwd.iterdir()) == []
