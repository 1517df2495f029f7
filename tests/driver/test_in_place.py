"""A fit of a plain Parquet scan trains on the table's own files (real Parquet, local[4]):
nothing written under datasets/, the same rows and split semantics as the copying path,
exact resume, every row once across a resize, a changed table noticed, the reasons for a
copy, and the checks made in one pass that writes nothing."""

import itertools
import json
import logging
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from pyspark.sql import functions as F

from spark_estimator import TrainingError
from spark_estimator.callbacks import Callback
from spark_estimator.shared.row_split import RowSplit, uniform
from spark_estimator.shared.spec import LoaderSpec, TrainSpec
from spark_estimator.worker.data.loader import open_loader
from spark_estimator.worker.data.remainder import after, own_runs, remainder_batches, reshard
from spark_estimator.worker.data.shards import StepPlan
from tests.conftest import make_estimator
from tests.faults import Fault

ROWS = 240


class RowRecorder(torch.nn.Module):
    """Linear on x but its first value, the row's id; each training forward appends its
    rows' ids to ``<epoch>-<pid>.txt`` in ``out_dir``."""

    def __init__(self, out_dir: str):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(2, 1)
        self.out_dir, self.epoch = out_dir, None

    def forward(self, x):
        if self.training and self.epoch is not None and len(x):
            with open(os.path.join(self.out_dir, f"{self.epoch}-{os.getpid()}.txt"), "a") as f:
                f.write(" ".join(str(int(i)) for i in x[:, 0].tolist()) + "\n")
        return self.lin(x[:, 1:])


class TellEpoch(Callback):
    def on_epoch_begin(self, epoch, state):
        state.model.epoch = epoch


def quiet(store, **params):
    """An estimator of a RowRecorder that records nothing (its x's ids stay unused)."""
    return make_estimator(RowRecorder(""), store, **params)


def epochs_seen(out_dir: Path) -> dict[int, list[int]]:
    seen: dict[int, list[int]] = {}
    for path in out_dir.glob("*-*.txt"):
        epoch = int(path.name.split("-")[0])
        seen.setdefault(epoch, []).extend(int(v) for v in path.read_text().split())
    return seen


@pytest.fixture
def table(spark, tmp_path):
    """A Parquet table of ROWS rows in 3 files: x = [id, id/ROWS, 1], y linear in x, a
    validation column (every 4th row)."""
    rng = np.random.default_rng(0)
    rows = [
        ([float(i), i / ROWS, 1.0], 0.5 * i / ROWS + float(rng.normal(0, 0.01)), i % 4 == 0)
        for i in range(ROWS)
    ]
    df = spark.createDataFrame(rows, "x array<double>, y double, held boolean")
    df.repartition(3).write.parquet(str(tmp_path / "table"))
    return tmp_path / "table"


def fit_recording(spark, table, store, out_dir: Path, **params):
    out_dir.mkdir(exist_ok=True)
    net = RowRecorder(str(out_dir))
    base = dict(callbacks=[TellEpoch()], epochs=2, batch_size=16)
    return make_estimator(net, store, **{**base, **params}).fit(spark.read.parquet(str(table)))


def test_a_plain_scan_trains_on_the_files_as_the_copy_trains_on_its_rows(
    spark, store, table, tmp_path
):
    """The same rows every epoch, each once, and the validation column's split, whether
    the table is read in place or copied; nothing written under datasets/."""
    kept = fit_recording(spark, table, store, tmp_path / "in-place", validation="held")
    assert not Path(store.datasets).exists()
    assert len(list(Path(store.root, "tables").glob("*.json"))) == 1
    assert kept.getTrainingSummary()["dataset_in_place"]
    copied = fit_recording(
        spark, table, store, tmp_path / "copy", validation="held", data_copy="always"
    )
    assert Path(store.datasets).exists()
    held = {i for i in range(ROWS) if i % 4 == 0}
    for seen in (epochs_seen(tmp_path / "in-place"), epochs_seen(tmp_path / "copy")):
        assert sorted(seen) == [1, 2]
        for ids in seen.values():
            assert sorted(ids) == sorted(set(range(ROWS)) - held)  # each training row once
    assert not copied.getTrainingSummary()["dataset_in_place"]
    for model in (kept, copied):
        summary = store.read_json(store.run(model.getRunId()).ranks)
        assert sum(r["validation_rows"] for r in summary) == len(held)
    # the validation loss is over the same rows, so nearly the same after the same epochs
    assert kept.getHistory()[-1]["validation"]["loss"] == pytest.approx(
        copied.getHistory()[-1]["validation"]["loss"], rel=0.3
    )


