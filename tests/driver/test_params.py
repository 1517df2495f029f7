import inspect

import pytest
import torch

from spark_estimator import LightningEstimator, Store, TorchEstimator, TorchModel
from spark_estimator.driver.param_specs import SPARK_ALIASES


def make(**kw):
    net = torch.nn.Linear(2, 1)
    base = dict(
        model=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        loss=torch.nn.MSELoss(),
        feature_cols=["x"],
        label_cols=["y"],
    )
    base.update(kw)
    return TorchEstimator(**base)


def test_defaults():
    est = make()
    assert est.getBatchSize() == 32 and est.getEpochs() == 1
    assert est.getNumProc() is None and est.getValidation() is None
    assert est.getRandomSeed() == 0 and est.getUseGpu() == "auto"
    assert est.getRunId() is None and est.getInputShapes() is None and est.getOutputCols() is None
    assert (est.getPartitionsPerProcess(), est.getRowGroupSizeMb()) == (4, 32.0)
    assert (est.getCompression(), est.getDtype(), est.getReader()) == ("snappy", "float32", "arrow")
    assert est.getShuffle() is True and est.getShuffleBufferSize() is None
    assert est.getReaderNumWorkers() == 2 and est.getInmemoryCacheAll() is False
    assert est.getTrainStepsPerEpoch() is None and est.getValidationStepsPerEpoch() is None
    assert est.getTransformationFn() is None
    assert est.getCollectiveTimeout() == 600.0


def test_data_path_params_round_trip():
    def scale(batch):
        return batch

    est = make(
        partitions_per_process=2,
        row_group_size_mb=8,
        compression="zstd",
        dtype="float64",
        reader="petastorm",
        shuffle=False,
        shuffle_buffer_size=1000,
        reader_num_workers=4,
        inmemory_cache_all=True,
        train_steps_per_epoch=10,
        validation_steps_per_epoch=3,
        transformation_fn=scale,
    )
    assert est.getRowGroupSizeMb() == 8.0 and est.getPartitionsPerProcess() == 2
    assert (est.getCompression(), est.getDtype(), est.getReader()) == (
        "zstd",
        "float64",
        "petastorm",
    )
    assert not est.getShuffle() and est.getShuffleBufferSize() == 1000
    assert est.getReaderNumWorkers() == 4 and est.getInmemoryCacheAll()
    assert (est.getTrainStepsPerEpoch(), est.getValidationStepsPerEpoch()) == (10, 3)
    assert est.getTransformationFn() is scale
    assert est.setShuffleBufferSize(None).getShuffleBufferSize() is None


def test_getters_and_setters_round_trip(tmp_path):
    store = Store(str(tmp_path))
    est = make()
    assert est.setBatchSize(64) is est
    est.setEpochs(3).setNumProc(2).setValidation(0.25).setRandomSeed(7).setUseGpu(False)
    est.setRunId("r").setInputShapes([[-1, 2]]).setOutputCols(["p"]).setStore(store)
    est.setFeatureCols(["a", "b"]).setLabelCols(["c"])
    assert (est.getBatchSize(), est.getEpochs(), est.getNumProc()) == (64, 3, 2)
    assert (est.getValidation(), est.getRandomSeed(), est.getUseGpu()) == (0.25, 7, False)
    assert est.getRunId() == "r" and est.getInputShapes() == [[-1, 2]]
    assert est.getOutputCols() == ["p"] and est.getStore() is store
    assert est.getFeatureCols() == ["a", "b"] and est.getLabelCols() == ["c"]


def test_param_converters_reject_bad_types():
    with pytest.raises(TypeError):
        make(batch_size="many")
    with pytest.raises(TypeError, match="input_shapes"):
        make(input_shapes=[-1, 2])
    with pytest.raises(TypeError, match="validation"):
        make(validation=True)
    assert make(validation="is_val").getValidation() == "is_val"


@pytest.mark.parametrize("value, shown", [(0, False), (1, True), (2, True), (False, False)])
def test_verbose_takes_horovods_levels_and_booleans(value, shown):
    assert make(verbose=value).getVerbose() is shown
    assert make().setVerbose(value).getVerbose() is shown


