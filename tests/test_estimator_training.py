"""The training-loop parameters of TorchEstimator, end to end on local[4] with 2 processes.

Every test compares against a run or a value that would differ if the parameter were
ignored. The fits share one store, so the Parquet of each DataFrame is written once.
"""

import logging
import math
import shutil
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from pyspark.sql import functions as F

from spark_estimator import Store
from spark_estimator.callbacks import BestModel, Callback, EarlyStopping
from spark_estimator.shared.serialization import state_from_bytes
from spark_estimator.store import DatasetFolder
from spark_estimator.worker.data.shards import shard_bounds
from tests.conftest import LOCAL, linear_net, make_estimator, regression_rows, spark_session
from tests.worker.comm.test_adasum import reference_adasum

ROWS = 128  # 64 per process: batches of 8 and 16 cut each shard at the same rows


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return Store.create(str(tmp_path_factory.mktemp("training") / "store"))


@pytest.fixture(scope="module")
def df():
    rows = [(x, y, i, 2.0, i % 4 == 0) for x, y, i in regression_rows(ROWS)]
    schema = "x array<double>, y double, id long, w double, v boolean"
    return spark_session(LOCAL).createDataFrame(rows, schema)


def weights(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.getModel().parameters()])


def ranks(store, model):
    return store.read_json(store.run(model.getRunId()).ranks)


def checkpoint(store, model, epoch):
    path = store.run(model.getRunId()).checkpoint(epoch)
    return state_from_bytes(store.read_bytes(path))


def fit(df, store, lr=0.1, net=None, **params):
    net = net if net is not None else linear_net()
    params.setdefault("optimizer", torch.optim.SGD(net.parameters(), lr=lr))
    return make_estimator(net, store, shuffle=False, **params).fit(df)


def test_linear_lr_scaling_multiplies_learning_rates_by_the_process_count(df, store):
    scaled = fit(df, store, lr=0.05, lr_scaling="linear")
    plain = fit(df, store, lr=0.1)
    assert torch.allclose(weights(scaled), weights(plain), atol=1e-6)
    summary = scaled.getTrainingSummary()
    assert summary["base_learning_rates"] == [0.05] and summary["learning_rates"] == [0.1]
    assert [h["lr"] for h in scaled.getHistory()] == [[0.1]] * 3
    assert plain.getTrainingSummary()["lr_scaling"] == "none"


def first_log_line(caplog) -> str:
    return next(r.getMessage() for r in caplog.records if r.name.startswith("spark_estimator"))


def test_the_fits_first_log_line_states_each_ranks_learning_rate_and_why(df, store, caplog):
    caplog.set_level(logging.INFO, logger="spark_estimator")
    net = linear_net()
    groups = [{"params": [net.weight]}, {"params": [net.bias], "lr": 0.01}]
    fit(
        df, store, net=net, optimizer=torch.optim.SGD(groups, lr=0.1), lr_scaling="linear", epochs=1
    )
    assert first_log_line(caplog) == (
        "learning rates [0.2, 0.02] on each of 2 ranks: the optimizer's [0.1, 0.01] x 2 "
        "(lr_scaling='linear', as Horovod's estimator)"
    )
    caplog.clear()
    fit(df, store, learning_rate=0.05, epochs=1)
    assert first_log_line(caplog) == (
        "learning rate 0.05 on each of 2 ranks: learning_rate's 0.05 as given "
        "(lr_scaling='none'; Horovod's estimator would use 0.1: set lr_scaling='linear')"
    )


def test_accumulating_k_batches_equals_one_batch_k_times_bigger(df, store):
    accumulated = fit(df, store, batch_size=8, backward_passes_per_step=2)
    big = fit(df, store, batch_size=16)
    small = fit(df, store, batch_size=8)
    assert torch.allclose(weights(accumulated), weights(big), atol=1e-6)
    assert not torch.allclose(weights(small), weights(big), atol=1e-3)
    assert [r["optimizer_steps_per_epoch"] for r in ranks(store, accumulated)] == [[4] * 3] * 2
    assert accumulated.getTrainingSummary()["backward_passes_per_step"] == 2


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_gradient_compression_communicates_in_the_chosen_dtype(df, store, dtype):
    compressed = fit(
        df, store, gradient_compression=dtype, backward_passes_per_step=2, batch_size=8
    )
    summaries = ranks(store, compressed)
    assert {tuple(r["communicated_dtypes"]) for r in summaries} == {
        ("float16" if dtype == "fp16" else "bfloat16",)
    }
    # no_sync: one communication per optimizer step, not per batch (one bucket here)
    assert {r["gradient_allreduces"] for r in summaries} == {4 * 3}
    exact = fit(df, store, backward_passes_per_step=2, batch_size=8)
    assert ranks(store, exact)[0]["communicated_dtypes"] is None
    assert {r["gradient_path"] for r in summaries} == {"gloo compressed"}
    # two CPU ranks on one host: gradients go through shared memory, also once per step
    assert {(r["gradient_path"], r["gradient_allreduces"]) for r in ranks(store, exact)} == {
        ("shared memory", 4 * 3)
    }
    if dtype == "fp16":  # one process communicates nothing: no dtype is recorded
        alone = ranks(store, fit(df, store, gradient_compression=dtype, num_proc=1))
        assert [(r["gradient_path"], r["communicated_dtypes"]) for r in alone] == [
            ("none (one process)", None)
        ]
    assert not torch.equal(weights(compressed), weights(exact))
    assert torch.allclose(weights(compressed), weights(exact), atol=0.05)


