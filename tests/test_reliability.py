"""Failures during a fit (local[4]): no hangs, the first error reported, resume by run_id."""

import threading
import time
from pathlib import Path

import pytest
import torch

from spark_estimator import TrainingError
from spark_estimator.callbacks import Callback, EarlyStopping
from tests.conftest import (
    LOCAL,
    linear_net,
    make_estimator,
    regression_rows,
    spark_session,
    stop_session,
)
from tests.faults import Fault


def dropout_net(seed=0):
    """Random in training (dropout), so an exact resume must restore the random state."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
    )


def momentum_estimator(store, **params):
    net = dropout_net()
    base = dict(
        optimizer=torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7),
        epochs=4,
        batch_size=20,
    )
    return make_estimator(net, store, **{**base, **params})


def weights(model):
    return model.getModel().state_dict()


def assert_same_training(resumed, clean):
    for name, value in weights(clean).items():
        torch.testing.assert_close(weights(resumed)[name], value, rtol=0, atol=1e-6)
    assert [h["epoch"] for h in resumed.getHistory()] == [1, 2, 3, 4]
    for got, want in zip(resumed.getHistory(), clean.getHistory()):
        assert got["train"]["loss"] == pytest.approx(want["train"]["loss"], abs=1e-6)
        assert got["lr"] == pytest.approx(want["lr"])


def test_a_rank_that_raises_fails_the_fit_at_once_with_its_traceback(
    regression_df, store, tmp_path
):
    fault = Fault("raise", rank=1, epoch=2, marker=tmp_path / "m", once=False)
    est = momentum_estimator(store, callbacks=[fault], run_id="raises")
    started = time.monotonic()
    with pytest.raises(TrainingError, match="ValueError: injected fault on rank 1") as info:
        est.fit(regression_df)
    elapsed = time.monotonic() - started
    assert elapsed < 60, elapsed  # not a collective timeout (600 s by default)
    assert info.value.rank == 1 and info.value.remote_type == "ValueError"
    assert "in fire" in info.value.remote_traceback  # the remote frames come along
    # the epoch before the failure stays checkpointed for a later fit to resume
    assert store.checkpoint_epochs("raises") == [1]


@pytest.mark.parametrize(
    "params",
    [
        {},
        # 5 batches per pass, epochs of 3 in groups of 2: epochs and groups cross passes
        dict(train_steps_per_epoch=3, backward_passes_per_step=2),
    ],
)
def test_a_fit_with_the_run_id_of_a_failed_run_resumes_it_exactly(
    regression_df, store, tmp_path, params
):
    clean = momentum_estimator(store, run_id="clean", **params).fit(regression_df)
    fault = Fault("raise", rank=0, epoch=3, marker=tmp_path / "m", after_batches=1)
    with pytest.raises(TrainingError, match="injected fault on rank 0 at epoch 3"):
        momentum_estimator(store, callbacks=[fault], run_id="again", **params).fit(regression_df)
    assert store.checkpoint_epochs("again") == [1, 2]

    resumed = momentum_estimator(store, run_id="again", **params).fit(regression_df)
    assert resumed.getTrainingSummary()["resumed_from_epoch"] == 2
    assert_same_training(resumed, clean)
    # the rates it trained with: the checkpoint's (StepLR: 0.05 x 0.7^2), not the fit's 0.05
    assert resumed.getTrainingSummary()["learning_rates"] == pytest.approx([0.05 * 0.7**2])
    assert resumed.getHistory()[2]["lr"] == pytest.approx([0.05 * 0.7**2])


def test_a_new_driver_on_equal_rows_resumes_the_run_with_its_split_and_other_rows_are_refused(
    spark, store, tmp_path
):
    """Rows from a Python list have no identity beyond their Spark application: a new
    driver's equal rows (here in another order) are known by their content, so the run
    resumes on the first copy, its validation split included; other rows are refused,
    naming what differs."""
    rows, schema = regression_rows(), "x array<double>, y double, id long"
    df = spark.createDataFrame(rows, schema)
    params = dict(validation=0.25)
    clean = momentum_estimator(store, run_id="clean", **params).fit(df)
    fault = Fault("raise", rank=0, epoch=3, marker=tmp_path / "m", after_batches=1)
    with pytest.raises(TrainingError, match="injected fault on rank 0 at epoch 3"):
        momentum_estimator(store, callbacks=[fault], run_id="moved", **params).fit(df)
    assert store.checkpoint_epochs("moved") == [1, 2]

    before = spark.sparkContext.applicationId
    stop_session(LOCAL)
    spark = spark_session(LOCAL)  # a new driver's application
    assert spark.sparkContext.applicationId != before
    again = spark.createDataFrame(rows[::-1], schema)
    resumed = momentum_estimator(store, run_id="moved", **params).fit(again)
    assert resumed.getTrainingSummary()["resumed_from_epoch"] == 2  # epochs 1-2 not trained
    assert_same_training(resumed, clean)  # the same training and validation rows
    for got, want in zip(resumed.getHistory(), clean.getHistory()):
        assert got["validation"]["loss"] == pytest.approx(want["validation"]["loss"], abs=1e-6)

    changed = spark.createDataFrame([(rows[0][0], rows[0][1] + 1.0, 0)] + rows[1:], schema)
    with pytest.raises(ValueError) as refused:
        momentum_estimator(store, run_id="moved", epochs=5, **params).fit(changed)
    message = str(refused.value)
    assert "run_id: run 'moved' has checkpoints up to epoch 4 made with another data: " in message
    assert "the rows' content (digest " in message and "of 200 rows" in message


def test_a_finished_run_fit_again_with_more_epochs_trains_on_from_its_last_checkpoint(
    regression_df, store, spark
):
    """Horovod's way of training further: the same run_id, more epochs."""
    clean = momentum_estimator(store, run_id="four").fit(regression_df)
    momentum_estimator(store, run_id="on", epochs=2).fit(regression_df)

    spark.sparkContext.setJobGroup("refit", "nothing to add")
    try:
        with pytest.raises(ValueError, match=r"run_id: run 'on' already finished 2 epochs"):
            momentum_estimator(store, run_id="on", epochs=2).fit(regression_df)
    finally:
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)
    assert list(spark.sparkContext.statusTracker().getJobIdsForGroup("refit")) == []

    further = momentum_estimator(store, run_id="on", epochs=4).fit(regression_df)
    assert further.getTrainingSummary()["resumed_from_epoch"] == 2
    assert_same_training(further, clean)
    assert store.checkpoint_epochs("on") == [1, 2, 3, 4]