@pytest.mark.parametrize("value", [3, -1, "yes", 1.0])
def test_verbose_refuses_other_values_naming_it(value):
    with pytest.raises((TypeError, ValueError), match="verbose"):
        make(verbose=value)


@pytest.mark.parametrize("stage", [TorchEstimator, LightningEstimator])
def test_use_gpu_defaults_to_auto(stage):
    assert stage().getUseGpu() == "auto"


@pytest.mark.parametrize("stage", [TorchEstimator, LightningEstimator, TorchModel])
def test_stage_level_scheduling_is_on_by_default_and_switched_off_by_keyword(stage):
    assert stage().getStageLevelScheduling() is True
    assert stage(stage_level_scheduling=False).getStageLevelScheduling() is False
    with pytest.raises(TypeError, match="stage_level_scheduling"):
        stage(stage_level_scheduling="no")


@pytest.mark.parametrize("value", ["auto", True, False])
def test_use_gpu_takes_auto_true_or_false(value, tmp_path):
    est = make(use_gpu=value)
    assert est.getUseGpu() is value if isinstance(value, bool) else est.getUseGpu() == value
    est.write().save(str(tmp_path / "est"))  # saved estimators keep True/False as they were
    assert TorchEstimator.load(str(tmp_path / "est")).getUseGpu() == value


@pytest.mark.parametrize("value", ["yes", "true", 1])
def test_use_gpu_refuses_other_values_naming_it(value):
    with pytest.raises(TypeError, match="use_gpu: expected 'auto', True or False"):
        make(use_gpu=value)


def test_copy_with_extra_changes_only_the_copy():
    est = make(epochs=2)
    other = est.copy({est.epochs: 5})
    assert other.getEpochs() == 5 and est.getEpochs() == 2
    assert other.getModel() is est.getModel() and other.uid == est.uid


def test_explain_params_documents_every_param():
    text = make().explainParams()
    for name in (
        "model",
        "optimizer",
        "loss",
        "feature_cols",
        "label_cols",
        "input_shapes",
        "output_cols",
        "batch_size",
        "epochs",
        "num_proc",
        "validation",
        "random_seed",
        "collective_timeout",
        "store",
        "use_gpu",
        "run_id",
        "partitions_per_process",
        "row_group_size_mb",
        "compression",
        "dtype",
        "reader",
        "shuffle",
        "shuffle_buffer_size",
        "reader_num_workers",
        "inmemory_cache_all",
        "train_steps_per_epoch",
        "validation_steps_per_epoch",
        "transformation_fn",
        "lr_scaling",
        "backward_passes_per_step",
        "gradient_compression",
        "gradient_reduction",
        "mixed_precision",
        "metrics",
        "loss_weights",
        "sample_weight_col",
        "lr_scheduler",
        "lr_scheduler_interval",
        "callbacks",
        "terminate_on_nan",
        "train_minibatch_fn",
        "loss_constructors",
        "keep_checkpoints",
    ):
        assert f"{name}:" in text


def test_model_params_and_accessors():
    net = torch.nn.Linear(2, 1)
    model = TorchModel(model=net, feature_cols=["x"], history=[{"epoch": 1}], run_id="r")
    assert model.getModel() is net and model.getFeatureCols() == ["x"]
    assert model.getHistory() == [{"epoch": 1}] and model.getRunId() == "r"
    assert model.setOutputCols(["p"]).getOutputCols() == ["p"]
    assert "feature_cols:" in model.explainParams()


@pytest.mark.parametrize("cls", [TorchEstimator, LightningEstimator, TorchModel])
def test_init_keywords_are_the_params_with_their_one_default(cls):
    stage = cls()
    keywords = dict(inspect.signature(cls.__init__).parameters)
    del keywords["self"]
    names = {p.name for p in stage.params}
    assert names <= set(keywords)
    for keyword, argument in keywords.items():
        name = SPARK_ALIASES.get(keyword, keyword)
        if name not in names:
            assert cls is TorchModel and keyword in TorchModel._NOT_PARAMS
            continue
        param = stage.getParam(name)
        default = stage.getOrDefault(param) if stage.hasDefault(param) else None
        assert repr(argument.default) == repr(default), keyword


