"""Docs that follow the code: docs/parameters.md, spark_estimator/driver/param_accessors.py
and spark_estimator/driver/constructors.py are what docs/gen_parameters.py writes from the
params of TorchEstimator, LightningEstimator and TorchModel, relative links in the user
docs resolve, ``help()`` of each public entry point shows its numpydoc sections, and the
package's docstrings and comments name no ``.py`` file."""

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


def test_constructors_module_is_up_to_date_with_the_specs():
    text = load_generator().render_constructors()
    assert (ROOT / "spark_estimator/driver/constructors.py").read_text() == text, (
        "spark_estimator/driver/constructors.py is out of date: run docs/gen_parameters.py"
    )


@pytest.mark.parametrize(
    "stage", ["TorchEstimator", "LightningEstimator", "TorchModel", "tuning.OptunaSearch"]
)
def test_each_constructor_takes_every_param_with_its_default_and_documents_it(stage):
    """The specs are the one source of the constructors: a keyword per param (and Spark's
    snake_case spellings), its default the param's, typed, in the Parameters section."""
    import importlib
    import inspect

    from spark_estimator.driver.param_specs import SPARK_ALIASES

    module, _, name = f"spark_estimator.{stage}".rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    instance = cls()
    signature = inspect.signature(cls.__init__)
    keywords = {n: p for n, p in signature.parameters.items() if n != "self"}
    extras = {s.name for s in getattr(cls, "KEYWORDS", ())}
    aliases = set(SPARK_ALIASES) if instance.hasParam("probabilityCol") else set()
    assert set(keywords) == {p.name for p in instance.params} | aliases | extras
    doc = inspect.getdoc(cls.__init__)
    for param in instance.params:
        keyword = keywords[param.name]
        assert keyword.kind is inspect.Parameter.KEYWORD_ONLY
        assert keyword.annotation is not inspect.Parameter.empty
        expected = instance.getOrDefault(param) if instance.hasDefault(param) else None
        assert keyword.default == expected, param.name
        assert f"\n{param.name} : " in doc, param.name


def test_every_param_has_its_accessors_written_out():
    from spark_estimator import LightningEstimator, TorchEstimator, TorchModel
    from spark_estimator.driver import param_accessors
    from spark_estimator.tuning import OptunaSearch

    source = (ROOT / "spark_estimator/driver/param_accessors.py").read_text()
    camel = load_generator()._camel
    for stage in (TorchEstimator(), LightningEstimator(), TorchModel(), OptunaSearch()):
        for param in stage.params:
            if param.name in ("probabilityCol", "rawPredictionCol"):  # pyspark's and ours
                continue
            name = camel(param.name)
            assert f"def get{name}(self)" in source and f"def set{name}(self" in source
    assert param_accessors.FitParamsAccessors.getBatchSize.__module__ == param_accessors.__name__