def test_a_fraction_split_is_deterministic_and_complementary(spark, store, table, tmp_path):
    first = fit_recording(spark, table, store, tmp_path / "a", validation=0.25, epochs=1)
    again = fit_recording(spark, table, store, tmp_path / "b", validation=0.25, epochs=1)
    a, b = epochs_seen(tmp_path / "a")[1], epochs_seen(tmp_path / "b")[1]
    assert sorted(a) == sorted(b) and len(set(a)) == len(a)
    summary = store.read_json(store.run(first.getRunId()).ranks)
    validation = sum(r["validation_rows"] for r in summary)
    assert len(a) + validation == ROWS and 30 < validation < 90
    assert again.getTrainingSummary()["dataset_reused"]  # tables/<key>.json found


def test_a_fit_started_again_goes_on_exactly_on_the_files(spark, store, table, tmp_path):
    params = dict(epochs=3, commit_every_steps=1, validation=0.25, batch_size=16)
    clean = quiet(store, run_id="clean", **params).fit(spark.read.parquet(str(table)))
    fault = Fault("kill", rank=1, epoch=2, marker=tmp_path / "m", after_batches=3)
    est = quiet(store, run_id="lost", callbacks=[fault], **params)
    resumed = est.fit(spark.read.parquet(str(table)))
    assert (tmp_path / "m").exists() and resumed.getTrainingSummary()["resumed_from_commit"]
    assert not Path(store.datasets).exists()
    for name, value in clean.getModel().state_dict().items():
        torch.testing.assert_close(resumed.getModel().state_dict()[name], value, rtol=0, atol=1e-6)


@pytest.mark.parametrize("old, new, steps_done", [(3, 2, 1), (2, 3, 2)])
def test_a_resized_epoch_reads_every_row_of_its_split_once(
    spark, store, table, old, new, steps_done
):
    """The rest of an epoch re-sharded over another number of ranks (the remainder path)
    reads the table's rows of the split each once."""
    est = quiet(store, epochs=1, validation=0.25)
    est.fit(spark.read.parquet(str(table)))
    meta = next(Path(store.root, "tables").glob("*.json"))
    from spark_estimator.shared.spec import DatasetInfo

    data = DatasetInfo.from_json(str(table), json.loads(meta.read_text()), reused=True)
    spec = TrainSpec(
        bundle=b"", data=data, store=store, run_id="r", batch_size=8, epochs=1, seed=0,
        use_gpu=False, input_shapes=None, loader=LoaderSpec(shuffle=True, shuffle_buffer_size=7),
    )  # fmt: skip
    total = data.rows("train")

    def loader(world, rank):
        return open_loader(spec, "train", world, rank, pin=False)

    trained, consumed = [], []
    for rank in range(old):
        sizes = StepPlan(total, old, rank, 8).batch_sizes
        for b in itertools.islice(loader(old, rank).batches(sizes, 1), steps_done):
            trained += b["x"][:, 0].int().tolist()
        consumed.append(sum(sizes[:steps_done]))
    parts = reshard([after(r, n) for r, n in zip(own_runs(total, old), consumed)], new)
    rows = [sum(run.rows for run in p) for p in parts]
    empty = dict(loader(1, 0).layout.empty)
    for rank in range(new):
        sizes = StepPlan.over(rows, rank, 8).batch_sizes
        for b in remainder_batches(parts[rank], sizes, 1, loader, empty):
            trained += b["x"][:, 0].int().tolist()
    import pyarrow.parquet as pq

    # the table's order: its files by path, their rows; a row's split is drawn from its place
    ids = [
        int(x[0])
        for path, _ in data.in_place.layout
        for x in pq.read_table(table / path, columns=["x"]).column("x").to_pylist()
    ]
    validation = uniform(0, np.arange(ROWS)) < 0.25
    expected = sorted(i for i, held in zip(ids, validation) if not held)
    assert sorted(Counter(trained).items()) == [(i, 1) for i in expected]


def test_a_changed_table_is_new_data_and_a_run_on_the_old_files_is_not_resumed(
    spark, store, table, tmp_path
):
    fault = Fault("raise", rank=0, epoch=2, marker=tmp_path / "m")
    with pytest.raises(TrainingError):
        quiet(store, run_id="r", callbacks=[fault]).fit(spark.read.parquet(str(table)))
    extra = spark.createDataFrame(
        [([1.0, 2.0, 3.0], 1.0, False)], "x array<double>, y double, held boolean"
    )
    extra.write.mode("append").parquet(str(table))
    with pytest.raises(ValueError, match="run_id: run 'r' has checkpoints .* another data"):
        quiet(store, run_id="r").fit(spark.read.parquet(str(table)))
    assert len(list(Path(store.root, "tables").glob("*.json"))) == 2  # the new table's