@pytest.mark.parametrize("stage", [make, LightningEstimator, TorchModel])
def test_spark_columns_take_both_spellings(stage):
    snake = stage(probability_col="p", raw_prediction_col="r")
    spark = stage(probabilityCol="p", rawPredictionCol="r")
    for one in (snake, spark):
        assert (one.getProbabilityCol(), one.getRawPredictionCol()) == ("p", "r")
        assert {"probabilityCol", "rawPredictionCol"} <= {p.name for p in one.params}
        assert not {"probability_col", "raw_prediction_col"} & {p.name for p in one.params}
    assert stage(probability_col="p", probabilityCol="p").getProbabilityCol() == "p"
    assert snake.setProbabilityCol("q").getProbabilityCol() == "q"


def test_set_params_takes_the_snake_case_spelling():
    est = make().setParams(probability_col="p", raw_prediction_col="r")
    assert (est.getProbabilityCol(), est.getRawPredictionCol()) == ("p", "r")


@pytest.mark.parametrize("stage", [make, LightningEstimator, TorchModel])
def test_both_spellings_with_different_values_are_refused_naming_them(stage):
    with pytest.raises(ValueError, match="probability_col, probabilityCol"):
        stage(probability_col="p", probabilityCol="q")
    with pytest.raises(ValueError, match="raw_prediction_col, rawPredictionCol"):
        stage(raw_prediction_col="r", rawPredictionCol="s")


@pytest.mark.parametrize(
    "stage,spark_name,ours",
    [
        (make, "featuresCol", "feature_cols"),
        (make, "labelCol", "label_cols"),
        (LightningEstimator, "featuresCol", "feature_cols"),
        (LightningEstimator, "labelCol", "label_cols"),
        (TorchModel, "featuresCol", "feature_cols"),
        (TorchModel, "predictionCol", "output_cols"),
    ],
)
def test_spark_ml_column_names_point_to_ours(stage, spark_name, ours):
    """Spark ML's featuresCol/labelCol are refused naming the param to use instead, as a
    keyword and in setParams."""
    message = rf"{spark_name}: .*Spark ML's name.* {ours}=\['c'\]"
    with pytest.raises(TypeError, match=message):
        stage(**{spark_name: "c"})
    with pytest.raises(TypeError, match=message):
        stage()._set(**{spark_name: "c"})  # what setParams and the setters call


@pytest.mark.parametrize("stage", [make, LightningEstimator, TorchModel])
def test_a_single_column_name_is_a_one_element_list(stage):
    one = stage(feature_cols="features")
    assert one.getFeatureCols() == ["features"]
    assert one.setFeatureCols("x").getFeatureCols() == ["x"]
    if stage is not TorchModel:
        assert stage(label_cols="label").getLabelCols() == ["label"]
        assert one.setLabelCols("y").getLabelCols() == ["y"]