def test_a_finished_run_without_checkpoints_is_refused_naming_why(regression_df, store):
    momentum_estimator(store, run_id="emptied", epochs=1).fit(regression_df)
    store.fs.rm(store.run("emptied").checkpoint(1))
    with pytest.raises(ValueError, match=r"run 'emptied' already finished .*no epoch checkpoint"):
        momentum_estimator(store, run_id="emptied", epochs=3).fit(regression_df)


def test_a_rank_that_hangs_is_left_after_collective_timeout_and_the_fit_resumes(
    regression_df, store, tmp_path
):
    marker = tmp_path / "hung"
    fault = Fault("hang", rank=1, epoch=2, marker=marker)
    est = momentum_estimator(store, callbacks=[fault], collective_timeout=3.0)
    started = time.monotonic()
    model = est.fit(regression_df)
    elapsed = time.monotonic() - started
    assert marker.exists()  # the hang happened
    assert elapsed < 60, elapsed
    assert model.getTrainingSummary()["resumed_from_epoch"] == 1
    assert [h["epoch"] for h in model.getHistory()] == [1, 2, 3, 4]


def test_an_io_error_is_retried_and_the_fit_resumes(regression_df, store, tmp_path):
    marker = tmp_path / "io"
    fault = Fault("io-error", rank=1, epoch=2, marker=marker)
    model = momentum_estimator(store, callbacks=[fault]).fit(regression_df)
    assert marker.exists()
    assert model.getTrainingSummary()["resumed_from_epoch"] == 1


def test_resuming_refuses_another_model_or_fewer_epochs(regression_df, store, tmp_path, spark):
    fault = Fault("raise", rank=0, epoch=3, marker=tmp_path / "m", once=False)
    with pytest.raises(TrainingError):
        momentum_estimator(store, callbacks=[fault], run_id="r").fit(regression_df)
    before = sorted(p.name for p in Path(store.run("r").path).rglob("*"))

    refusals = [
        (make_estimator(linear_net(), store, run_id="r", epochs=4), "made with another model"),
        (momentum_estimator(store, run_id="r", epochs=1), "up to epoch 2, past epochs=1"),
        (momentum_estimator(store, run_id="r", num_proc=3), "made with another num_proc"),
        (momentum_estimator(store, run_id="r", lr_scaling="linear"), r"another lr_scaling \("),
    ]
    spark.sparkContext.setJobGroup("refusals", "resume refusals")
    try:
        for est, message in refusals:
            with pytest.raises(ValueError, match=f"run_id: run 'r' .*{message}"):
                est.fit(regression_df)
    finally:
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)
    assert list(spark.sparkContext.statusTracker().getJobIdsForGroup("refusals")) == []
    assert sorted(p.name for p in Path(store.run("r").path).rglob("*")) == before