def test_a_file_that_changes_under_the_fit_is_refused_when_read(spark, store, table):
    quiet(store, epochs=1).fit(spark.read.parquet(str(table)))
    meta = next(Path(store.root, "tables").glob("*.json"))
    from spark_estimator.shared.spec import DatasetInfo

    data = DatasetInfo.from_json(str(table), json.loads(meta.read_text()), reused=True)
    first = table / data.files["train"][0][0]
    first.write_bytes(first.read_bytes() + b"\0")
    spec = TrainSpec(
        bundle=b"", data=data, store=store, run_id="r", batch_size=8, epochs=1, seed=0,
        use_gpu=False, input_shapes=None,
    )  # fmt: skip
    loader = open_loader(spec, "train", 1, 0, pin=False)
    with pytest.raises(RuntimeError, match="the table changed while it was read in place"):
        list(loader.batches(StepPlan(data.rows("train"), 1, 0, 8).batch_sizes, 1))


def test_what_is_not_a_plain_scan_is_copied_saying_why(spark, store, table, caplog):
    df = spark.read.parquet(str(table))
    cases = [
        (df.filter("y > 0"), "the DataFrame's plan has a Filter"),
        (df.withColumn("x", F.array("y", "y", "y")), "column 'x' is computed"),
        (df.select(F.col("x"), F.col("held").cast("double").alias("y")), "column 'y' is computed"),
        (df.withColumn("y", F.col("y").cast("long")), "column 'y' is computed"),
    ]
    for frame, reason in cases:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="spark_estimator.driver.fit"):
            quiet(store, epochs=1).fit(frame)
        lines = [r.getMessage() for r in caplog.records]
        assert any(reason in line and "materializing a copy" in line for line in lines), lines
        with pytest.raises(ValueError, match=f"data_copy: 'never', .*{reason}"):
            quiet(store, epochs=1, data_copy="never").fit(frame)


def test_the_checks_are_made_before_the_training_job_without_writing(spark, store, tmp_path):
    rows = [([1.0, float("nan") if i == 5 else 0.0, 2.0], 1.0) for i in range(20)]
    folder = tmp_path / "nan"
    spark.createDataFrame(rows, "x array<double>, y double").write.parquet(str(folder))
    with pytest.raises(ValueError, match="feature_cols: column 'x' has 1 NaN or infinite"):
        quiet(store, epochs=1).fit(spark.read.parquet(str(folder)))
    assert not Path(store.datasets).exists() and not Path(store.root, "tables").exists()
    assert not Path(store.runs).exists()  # no training job ran


def test_row_splits_are_the_seeded_draw_or_the_column():
    draws = uniform(3, np.arange(10_000))
    assert 0.0 <= draws.min() and draws.max() < 1.0 and abs(draws.mean() - 0.5) < 0.02
    assert (uniform(3, np.arange(5, 10)) == draws[5:10]).all()  # a row's draw is its own
    fraction = RowSplit(fraction=0.3, seed=3)
    train, held = fraction.rows("train", 0, 100), fraction.rows("validation", 0, 100)
    assert sorted([*train, *held]) == list(range(100)) and 15 < len(held) < 45
    column = RowSplit(column="v")
    marks = np.array([True, False, True])
    assert column.rows("validation", 7, 3, marks).tolist() == [0, 2]
    assert RowSplit().rows("validation", 0, 4).tolist() == []


@pytest.fixture
def large(monkeypatch):
    """Every table counts as large: its checks come from the files' statistics, and the
    ranks check NaN and row lengths as they read; a pass before the job would fail."""
    from spark_estimator.driver import in_place

    monkeypatch.setattr(in_place, "CHECK_PASS_BYTES", 0)

    def no_pass(*args, **kwargs):
        raise AssertionError("a pass over the table ran")

    monkeypatch.setattr(in_place, "_count", no_pass)


def write_table(spark, folder: Path, xs: list[list[float]], writer: str = "pyarrow") -> Path:
    """A table of arrays ``xs`` and labels, written by Spark or by pyarrow (whose float
    statistics keep their bounds past a NaN; Spark's drop them)."""
    rows = [(x, float(i % 2)) for i, x in enumerate(xs)]
    if writer == "spark":
        df = spark.createDataFrame(rows, "x array<double>, y double").coalesce(1)
        df.write.parquet(str(folder))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        folder.mkdir()
        x = pa.array([r[0] for r in rows], pa.list_(pa.float64()))
        pq.write_table(pa.table({"x": x, "y": [r[1] for r in rows]}), folder / "part-0.parquet")
    return folder


