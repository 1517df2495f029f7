"""Saved stages through fsspec in Spark ML's own format: pyspark's readers (and so Pipelines)
read them, stages saved by Spark's writer still load, and neither save nor load uses Spark."""

import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import fsspec
import pytest
import torch
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter

from spark_estimator import TorchModel
from spark_estimator.driver import persistence
from spark_estimator.driver.params import json_params
from spark_estimator.driver.persistence import OBJECTS_FILE


def small_model() -> TorchModel:
    torch.manual_seed(0)
    return TorchModel(model=torch.nn.Linear(3, 1), feature_cols=["x"], history=[{"epoch": 1}])


def test_metadata_is_one_json_line_that_pysparks_reader_loads(spark, tmp_path):
    model = small_model()
    path = tmp_path / "model"
    model.save(str(path))
    assert sorted(p.name for p in (path / "metadata").iterdir()) == ["_SUCCESS", "part-00000"]
    text = (path / "metadata" / "part-00000").read_text()
    assert text.endswith("\n") and text.count("\n") == 1
    assert json.loads(text)["paramMap"] == {"feature_cols": ["x"]}
    metadata = DefaultParamsReader.loadMetadata(str(path), spark)  # Spark's text reader
    assert metadata["class"] == "spark_estimator.model.TorchModel"
    assert metadata["uid"] == model.uid and metadata["history"] == [{"epoch": 1}]
    assert "model" not in metadata["paramMap"]
    back = DefaultParamsReader.loadParamsInstance(str(path), spark)  # as Pipelines load stages
    assert isinstance(back, TorchModel) and back.uid == model.uid
    assert torch.equal(back.getModel().weight, model.getModel().weight)


def test_a_stage_whose_metadata_spark_wrote_still_loads(spark, tmp_path):
    model = small_model()
    path = tmp_path / "model"
    model.save(str(path))
    for f in (path / "metadata").iterdir():
        f.unlink()
    (path / "metadata").rmdir()
    DefaultParamsWriter.saveMetadata(
        model, str(path), spark, extraMetadata=model._extra_metadata(), paramMap=json_params(model)
    )
    assert not (path / "metadata" / "part-00000").exists()  # Spark names it part-00000-<id>
    back = TorchModel.load(str(path))
    assert back.uid == model.uid and back.getHistory() == [{"epoch": 1}]
    assert torch.equal(back.getModel().weight, model.getModel().weight)


def test_save_and_load_place_one_slash_urls_as_the_store_does(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = "file:" + str(tmp_path / "model")
    small_model().save(url)
    assert (tmp_path / "model" / "metadata").is_dir()
    assert TorchModel.load(url).getFeatureCols() == ["x"]
    with pytest.raises(ValueError, match="path: cannot place 's3a:/bucket/model'"):
        small_model().save("s3a:/bucket/model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no folder named 'file:'


def test_a_save_interrupted_before_its_metadata_is_refused(tmp_path):
    path = tmp_path / "model"
    small_model().save(str(path))
    for f in (path / "metadata").iterdir():
        f.unlink()
    assert (path / OBJECTS_FILE).exists()
    with pytest.raises(FileNotFoundError, match="holds no saved Spark ML stage"):
        TorchModel.load(str(path))


def saved_features(path) -> list[str]:
    return TorchModel.load(str(path)).getFeatureCols()


def saved_and_beside(folder) -> tuple[list[str], list[str]]:
    """The feature columns of the stage saved at ``folder/model``, and what ``folder`` holds."""
    return saved_features(folder / "model"), [p.name for p in folder.iterdir()]


def test_an_overwrite_that_fails_keeps_the_saved_stage_and_leaves_nothing_beside_it(tmp_path):
    path = tmp_path / "model"
    small_model().save(str(path))
    broken = TorchModel(model=torch.nn.Linear(3, 1), feature_cols=["other"])
    broken.getModel().lock = threading.Lock()  # cannot be pickled
    with pytest.raises(TypeError, match="TorchModel: cannot be serialized"):
        broken.write().overwrite().save(str(path))
    assert saved_and_beside(tmp_path) == (["x"], ["model"])


def test_the_saved_stage_stays_until_its_replacement_is_complete(tmp_path, monkeypatch):
    path = tmp_path / "model"
    small_model().save(str(path))
    seen_while_writing = []
    write_metadata = persistence.write_metadata

    def metadata_then_crash(fs, fs_path, line):
        seen_while_writing.append(saved_features(path))
        write_metadata(fs, fs_path, line)
        raise KeyboardInterrupt  # the process stopped after the new stage's last file

    monkeypatch.setattr(persistence, "write_metadata", metadata_then_crash)
    replacement = TorchModel(model=torch.nn.Linear(3, 1), feature_cols=["new"])
    with pytest.raises(KeyboardInterrupt):
        replacement.write().overwrite().save(str(path))
    assert seen_while_writing == [["x"]]
    assert saved_and_beside(tmp_path) == (["x"], ["model"])

    monkeypatch.setattr(persistence, "write_metadata", write_metadata)
    replacement.write().overwrite().save(str(path))
    assert saved_and_beside(tmp_path) == (["new"], ["model"])


def test_a_move_into_place_that_fails_puts_the_earlier_stage_back(tmp_path, monkeypatch):
    path = tmp_path / "model"
    small_model().save(str(path))
    fs_type = type(fsspec.filesystem("file"))
    mv = fs_type.mv
    moves = []

    def mv_failing_for_the_new_stage(self, path1, path2, **kwargs):
        moves.append((Path(path1).name.split("-")[0], Path(path2).name.split("-")[0]))
        if Path(path1).name.startswith(".tmp-"):
            (Path(path2) / "metadata").mkdir(parents=True)  # what a partial copy could leave
            raise OSError("injected: the move of the new stage failed")
        return mv(self, path1, path2, **kwargs)

    monkeypatch.setattr(fs_type, "mv", mv_failing_for_the_new_stage)
    replacement = TorchModel(model=torch.nn.Linear(3, 1), feature_cols=["new"])
    with pytest.raises(OSError, match="injected"):
        replacement.write().overwrite().save(str(path))
    assert moves == [("model", ".replaced"), (".tmp", "model"), (".replaced", "model")]
    assert saved_and_beside(tmp_path) == (["x"], ["model"])


NO_SPARK_SCRIPT = """
    import sys, torch
    from pyspark import SparkContext
    from pyspark.sql import SparkSession
    from spark_estimator import TorchModel
    torch.manual_seed(0)
    model = TorchModel(model=torch.nn.Linear(3, 1), feature_cols=["x"])
    for path in (sys.argv[1], "file://" + sys.argv[1] + "-url", "memory://saved/model"):
        model.save(path)
        model.write().overwrite().save(path)
        back = TorchModel.load(path)
        assert back.uid == model.uid
        assert torch.equal(back.getModel().weight, model.getModel().weight)
    assert SparkContext._active_spark_context is None and SparkSession.getActiveSession() is None
    print("saved and loaded without Spark")
"""


def test_save_and_load_use_no_spark_session_or_jvm(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(NO_SPARK_SCRIPT), str(tmp_path / "model")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("saved and loaded without Spark")
    assert (tmp_path / "model-url" / "metadata" / "_SUCCESS").exists()