def test_two_fits_in_threads_share_the_store(regression_df, store):
    def estimator(lr, run_id):  # built on the main thread: torch's seed is process-wide
        net = linear_net()
        return make_estimator(
            net, store, optimizer=torch.optim.SGD(net.parameters(), lr=lr), run_id=run_id
        )

    def fit(est, out):
        try:
            out[est.getRunId()] = est.fit(regression_df)
        except Exception as e:  # reported below, not lost in the thread
            out[est.getRunId()] = e

    together = {}
    threads = [
        threading.Thread(target=fit, args=(estimator(lr, f"thread-{lr}"), together))
        for lr in (0.1, 0.05)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(not isinstance(m, Exception) for m in together.values()), together
    alone = {}
    for lr in (0.1, 0.05):
        fit(estimator(lr, f"alone-{lr}"), alone)
    for lr in (0.1, 0.05):
        for name, value in weights(alone[f"alone-{lr}"]).items():
            torch.testing.assert_close(weights(together[f"thread-{lr}"])[name], value)
    first, second = (weights(together[f"thread-{lr}"])["weight"] for lr in (0.1, 0.05))
    assert not torch.equal(first, second)


def test_an_elastic_fit_still_fails_at_once_on_an_error_of_the_training_code(
    regression_df, store, tmp_path
):
    fault = Fault("raise", rank=1, epoch=2, marker=tmp_path / "m", once=False)
    est = momentum_estimator(store, callbacks=[fault], num_proc=2, min_num_proc=1)
    started = time.monotonic()
    with pytest.raises(TrainingError, match="ValueError: injected fault on rank 1"):
        est.fit(regression_df)
    assert time.monotonic() - started < 60  # not started again: it would raise again


def test_a_fit_that_loses_processes_more_than_max_restarts_times_fails(
    regression_df, store, tmp_path
):
    fault = Fault("kill", rank=1, epoch=2, marker=tmp_path / "m")
    est = momentum_estimator(store, callbacks=[fault], max_restarts=0, run_id="lost")
    with pytest.raises(RuntimeError, match="lost processes 1 times, more than max_restarts=0"):
        est.fit(regression_df)
    assert (tmp_path / "m").exists()
    assert store.checkpoint_epochs("lost") == [1]  # a later fit resumes from there


def test_a_fit_started_again_goes_on_exactly_from_its_last_commit_inside_the_epoch(
    regression_df, store, tmp_path
):
    clean = momentum_estimator(store, run_id="clean", commit_every_steps=1).fit(regression_df)
    # 5 batches an epoch: rank 1 dies in its 3rd batch of epoch 3, after the commit of step 2
    fault = Fault("kill", rank=1, epoch=3, marker=tmp_path / "m", after_batches=3)
    est = momentum_estimator(
        store, callbacks=[fault], commit_every_steps=1, run_id="commits", log_every_steps=1
    )
    resumed = est.fit(regression_df)
    assert (tmp_path / "m").exists()
    summary = resumed.getTrainingSummary()
    assert summary["resumed_from_commit"] == {"epoch": 3, "step": 2}
    assert summary["resumed_from_epoch"] == 2
    assert_same_training(resumed, clean)  # random state, sums and batches went on exactly
    # TensorBoard's step axis: every batch once, the failed attempt's 3rd batch not twice
    tb = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = tb.EventAccumulator(str(store.run("commits").tensorboard))
    acc.Reload()
    assert [e.step for e in acc.Scalars("step/train_loss")] == list(range(1, 21))
    assert [(e.step, e.value) for e in acc.Scalars("step/epoch")] == [
        (5, 1),
        (10, 2),
        (15, 3),
        (20, 4),
    ]


def mean_absolute_error(output, label):
    return (output.view(-1) - label.view(-1)).abs().mean()


def test_training_further_with_what_changes_the_historys_meaning_is_refused_naming_both(
    regression_df, store, spark
):
    """A history's numbers mean what the loss, metrics, loss_weights and sample weights
    made them: a fit that changes one of them cannot go on with the run."""
    momentum_estimator(store, run_id="lr", epochs=2).fit(regression_df)
    history = store.read_json(store.run("lr").manifest)
    before = sorted(p.name for p in Path(store.run("lr").path).rglob("*"))
    refusals = [
        (dict(loss=torch.nn.L1Loss()), r"loss \(was torch.nn.MSELoss\(.*now torch.nn.L1Loss\("),
        (
            dict(loss=torch.nn.MSELoss(reduction="sum")),
            r"loss \(was torch.nn.MSELoss\(reduction='mean'\), now .*reduction='sum'",
        ),
        (dict(metrics=[mean_absolute_error]), r"metrics \(was None, now .*mean_absolute_error"),
        (dict(loss_weights=[2.0]), r"loss_weights \(was None, now \[2.0\]\)"),
        (dict(sample_weight_col="id"), r"sample_weight_col \(was None, now 'id'\)"),
    ]
    spark.sparkContext.setJobGroup("changed", "train further with another loss")
    try:
        for params, message in refusals:
            with pytest.raises(ValueError, match=f"run_id: run 'lr' .*{message}.*new run_id"):
                momentum_estimator(store, run_id="lr", epochs=4, **params).fit(regression_df)
    finally:
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)
    assert list(spark.sparkContext.statusTracker().getJobIdsForGroup("changed")) == []
    assert sorted(p.name for p in Path(store.run("lr").path).rglob("*")) == before
    assert store.read_json(store.run("lr").manifest) == history