def rank_gradients(store, path) -> list[list[torch.Tensor]]:
    """Per rank, the gradients of linear_net()'s MSE over the rank's shard of the
    materialized training rows at ``path`` (the rows in file order, cut by shard_bounds)."""
    files = store.read_json(DatasetFolder(path).meta)["files"]["train"]
    table = pa.concat_tables(pq.read_table(f"{path}/{name}") for name, *_ in files)
    x = torch.tensor(table.column("x").to_pylist(), dtype=torch.float32)
    y = torch.tensor(table.column("y").to_pylist(), dtype=torch.float32)
    gradients = []
    for rank in range(2):
        start, end = shard_bounds(len(y), 2, rank)
        net = linear_net()
        torch.nn.MSELoss()(net(x[start:end]).squeeze(1), y[start:end]).backward()
        gradients.append([p.grad for p in net.parameters()])
    return gradients


def test_adasum_takes_one_sgd_step_along_the_adasum_of_the_ranks_gradients(df, store):
    one_step = dict(epochs=1, batch_size=ROWS // 2)  # a step per rank's shard
    net = linear_net()
    est = make_estimator(
        net,
        store,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        gradient_reduction="adasum",
        shuffle=False,
        **one_step,
    )
    adasum = est.fit(df)
    average = fit(df, store, **one_step)
    start = [p.detach() for p in linear_net().parameters()]
    grads = rank_gradients(store, est.materialize(df))
    mean = torch.cat([(w - 0.1 * (a + b) / 2).flatten() for w, a, b in zip(start, *grads)])
    assert torch.allclose(weights(average), mean, atol=1e-6)  # the reference gradients hold
    combined = [torch.from_numpy(reference_adasum([a.numpy(), b.numpy()])) for a, b in zip(*grads)]
    expected = torch.cat([(w - 0.1 * g).flatten() for w, g in zip(start, combined)])
    assert torch.allclose(weights(adasum), expected, atol=1e-6)
    assert not torch.allclose(weights(adasum), weights(average), atol=1e-4)
    assert {(r["gradient_path"], r["gradient_allreduces"]) for r in ranks(store, adasum)} == {
        ("adasum (gloo)", 1)
    }
    assert ranks(store, adasum)[0]["communicated_dtypes"] is None
    assert adasum.getTrainingSummary()["gradient_reduction"] == "adasum"


def test_adasum_with_compression_sends_the_compressed_dtype(df, store):
    model = fit(df, store, gradient_reduction="adasum", gradient_compression="bf16", epochs=2)
    summaries = ranks(store, model)
    assert {r["gradient_path"] for r in summaries} == {"adasum (gloo) compressed"}
    assert {tuple(r["communicated_dtypes"]) for r in summaries} == {("bfloat16",)}
    assert model.getHistory()[-1]["train"]["loss"] < model.getHistory()[0]["train"]["loss"]


class DtypeProbe(torch.nn.Module):
    """A linear model that records the dtype its layer computed in during training."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 1)
        self.register_buffer("seen", torch.zeros(3))

    def forward(self, x):
        out = self.lin(x)
        if self.training:
            kinds = [torch.float32, torch.float16, torch.bfloat16]
            self.seen[kinds.index(out.dtype)] = 1.0
        return out


@pytest.mark.parametrize("precision,index", [("none", 0), ("fp16", 1), ("bf16", 2)])
def test_mixed_precision_runs_forward_under_autocast(df, store, precision, index):
    net = DtypeProbe()
    model = fit(df, store, net=net, mixed_precision=precision, epochs=1)
    assert model.getModel().seen.tolist() == [float(i == index) for i in range(3)]
    assert math.isfinite(model.getHistory()[0]["train"]["loss"])
    assert ("scaler" in checkpoint(store, model, 1)) == (precision == "fp16")


def test_metrics_are_averaged_over_all_rows_per_split(df, store):
    def label_mean(output, label):
        return label.mean()

    model = fit(df, store, validation="v", epochs=2, metrics=[label_mean])
    ys = df.select("y", "v").collect()
    train_mean = sum(r.y for r in ys if not r.v) / sum(1 for r in ys if not r.v)
    val_mean = sum(r.y for r in ys if r.v) / sum(1 for r in ys if r.v)
    for record in model.getHistory():
        assert record["train"]["label_mean"] == pytest.approx(train_mean, rel=1e-5)
        assert record["validation"]["label_mean"] == pytest.approx(val_mean, rel=1e-5)


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.a(x), self.b(x)


def test_loss_weights_and_one_loss_per_label_column(df, store):
    two = df.withColumn("y2", F.col("y") * 2)
    net = TwoHeads()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    model = fit(
        two,
        store,
        net=net,
        label_cols=["y", "y2"],
        loss=[torch.nn.MSELoss(), torch.nn.L1Loss()],
        loss_weights=[1.0, 0.0],
        metrics={"mae": lambda o, y: (o - y).abs().mean()},
    )
    after = model.getModel().state_dict()
    assert torch.equal(after["b.weight"], before["b.weight"])  # weight 0: head b never moves
    assert not torch.equal(after["a.weight"], before["a.weight"])
    assert set(model.getHistory()[0]["train"]) == {"loss", "mae_y", "mae_y2"}


def test_sample_weights_scale_each_rows_loss(df, store):
    # full batches (64 rows per process), so the row order of the two datasets cannot matter
    doubled = fit(df, store, lr=0.05, sample_weight_col="w", batch_size=64)
    plain = fit(df, store, lr=0.1, batch_size=64)
    assert torch.allclose(weights(doubled), weights(plain), atol=1e-5)
    unweighted_half = fit(df, store, lr=0.05, batch_size=64)
    assert not torch.allclose(weights(unweighted_half), weights(plain), atol=1e-3)


def binary(df):
    """The regression rows with 0/1 labels: float 'b' and integer 'c'."""
    positive = F.col("y") > 0
    return df.withColumn("b", positive.cast("double")).withColumn("c", positive.cast("int"))


def sigmoid_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 1), torch.nn.Sigmoid())


def test_a_loss_function_taking_reduction_weights_rows_like_the_loss_module(df, store):
    bdf = binary(df)
    params = dict(label_cols=["b"], sample_weight_col="w", batch_size=64)
    bce = torch.nn.functional.binary_cross_entropy
    function = fit(bdf, store, net=sigmoid_net(), loss=bce, **params)
    module = fit(bdf, store, net=sigmoid_net(), loss=torch.nn.BCELoss(), **params)
    assert torch.allclose(weights(function), weights(module), atol=1e-6)
    # the weighted mean: every weight is 2, so twice the unweighted loss at the same weights
    unweighted = fit(bdf, store, net=sigmoid_net(), loss=bce, label_cols=["b"], batch_size=64)
    first = [m.getHistory()[0]["train"]["loss"] for m in (function, unweighted)]
    assert first[0] == pytest.approx(2 * first[1], rel=1e-5)


def test_integer_01_labels_train_a_bce_loss_like_float_labels(df, store):
    # full batches (64 rows per process), so the row order of the two datasets cannot matter
    bdf, bce = binary(df), torch.nn.BCELoss()
    ints = fit(bdf, store, net=sigmoid_net(), loss=bce, label_cols=["c"], batch_size=64)
    floats = fit(bdf, store, net=sigmoid_net(), loss=bce, label_cols=["b"], batch_size=64)
    assert torch.allclose(weights(ints), weights(floats), atol=1e-6)


def test_param_groups_and_constructor_arguments_survive(df, store):
    net = torch.nn.Linear(3, 1)
    bias = net.bias.detach().clone()
    optimizer = torch.optim.SGD(
        [{"params": [net.weight], "lr": 0.05}, {"params": [net.bias], "lr": 0.0}],
        lr=0.1,
        momentum=0.9,
        nesterov=True,
    )
    model = fit(df, store, net=net, optimizer=optimizer)
    assert torch.equal(model.getModel().bias.detach(), bias)
    groups = checkpoint(store, model, 3)["optimizer"]["param_groups"]
    assert [(g["lr"], g["momentum"], g["nesterov"]) for g in groups] == [
        (0.05, 0.9, True),
        (0.0, 0.9, True),
    ]


def test_lr_scheduler_steps_per_epoch(df, store):
    model = fit(df, store, lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5))
    assert [h["lr"] for h in model.getHistory()] == [[0.1], [0.05], [0.025]]
    assert checkpoint(store, model, 3)["lr_scheduler"]["last_epoch"] == 3


def test_lr_scheduler_steps_per_optimizer_step(df, store):
    model = fit(
        df,
        store,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, 0.9),
        lr_scheduler_interval="step",
        backward_passes_per_step=2,
        epochs=2,
    )
    # 64 rows per process in batches of 16 = 4 batches, 2 optimizer steps per epoch
    assert [h["lr"] for h in model.getHistory()] == [[0.1], [pytest.approx(0.1 * 0.9**2)]]


def test_early_stopping_best_model_and_checkpoint_retention(df, store):
    # the training loss falls every epoch, so "max" mode never improves after epoch 1
    model = fit(
        df,
        store,
        epochs=10,
        keep_checkpoints=1,
        callbacks=[
            EarlyStopping(monitor="train.loss", mode="max", patience=2),
            BestModel(monitor="train.loss", mode="max"),
        ],
    )
    history = model.getHistory()
    assert [h["epoch"] for h in history] == [1, 2, 3]
    summary = model.getTrainingSummary()
    assert summary["stopped_early"] and summary["early_stopping_epoch"] == 3
    assert summary["selected_epoch"] == 1
    assert summary["selection"]["value"] == pytest.approx(history[0]["train"]["loss"])
    assert summary["checkpoints"] == [1, 3]  # the last one and the best one
    best = checkpoint(store, model, 1)["model"]
    assert all(torch.equal(best[k], v) for k, v in model.getModel().state_dict().items())


class Recorder(Callback):
    """Records its hooks in the history; asks to stop on rank 1 at epoch 1 (ignored) and
    on rank 0 at epoch 2 (followed by every rank)."""

    def __init__(self):
        self.calls = []

    def on_train_begin(self, state):
        self.calls.append("train_begin")

    def on_epoch_begin(self, epoch, state):
        self.calls.append(f"begin{epoch}")

    def on_epoch_end(self, epoch, logs, state):
        self.calls.append(f"end{epoch}")
        logs["calls"] = list(self.calls)
        if (state.rank, epoch) in ((1, 1), (0, 2)):
            state.stop_training = True


def test_user_callbacks_hooks_and_rank_zero_decides_to_stop(df, store):
    model = fit(df, store, epochs=5, callbacks=[Recorder()])
    history = model.getHistory()
    assert [h["epoch"] for h in history] == [1, 2]
    assert history[1]["calls"] == ["train_begin", "begin1", "end1", "begin2", "end2"]


class NanOnRank1:
    """MSE, except NaN for rank 1's third batch of epoch 2 (4 batches per epoch)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, output, label):
        import torch.distributed as dist

        self.calls += 1
        loss = torch.nn.functional.mse_loss(output, label)
        return loss * float("nan") if dist.get_rank() == 1 and self.calls == 4 + 3 else loss


def test_terminate_on_nan_names_epoch_step_and_keeps_the_last_good_checkpoint(df, store):
    with pytest.raises(Exception, match=r"terminate_on_nan: .* epoch 2, step 3 \(rank 1") as e:
        fit(df, store, loss=NanOnRank1(), run_id="nan-run")
    assert "checkpoints/epoch-0001.pt" in str(e.value)
    assert store.exists(store.run("nan-run").checkpoint(1))
    assert not store.exists(store.run("nan-run").checkpoint(2))
    model = fit(df, store, loss=NanOnRank1(), terminate_on_nan=False)
    assert math.isnan(model.getHistory()[1]["train"]["loss"])


def test_train_minibatch_fn_replaces_the_step(df, store):
    def frozen_step(model, optimizer, loss_fn, inputs, labels):
        optimizer.zero_grad()
        outputs = model(*inputs)
        loss = loss_fn(outputs, labels)
        loss.backward()
        for p in model.parameters():
            p.grad.zero_()  # a step that never moves the weights
        optimizer.step()
        return outputs, loss

    net = torch.nn.Linear(3, 1)
    before = torch.cat([p.detach().flatten().clone() for p in net.parameters()])
    model = fit(df, store, net=net, train_minibatch_fn=frozen_step, epochs=2)
    assert torch.equal(weights(model), before)
    history = model.getHistory()
    assert history[0]["train"]["loss"] == pytest.approx(history[1]["train"]["loss"])


class Unpicklable(torch.nn.MSELoss):
    def __reduce__(self):
        raise TypeError("this loss holds a handle that cannot be pickled")


def test_loss_constructors_build_unpicklable_losses_on_the_executors(df, store):
    with pytest.raises(TypeError, match="loss: cannot be serialized"):
        fit(df, store, loss=Unpicklable())
    built = fit(df, store, loss=None, loss_constructors=[Unpicklable])
    plain = fit(df, store)
    assert torch.allclose(weights(built), weights(plain))


def test_use_gpu_true_without_gpus_configured_fails_on_the_driver_before_any_job(df, tmp_path):
    store = Store.create(str(tmp_path / "store"))  # the module's store holds earlier fits
    with pytest.raises(ValueError, match=r"use_gpu: True .*spark.task.resource.gpu.amount"):
        fit(df, store, use_gpu=True, epochs=1)
    assert not store.exists(store.datasets) and not store.exists(store.runs)


def test_each_epoch_records_where_each_ranks_time_went(df, store):
    def slow(batch):  # a transformation that makes the step wait for its data
        time.sleep(0.02)
        return batch

    model = fit(df, store, epochs=2, transformation_fn=slow)
    steps = ranks(store, model)[0]["batches_per_epoch"]
    for record, batches in zip(model.getHistory(), steps, strict=True):
        seconds = record["seconds"]
        assert set(seconds) == {"train", "data", "compute", "communication"}
        for rank in range(2):
            parts = [seconds[k][rank] for k in ("data", "compute", "communication")]
            assert sum(parts) == pytest.approx(seconds["train"][rank], rel=0.1)
            assert seconds["data"][rank] >= 0.02 * batches
            assert seconds["compute"][rank] > 0
            assert seconds["communication"][rank] > 0  # gradients averaged in shared memory
    assert model.getTrainingSummary()["seconds_per_rank"] == {
        kind: [
            round(sum(r["seconds"][kind][rank] for r in model.getHistory()), 3) for rank in (0, 1)
        ]
        for kind in ("train", "data", "compute", "communication")
    }


class CountingBackend:
    """A torch.compile backend that runs dynamo's graphs as traced, and appends one line per
    graph to a file: the fit went through dynamo only if the file has lines."""

    def __init__(self, path):
        self.path = str(path)

    def __call__(self, graph, example_inputs):
        with open(self.path, "a") as f:
            f.write(f"{len(example_inputs)}\n")
        return graph.forward


def test_compile_trains_the_ddp_module_through_dynamo_like_eager(df, store, tmp_path):
    counted = tmp_path / "graphs.txt"
    compiled = fit(df, store, compile={"backend": CountingBackend(counted)}, epochs=2)
    eager = fit(df, store, epochs=2)
    assert len(counted.read_text().splitlines()) >= 2  # at least one graph on each rank
    assert torch.allclose(weights(compiled), weights(eager), atol=1e-6)
    assert [r["compiled"] for r in ranks(store, compiled)] == ["CountingBackend"] * 2
    assert [r["compiled"] for r in ranks(store, eager)] == [None, None]
    # what is checkpointed and saved is the plain module's state dict
    assert set(checkpoint(store, compiled, 2)["model"]) == {"weight", "bias"}
    path = str(tmp_path / "model")
    compiled.save(path)
    loaded = type(compiled).load(path)
    assert torch.equal(weights(loaded), weights(compiled))


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor on CPU needs a C++ compiler")
def test_compile_true_runs_inductor_on_cpu(df, store):
    compiled = fit(df, store, compile=True, epochs=1)
    eager = fit(df, store, epochs=1)
    assert [r["compiled"] for r in ranks(store, compiled)] == ["inductor"] * 2
    # inductor's fused kernels round differently from eager's
    assert torch.allclose(weights(compiled), weights(eager), atol=1e-4)


def test_batch_norm_statistics_end_the_same_on_every_rank_as_rank_zeros(df, store):
    """DDP gives every rank rank 0's buffers at each forward, so each epoch ends with the
    ranks' own running statistics of their last batch: they are made rank 0's there, so
    validation, the checkpoint and the fitted model agree (the fit compares the ranks'
    final weights, buffers included)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(3, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
    )
    model = make_estimator(net, store, epochs=2, validation=0.2, run_id="bn").fit(df)
    norm = model.getModel()[1]
    assert norm.num_batches_tracked.item() > 0 and not torch.equal(
        norm.running_mean, torch.zeros(8)
    )
    checkpoint = state_from_bytes(store.read_bytes(store.run("bn").checkpoint(2)))["model"]
    torch.testing.assert_close(checkpoint["1.running_var"], norm.running_var)
