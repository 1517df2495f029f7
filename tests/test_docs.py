"""Docs that follow the code: docs/parameters.md and spark_estimator/driver/param_accessors.py are
what docs/gen_parameters.py writes from the params of TorchEstimator, LightningEstimator and
TorchModel, and relative links in the user docs resolve."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_parameters", ROOT / "docs/gen_parameters.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parameters_md_is_up_to_date_with_the_code():
    generator = load_generator()
    assert (ROOT / "docs/parameters.md").read_text() == generator.render(), (
        "docs/parameters.md is out of date: run .venv/bin/python docs/gen_parameters.py"
    )


def test_param_accessors_module_is_up_to_date_with_the_specs():
    text = load_generator().render_accessors()
    assert (ROOT / "spark_estimator/driver/param_accessors.py").read_text() == text, (
        "spark_estimator/driver/param_accessors.py is out of date: run docs/gen_parameters.py"
    )


def test_every_param_has_its_accessors_written_out():
    from spark_estimator import LightningEstimator, TorchEstimator, TorchModel
    from spark_estimator.driver import param_accessors

    source = (ROOT / "spark_estimator/driver/param_accessors.py").read_text()
    camel = load_generator()._camel
    for stage in (TorchEstimator(), LightningEstimator(), TorchModel()):
        for param in stage.params:
            if param.name in ("probabilityCol", "rawPredictionCol"):  # pyspark's and ours
                continue
            name = camel(param.name)
            assert f"def get{name}(self)" in source and f"def set{name}(self" in source
    assert param_accessors.FitParamsAccessors.getBatchSize.__module__ == param_accessors.__name__


def test_parameters_md_lists_every_param_with_its_default():
    from spark_estimator import LightningEstimator, TorchEstimator, TorchModel

    text = load_generator().render()
    estimator_part, rest = text.split("\n## LightningEstimator\n")
    lightning_part, model_part = rest.split("\n## TorchModel\n")
    for stage, part in (
        (TorchEstimator(), estimator_part),
        (LightningEstimator(), lightning_part),
        (TorchModel(), model_part),
    ):
        rows = dict(re.findall(r"^\| `(\w+)` \| (.*?) \|", part, re.M))
        assert set(rows) == {p.name for p in stage.params}
        for param in stage.params:
            if stage.hasDefault(param):
                assert rows[param.name] == f"`{stage.getOrDefault(param)!r}`"


@pytest.mark.parametrize(
    "page",
    [
        "docs/gpu.md",
        "docs/lightning.md",
        "docs/troubleshooting.md",
        "docs/parameters.md",
        "conf/README.md",
        "examples/README.md",
        "README.md",
    ],
)
def test_relative_links_resolve(page):
    path = ROOT / page
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text())
    missing = [t for t in targets if "://" not in t and not (path.parent / t).exists()]
    assert missing == []


def _horovod_row(name: str) -> str:
    """The row of ``name`` in docs/horovod.md's table of Horovod's estimator arguments."""
    text = (ROOT / "docs/horovod.md").read_text()
    return next(line for line in text.splitlines() if line.startswith(f"| `{name}` |"))


def test_horovod_md_names_exactly_the_verbose_values_the_estimators_take():
    from spark_estimator import LightningEstimator, TorchEstimator

    row = _horovod_row("verbose")
    for value in (True, False, 0, 1, 2):
        assert f"`{value}`" in row
        TorchEstimator(verbose=value)
        LightningEstimator(verbose=value)
    for value in (3, -1):
        assert f"`{value}`" not in row
        with pytest.raises(ValueError, match="verbose"):
            TorchEstimator(verbose=value)