class SetRate(Callback):
    """Sets every param group's rate at the start of ``epoch``: what a fit that trains a
    run further from there at ``lr`` must do."""

    def __init__(self, epoch: int, lr: float):
        self.epoch, self.lr = epoch, lr

    def on_epoch_begin(self, epoch, state):
        if epoch == self.epoch:
            for group in state.optimizer.param_groups:
                group["lr"] = self.lr


@pytest.mark.parametrize("through", ["optimizer", "learning_rate"])
def test_training_further_at_another_learning_rate_goes_on_at_the_new_rate(
    regression_df, store, through
):
    """The rate given now (the optimizer's, or learning_rate) replaces the run's from the
    first epoch trained further; the StepLR restored with the run schedules from it."""
    clean = momentum_estimator(store, run_id="clean", callbacks=[SetRate(3, 0.01)]).fit(
        regression_df
    )
    momentum_estimator(store, run_id="rate", epochs=2).fit(regression_df)
    if through == "optimizer":
        net = dropout_net()
        new = dict(optimizer=torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9))
        further = make_estimator(
            net,
            store,
            run_id="rate",
            epochs=4,
            batch_size=20,
            **new,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7),
        )
    else:
        further = momentum_estimator(store, run_id="rate", epochs=4, learning_rate=0.01)
    model = further.fit(regression_df)
    rates = [h["lr"][0] for h in model.getHistory()]
    assert rates == pytest.approx([0.05, 0.035, 0.01, 0.007])
    assert model.getTrainingSummary()["learning_rates"] == pytest.approx([0.01])
    assert_same_training(model, clean)  # momentum and the rest of the state went on


def test_training_further_a_run_stopped_early_goes_on_with_the_new_callbacks(regression_df, store):
    clean = momentum_estimator(store, run_id="clean", epochs=5).fit(regression_df)
    stop_at_2 = EarlyStopping(monitor="train.loss", patience=1, min_delta=1e9)
    stopped = momentum_estimator(store, run_id="stopped", epochs=5, callbacks=[stop_at_2])
    first = stopped.fit(regression_df)
    assert first.getTrainingSummary()["early_stopping_epoch"] == 2
    patient = EarlyStopping(monitor="train.loss", patience=5)
    further = momentum_estimator(store, run_id="stopped", epochs=5, callbacks=[patient])
    model = further.fit(regression_df)
    summary = model.getTrainingSummary()
    assert summary["resumed_from_epoch"] == 2 and summary["early_stopping_epoch"] is None
    assert not summary["stopped_early"]
    assert [h["epoch"] for h in model.getHistory()] == [1, 2, 3, 4, 5]
    for name, value in weights(clean).items():
        torch.testing.assert_close(weights(model)[name], value, rtol=0, atol=1e-6)
    # the new EarlyStopping decides from there: it stops this run once it stops improving
    again = EarlyStopping(monitor="train.loss", patience=1, min_delta=1e9)
    model = momentum_estimator(store, run_id="stopped", epochs=8, callbacks=[again]).fit(
        regression_df
    )
    assert model.getTrainingSummary()["early_stopping_epoch"] == 6


def test_resuming_refuses_another_order_of_the_rows(regression_df, store, tmp_path):
    """shuffle, shuffle_buffer_size and bucket_by_length fix the order a resume inside a
    pass goes on in: changed, rows would be repeated and skipped."""
    fault = Fault("raise", rank=0, epoch=2, marker=tmp_path / "m")
    with pytest.raises(TrainingError):
        momentum_estimator(store, callbacks=[fault], run_id="order").fit(regression_df)
    for params, field in (
        (dict(shuffle=False), r"shuffle \(was True, now False\)"),
        (dict(shuffle_buffer_size=7), r"shuffle_buffer_size \(was None, now 7\)"),
    ):
        with pytest.raises(ValueError, match=f"run_id: run 'order' .*{field}"):
            momentum_estimator(store, run_id="order", **params).fit(regression_df)