def test_parameters_md_lists_every_param_with_its_default():
    from spark_estimator import LightningEstimator, TorchEstimator, TorchModel
    from spark_estimator.tuning import OptunaSearch

    text = load_generator().render()
    estimator_part, rest = text.split("\n## LightningEstimator\n")
    lightning_part, rest = rest.split("\n## TorchModel\n")
    model_part, search_part = rest.split("\n## OptunaSearch\n")
    for stage, part in (
        (TorchEstimator(), estimator_part),
        (LightningEstimator(), lightning_part),
        (TorchModel(), model_part),
        (OptunaSearch(), search_part),
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
        "docs/images-and-text.md",
        "docs/serving.md",
        "docs/security.md",
        "docs/observability.md",
        "docs/tuning.md",
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


# Every public name of Horovod 0.28.1's horovod.torch (its __init__'s imports, the public
# classes of horovod/torch/compression.py and the autograd Functions of mpi_ops.py),
# horovod.torch.elastic (its module-level names) and the methods scripts call on a
# DistributedOptimizer, a TorchState and an ElasticSampler.
HOROVOD_TORCH_0_28 = (
    *"init shutdown is_initialized rank size local_rank local_size cross_rank cross_size".split(),
    *"mpi_threads_supported mpi_enabled mpi_built gloo_enabled gloo_built nccl_built".split(),
    *"ddl_built ccl_built cuda_built rocm_built is_homogeneous start_timeline".split(),
    *"stop_timeline Average Sum Adasum Min Max Product allreduce allreduce_async".split(),
    *"allreduce_ allreduce_async_ grouped_allreduce grouped_allreduce_async".split(),
    *"grouped_allreduce_ grouped_allreduce_async_ sparse_allreduce_async allgather".split(),
    *"allgather_async grouped_allgather grouped_allgather_async broadcast".split(),
    *"broadcast_async broadcast_ broadcast_async_ alltoall alltoall_async".split(),
    *"reducescatter reducescatter_async grouped_reducescatter".split(),
    *"grouped_reducescatter_async join barrier poll synchronize".split(),
    *"ProcessSet global_process_set add_process_set remove_process_set".split(),
    *"HorovodInternalError DistributedOptimizer SyncBatchNorm Compression".split(),
    *"Compressor NoneCompressor FP16Compressor broadcast_parameters".split(),
    *"broadcast_optimizer_state broadcast_object allgather_object".split(),
    *"HorovodAllreduce HorovodGroupedAllreduce HorovodAllgather".split(),
    *"HorovodGroupedAllgather HorovodBroadcast HorovodAlltoall".split(),
    *"HorovodReducescatter HorovodGroupedReducescatter".split(),
    *"optimizer.synchronize optimizer.skip_synchronize".split(),
    "optimizer.set_backward_passes_per_step",
    *"elastic elastic.run elastic.TorchState elastic.ElasticSampler elastic.init".split(),
    *"elastic.shutdown elastic.StateHandler elastic.ModelStateHandler".split(),
    *"elastic.OptimizerStateHandler elastic.SamplerStateHandler".split(),
    *"elastic.get_handler_registry elastic.set_handler_registry".split(),
    *"state.commit state.check_host_updates state.on_hosts_updated state.save".split(),
    *"state.restore state.sync state.reset state.register_reset_callbacks".split(),
    *"state.on_reset sampler.set_epoch sampler.record_batch sampler.state_dict".split(),
    *"sampler.load_state_dict sampler.reset".split(),
)

VERDICTS = ("same", "differs: ", "not offered: ", "ours only: ")


def _names_table() -> list[tuple[set[str], str]]:
    """Each row of docs/horovod.md's "name by name" table: the names its first two columns
    give (``hvd.``, ``horovod.torch.``, ``horovod.`` dropped; ``name(...)`` as ``name``)
    and its verdict."""
    text = (ROOT / "docs/horovod.md").read_text()
    section = text.split("## `spark_estimator.horovod`, name by name", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("| ").split(" | ")]
        if not line.startswith("| ") or len(cells) != 3 or set(cells[2]) <= set("-"):
            continue  # not a row, or the header's rule
        spans = re.findall(r"`([^`]*)`", cells[0] + " " + cells[1])
        names = {re.sub(r"^(hvd|horovod\.torch|horovod)\.", "", s) for s in spans}
        names = {re.match(r"[\w.]*", n)[0] for n in names} - {""}
        rows.append((names, cells[2]))
    return rows[1:]  # after the header


def _has_row(name: str, rows) -> bool:
    return any(n == name or n.startswith(name + ".") for names, _ in rows for n in names)


def test_every_horovod_torch_name_has_a_row_in_horovod_md():
    rows = _names_table()
    assert [n for n in HOROVOD_TORCH_0_28 if not _has_row(n, rows)] == []


def test_every_name_spark_estimator_horovod_exports_has_a_row_in_horovod_md():
    import spark_estimator.horovod as hvd

    exported = [*hvd.__all__]
    for name, value in vars(hvd.elastic).items():  # its classes and run
        ours = getattr(value, "__module__", "").startswith(hvd.__name__)
        if ours and not name.startswith("_") and (isinstance(value, type) or name == "run"):
            exported.append(f"elastic.{name}")
    rows = _names_table()
    assert [n for n in exported if not _has_row(n, rows)] == []


def test_every_row_of_the_horovod_names_table_gives_a_verdict():
    rows = _names_table()
    assert len(rows) > 50
    assert [v for _, v in rows if not v.startswith(VERDICTS)] == []
    # "same" alone or with a note after a colon
    assert all(re.match(r"same($|: | \()", v) for _, v in rows if v.startswith("same"))


# -- the package's docstrings and comments ----------------------------------------------------

PACKAGE = ROOT / "spark_estimator"
GENERATED = {"driver/constructors.py", "driver/param_accessors.py"}  # docs/gen_parameters.py's
# A ``<name>.py`` in a docstring or comment names a file, which breaks when files move: name
# the function, class or module meant instead. The exceptions, each a pattern of the text
# allowed (removed before the search), with its reason:
PY_NAMES_ALLOWED = {
    # the script in run()'s examples (its docstring and its module's): a file of the user's,
    # whose path is what run() takes, not a file of this package
    r'\brun\("train\.py"',
}
PY_NAME = re.compile(r"[\w./-]*\w\.py\b")


def test_no_python_file_paths_in_the_package_docstrings_or_comments():
    """Docstrings and comments name functions, classes, modules (``worker.data.shuffle``)
    or docs (docs/data-path.md), never ``<name>.py`` files; the generated modules are the
    generator's business. Scans the whole source text: code holds no such names either."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where in GENERATED:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for allowed in PY_NAMES_ALLOWED:
                line = re.sub(allowed, "", line)
            found += [f"spark_estimator/{where}:{number}: {n}" for n in PY_NAME.findall(line)]
    assert found == []


def _public(dotted: str):
    """The object at ``dotted`` (``spark_estimator.horovod.elastic.run``), by attributes."""
    import importlib

    module, _, rest = dotted.partition(":")
    obj = importlib.import_module(module)
    for part in rest.split(".") if rest else ():
        obj = getattr(obj, part)
    return obj


P, R, X, E = "Parameters", "Returns", "Raises", "Examples"
# Each public entry point: the numpydoc sections its own docstring has (for a stage class,
# Examples in the class's and Parameters in its generated constructor's).
PUBLIC_DOCS = {
    "spark_estimator:run": (P, R, X, E),
    "spark_estimator:TorchEstimator": (E,),
    "spark_estimator:TorchEstimator.__init__": (P,),
    "spark_estimator:TorchEstimator.fit": (P, R, X, E),
    "spark_estimator:TorchEstimator.fit_on_parquet": (P, R, X, E),
    "spark_estimator:TorchEstimator.materialize": (P, R, X),
    "spark_estimator:LightningEstimator": (E,),
    "spark_estimator:LightningEstimator.__init__": (P,),
    "spark_estimator:TorchModel": (E,),
    "spark_estimator:TorchModel.__init__": (P,),
    "spark_estimator:TorchModel.transform": (P, R, X, E),
    "spark_estimator:Store.create": (P, R, X, E),
    "spark_estimator.mlflow:log_model": (P, R, X, E),
    "spark_estimator.mlflow:save_model": (P, X, E),
    "spark_estimator.mlflow:load_model": (P, R, E),
    "spark_estimator.launcher:main": (),  # the CLI's: its usage is the module's docstring
    "spark_estimator.distributed:rank": (R, X),
    "spark_estimator.distributed:size": (R, X),
    "spark_estimator.distributed:local_rank": (R, X),
    "spark_estimator.distributed:allreduce": (P, R, X, E),
    "spark_estimator.distributed:broadcast_object": (P, R, X, E),
    "spark_estimator.distributed:device_mesh": (R, X, E),
    "spark_estimator.horovod:init": (P, X, E),
    "spark_estimator.horovod:shutdown": (),
    "spark_estimator.horovod:rank": (R, X),
    "spark_estimator.horovod:size": (R, X),
    "spark_estimator.horovod:local_rank": (R, X),
    "spark_estimator.horovod:allreduce": (P, R, X, E),
    "spark_estimator.horovod:allreduce_async": (P, R, X, E),
    "spark_estimator.horovod:allgather": (P, R, X, E),
    "spark_estimator.horovod:broadcast": (P, R, X, E),
    "spark_estimator.horovod:broadcast_parameters": (P, X, E),
    "spark_estimator.horovod:broadcast_optimizer_state": (P, X, E),
    "spark_estimator.horovod:DistributedOptimizer": (P, R, X, E),
    "spark_estimator.horovod:join": (R, X, E),
    "spark_estimator.horovod:elastic.run": (P, R, E),
    "spark_estimator.horovod:elastic.TorchState": (P, E),
    "spark_estimator.horovod:run": (P, R, X, E),
    "spark_estimator.horovod:add_process_set": (P, R, X, E),
    "spark_estimator.tuning:OptunaSearch": (E,),
    "spark_estimator.tuning:OptunaSearch.__init__": (P,),
    "spark_estimator.tuning:OptunaSearch.fit": (P, R, X, E),
    "spark_estimator.tuning:OptunaSearchModel": (E,),
    "spark_estimator.tuning:OptunaSearchModel.trials_dataframe": (R, E),
}


def _has_section(text: str, header: str) -> bool:
    """A numpydoc section header: the name on its own line, underlined by as many dashes
    (in pydoc's text too, where class members' lines start with `` |  ``)."""
    return re.search(rf"^[ |]*{header}\n[ |]*-{{{len(header)}}}$", text, re.M) is not None


@pytest.mark.parametrize("dotted", sorted(PUBLIC_DOCS))
def test_help_of_each_public_entry_point_shows_its_numpydoc_sections(dotted):
    import inspect
    import pydoc

    obj = _public(dotted)
    own = inspect.getdoc(obj)
    assert own and own.splitlines()[0].strip(), f"{dotted}: no one-line summary"
    shown = pydoc.plaintext.document(obj)  # what help() prints (less its pager header)
    for header in PUBLIC_DOCS[dotted]:
        assert _has_section(own, header), f"{dotted}: no {header} section"
        assert _has_section(shown, header), f"{dotted}: help() shows no {header} section"
    # Parameters wherever the call takes any (beyond self and a method's params override)
    if callable(obj) and not isinstance(obj, type) and dotted.split(".")[-1] != "__init__":
        takes = [n for n in inspect.signature(obj).parameters if n not in ("self", "params")]
        if takes and dotted != "spark_estimator.launcher:main":
            assert P in PUBLIC_DOCS[dotted], f"{dotted} takes {takes}: list Parameters"


def test_help_of_the_stage_classes_shows_their_constructor_parameters():
    """``help(TorchEstimator)`` prints the class's Examples and, under ``__init__``, the
    generated Parameters section."""
    import pydoc

    import spark_estimator

    for name in ("TorchEstimator", "LightningEstimator", "TorchModel"):
        shown = pydoc.render_doc(getattr(spark_estimator, name), renderer=pydoc.plaintext)
        assert _has_section(shown, P) and _has_section(shown, E), name