def test_a_large_tables_checks_come_from_its_statistics_and_the_ranks(spark, store, table, large):
    model = quiet(store, epochs=1, validation=0.25).fit(spark.read.parquet(str(table)))
    meta = json.loads(next(Path(store.root, "tables").glob("*.json")).read_text())
    verify = {name: (finite, length) for _, name, finite, length in meta["in_place"]["verify"]}
    assert verify == {"x": (True, 3), "y": (True, None)}
    assert meta["row_lengths"] == {"x": 3}
    assert model.getHistory()[-1]["validation"]["loss"] >= 0


@pytest.mark.parametrize("held", [True, False], ids=["shard held", "streamed"])
def test_nan_in_a_large_table_is_refused_by_the_ranks_before_training_on_it(
    spark, store, tmp_path, large, held
):
    xs = [[float(i), 1.0, 2.0] for i in range(40)]
    xs[33][1] = float("nan")
    folder = write_table(spark, tmp_path / "nan", xs)
    params = dict(epochs=1, device_cache_fraction=0.5 if held else 0.0, run_id="nan")
    with pytest.raises(TrainingError) as info:
        quiet(store, **params).fit(spark.read.parquet(str(folder)))
    first = str(info.value).splitlines()[0]
    assert first.startswith("ValueError: feature_cols: column 'x' has 1 NaN or infinite values")
    assert f"(found reading {folder}/part-" in first and "in place)" in first
    assert not list(Path(store.run("nan").checkpoints).glob("*"))  # no step was committed


def test_arrays_of_another_length_than_the_statistics_gave_are_refused_by_the_ranks(
    spark, store, tmp_path, large
):
    # 2 + 4 values add up to 2 rows of the first row's 3: the statistics cannot tell
    xs = [[1.0, 2.0, 3.0]] * 10 + [[1.0, 2.0], [1.0, 2.0, 3.0, 4.0]] + [[1.0, 2.0, 3.0]] * 8
    folder = write_table(spark, tmp_path / "ragged", xs)
    with pytest.raises(TrainingError, match="column 'x' has arrays of varying lengths where "):
        quiet(store, epochs=1).fit(spark.read.parquet(str(folder)))


def test_what_the_statistics_show_is_refused_before_the_job(spark, store, tmp_path, monkeypatch):
    """Infinities (in the statistics' bounds) and NaN in files Spark wrote (it leaves the
    bounds out then) are counted in the pass: its error before any training job, as for a
    small table."""
    from spark_estimator.driver import in_place

    monkeypatch.setattr(in_place, "CHECK_PASS_BYTES", 0)
    cases = [
        ("inf", [[1.0, 2.0, 3.0]] * 10 + [[1.0, float("inf"), 3.0]], "pyarrow"),
        ("nan", [[1.0, 2.0, 3.0]] * 10 + [[1.0, float("nan"), 3.0]], "spark"),
    ]
    for name, xs, writer in cases:
        folder = write_table(spark, tmp_path / name, xs, writer)
        with pytest.raises(ValueError, match="feature_cols: column 'x' has 1 NaN or infinite"):
            quiet(store, epochs=1).fit(spark.read.parquet(str(folder)))
    assert not Path(store.runs).exists()  # no training job ran


def test_casts_to_float_are_read_in_place_as_the_loader_converts(spark, store, tmp_path, caplog):
    """Numbers cast to float or double (what the loader does per batch) stay a plain scan,
    and train as the copy of the cast columns does."""
    rows = [([float(i), i / ROWS, 1.0], i % 7) for i in range(ROWS)]
    folder = tmp_path / "ints"
    spark.createDataFrame(rows, "x array<double>, y long").write.parquet(str(folder))
    df = spark.read.parquet(str(folder)).select(
        F.col("x").cast("array<float>").alias("x"), F.col("y").cast("double").alias("y")
    )
    with caplog.at_level(logging.INFO, logger="spark_estimator.driver.fit"):
        kept = quiet(store, epochs=2, validation=0.25).fit(df)
    assert any("training on the table's own files" in r.getMessage() for r in caplog.records)
    assert not Path(store.datasets).exists()
    copied = quiet(store, epochs=2, validation=0.25, data_copy="always").fit(df)
    assert kept.getHistory()[-1]["validation"]["loss"] == pytest.approx(
        copied.getHistory()[-1]["validation"]["loss"], rel=0.3
    )