@pytest.mark.parametrize(
    "stage,typed,meant",
    [
        (TorchEstimator, {"lr": 0.1}, r"lr: not a param of TorchEstimator; did you mean "
         r"learning_rate=0\.1 \(or lr_scheduler, lr_scaling, lr_scheduler_interval\)\?"),
        (TorchEstimator, {"num_epochs": 5}, r"num_epochs: .* did you mean epochs=5\?"),
        (TorchEstimator, {"criterion": None}, r"criterion: .* did you mean loss=None\?"),
        (TorchEstimator, {"batch_sise": 8}, r"batch_sise: .* did you mean batch_size=8\?"),
        (TorchEstimator, {"seed": 1}, r"seed: .* did you mean random_seed=1\?"),
        (LightningEstimator, {"max_epochs": 3}, r"max_epochs: not a param of LightningEstimator; "
         r"did you mean epochs=3\?"),
        (TorchModel, {"feature_col": "x"}, r"feature_col: not a param of TorchModel; did you "
         r"mean feature_cols='x'\?"),
        (TorchModel, {"epochs": 3}, r"epochs: not a param of TorchModel; TorchModel\(\)"
         r"\.explainParams\(\) and docs/parameters\.md list them"),
    ],
)  # fmt: skip
def test_an_unknown_keyword_names_the_class_called_and_the_params_meant(stage, typed, meant):
    """Python's own error named the generated constructor (TorchEstimatorConstructor) and
    no param; the keyword and setParams now name the class and the closest params."""
    with pytest.raises(TypeError, match=f"^{meant}$"):
        stage(**typed)
    with pytest.raises(TypeError, match=f"^{meant}$"):
        stage().setParams(**typed) if stage is not TorchModel else stage()._set(**typed)


def test_unknown_keywords_are_named_together_and_optuna_search_names_itself():
    from spark_estimator.tuning import OptunaSearch

    with pytest.raises(TypeError) as info:
        make(lr=0.1, max_epochs=2)
    assert str(info.value).startswith("lr: not a param of TorchEstimator; did you mean ")
    assert "; max_epochs: not a param of TorchEstimator; did you mean epochs=2?" in str(info.value)
    with pytest.raises(TypeError, match=r"^n_trial: not a param of OptunaSearch; did you mean "):
        OptunaSearch(n_trial=3)


def test_a_lightning_estimator_points_trainer_arguments_and_the_rate_where_they_go():
    with pytest.raises(TypeError, match=r"^lr: not a param of LightningEstimator; the "):
        LightningEstimator(lr=0.1)  # "... LightningModule's configure_optimizers() sets ..."
    with pytest.raises(TypeError) as info:
        LightningEstimator(gradient_clip_val=0.5)
    assert str(info.value) == (
        "gradient_clip_val: not a param of LightningEstimator; a Lightning Trainer argument "
        "goes in trainer_args={'gradient_clip_val': 0.5}"
    )
    with pytest.raises(TypeError, match=r"^gradient_clip_val: .* docs/parameters\.md list them$"):
        TorchEstimator(gradient_clip_val=0.5)  # no far-fetched spelling offered


@pytest.mark.parametrize(
    "typed,module",
    [
        ("mse", torch.nn.MSELoss),
        ("MAE", torch.nn.L1Loss),
        ("l1", torch.nn.L1Loss),
        ("cross_entropy", torch.nn.CrossEntropyLoss),
        ("bce", torch.nn.BCELoss),
        ("bce-with-logits", torch.nn.BCEWithLogitsLoss),
        ("nll", torch.nn.NLLLoss),
        ("smooth_l1", torch.nn.SmoothL1Loss),
        ("huber", torch.nn.HuberLoss),
        ("CrossEntropyLoss", torch.nn.CrossEntropyLoss),  # torch's own class name
    ],
)
def test_a_loss_name_is_its_torch_module(typed, module):
    est = make(loss=typed)
    assert type(est.getLoss()) is module
    assert type(make().setLoss(typed).getLoss()) is module
    assert [type(fn) for fn in make(loss=[typed, "mse"]).getLoss()] == [module, torch.nn.MSELoss]


def test_a_loss_name_that_is_none_is_refused_listing_the_names():
    with pytest.raises(ValueError) as refused:
        make(loss="categorical_crossentropy")
    message = str(refused.value)
    assert message.startswith(
        "loss: 'categorical_crossentropy' is not a loss name (did you mean "
        "loss='cross_entropy'?); loss takes a loss module (loss=torch.nn.MSELoss()), a "
        "function (output, label) -> scalar tensor, or one of the names 'mse' / 'l2' (MSELoss)"
    )
    assert "'bce_with_logits' (BCEWithLogitsLoss)" in message
    with pytest.raises(ValueError, match=r"^loss: 'zzz' is not a loss name; loss takes "):
        make(loss=["mse", "zzz"])
