"""hvd.elastic: commits in the run's store; a killed rank restarts the job from the last
commit (real Spark tasks, a real process killed); a job below its largest size grows when
the cluster offers more slots; a user's exception fails at once."""

import io
import logging
import os
import pickle
import signal
import threading
import time

import pytest
import torch

from spark_estimator import Store, TrainingError, run
from spark_estimator.horovod import elastic
from spark_estimator.shared.serialization import state_to_bytes
from spark_estimator.worker import run_task
from tests.test_runner import Recorder
from tests.test_security import RunsCode

ELASTIC_SCRIPT = """
import os, sys, time
import torch
import torch.distributed as dist
from spark_estimator.horovod import elastic
from spark_estimator.shared.serialization import state_to_bytes
from spark_estimator.worker.comm.rendezvous import init_default_group

init_default_group()
rank, size = dist.get_rank(), dist.get_world_size()
wait_after_epoch, fail_at_epoch = int(sys.argv[1]), int(sys.argv[2])
model = torch.nn.Linear(1, 1, bias=False)
torch.nn.init.zeros_(model.weight)
optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
state = elastic.TorchState(model, optimizer, epoch=1, batch=0)
state.register_reset_callbacks([lambda: print(f"reset at epoch {state.epoch}")])


@elastic.run
def train(state):
    while state.epoch <= 4:
        optimizer.zero_grad()
        (-model.weight.sum()).backward()  # every step adds 1 to the weight
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= size
        optimizer.step()
        print(f"epoch {state.epoch} weight {model.weight.item():g}")
        if rank == 1 and state.epoch == fail_at_epoch:
            raise ValueError("a bug at epoch 2")
        state.epoch += 1
        state.commit()
        if rank == 1 and state.epoch == wait_after_epoch + 1:
            for _ in range(3000):  # the test kills this process here, once
                time.sleep(0.1)
            sys.exit("not killed")


train(state)
print(f"done: epoch {state.epoch} weight {model.weight.item():g}")
"""


def commit_epoch(store: Store, run_id: str) -> int:
    path = store.run(run_id).commit
    if not store.exists(path):
        return 0
    data = io.BytesIO(store.read_bytes(path))
    saved = torch.load(data, map_location="cpu", weights_only=True)  # as hvd.elastic.run does
    return saved["attributes"]["epoch"]


def kill_rank_after_commit(store: Store, run_id: str, rank: int, epoch: int, killed: list):
    """Kill ``rank``'s process (its pid from the run's record) once the commit that
    starts ``epoch`` is in the store."""
    deadline = time.monotonic() + 300
    record_path = store.run(run_id).process(rank)
    while time.monotonic() < deadline:
        if commit_epoch(store, run_id) >= epoch and store.exists(record_path):
            pid = store.read_json(record_path)["pid"]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            return
        time.sleep(0.1)


def test_a_killed_rank_restarts_the_job_from_the_last_commit(spark, store, tmp_path):
    script = tmp_path / "elastic_train.py"
    script.write_text(ELASTIC_SCRIPT)
    killed: list[int] = []
    killer = threading.Thread(
        target=kill_rank_after_commit, args=(store, "elastic", 1, 3, killed), daemon=True
    )
    killer.start()
    out = Recorder()
    run(
        str(script), args=["2", "0"], num_proc=2, use_gpu=False, spark=spark, stdout=out,
        store=store, run_id="elastic", verbose=0,
    )  # fmt: skip
    killer.join()
    assert len(killed) == 1
    rank0 = [line for line in out.lines if line.startswith("[rank 0]")]
    assert rank0 == [
        "[rank 0] epoch 1 weight 1",
        "[rank 0] epoch 2 weight 2",  # committed: epoch 3 is next, the weight 2
        "[rank 0] reset at epoch 3",  # the new launch restored the commit, then the callbacks
        "[rank 0] epoch 3 weight 3",
        "[rank 0] epoch 4 weight 4",
        "[rank 0] done: epoch 5 weight 4",
    ]
    assert "[rank 1] reset at epoch 3" in out.lines
    assert "[rank 1] done: epoch 5 weight 4" in out.lines
    launches = store.fs.ls(store.run("elastic").elastic + "/launches", detail=False)
    assert len(launches) == 2
    assert commit_epoch(store, "elastic") == 5


GROWING_SCRIPT = """
import time
import torch
import torch.distributed as dist
from spark_estimator.horovod import elastic
from spark_estimator.shared.serialization import state_to_bytes
from spark_estimator.worker.comm.rendezvous import init_default_group

init_default_group()
size = dist.get_world_size()
print(f"size {size}")
model = torch.nn.Linear(1, 1, bias=False)
torch.nn.init.zeros_(model.weight)
optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
state = elastic.TorchState(model, optimizer, step=0)
state.register_reset_callbacks([lambda: print(f"reset at step {state.step} size {size}")])


@elastic.run
def train(state):
    while state.step < 40:
        optimizer.zero_grad()
        (-model.weight.sum()).backward()  # every step adds 1 to the weight
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= size
        optimizer.step()
        state.step += 1
        time.sleep(0.25)
        state.check_host_updates()  # never commit(): growing commits the state as it is


train(state)
print(f"done: step {state.step} weight {model.weight.item():g} size {size}")
"""


def test_a_run_below_its_largest_size_grows_when_slots_are_offered(spark, store, tmp_path, caplog):
    # local[4] offers 4 slots: a run started with 2 ranks grows to max_num_proc=3 at the
    # first check_host_updates() after the driver sees it entered hvd.elastic.run
    script = tmp_path / "growing.py"
    script.write_text(GROWING_SCRIPT)
    out = Recorder()
    with caplog.at_level(logging.INFO, logger="spark_estimator.runner"):
        run(
            str(script), num_proc=2, max_num_proc=3, use_gpu=False, spark=spark, stdout=out,
            store=store, run_id="grow", verbose=0, max_restarts=0,  # a growth is no restart
        )  # fmt: skip
    rank0 = [line for line in out.lines if line.startswith("[rank 0]")]
    assert len(rank0) == 4, rank0
    grown_at = int(rank0[2].split()[5])  # "[rank 0] reset at step <n> size 3"
    assert rank0 == [
        "[rank 0] size 2",
        "[rank 0] size 3",
        f"[rank 0] reset at step {grown_at} size 3",
        "[rank 0] done: step 40 weight 40 size 3",  # no step lost or repeated
    ]
    assert 1 <= grown_at < 40
    assert sorted(line for line in out.lines if "done:" in line) == [
        f"[rank {r}] done: step 40 weight 40 size 3" for r in range(3)
    ]
    resizes = [r.getMessage() for r in caplog.records if "more task slots" in r.getMessage()]
    assert resizes == [
        "run 'grow': the cluster offers more task slots; starting the job again with 3 ranks "
        "(was 2) from the last hvd.elastic commit (a growth, not a restart)"
    ]
    launches = store.fs.ls(store.run("grow").elastic + "/launches", detail=False)
    assert len(launches) == 2
    assert not store.exists(store.run("grow").grow)  # removed before the larger launch


def test_an_exception_under_elastic_fails_at_once(spark, store, tmp_path):
    script = tmp_path / "elastic_bug.py"
    script.write_text(ELASTIC_SCRIPT)
    with pytest.raises(TrainingError, match="a bug at epoch 2") as failure:
        run(
            str(script), args=["0", "2"], num_proc=2, use_gpu=False, spark=spark,
            store=store, run_id="bug", verbose=0,
        )  # fmt: skip
    assert failure.value.rank == 1
    assert len(store.fs.ls(store.run("bug").elastic + "/launches", detail=False)) == 1


def test_a_lost_rank_of_a_run_that_is_not_elastic_fails_at_once(spark, store, tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(
        "import os, signal, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "if dist.get_rank() == 1:\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "dist.barrier()\n"
    )
    with pytest.raises(Exception) as failure:
        run(str(script), num_proc=2, use_gpu=False, spark=spark, store=store, run_id="p")
    assert not isinstance(failure.value, TrainingError)
    assert not store.exists(store.run("p").elastic)


@pytest.fixture
def group_of_one(monkeypatch):
    """The one-process group init_default_group forms outside any task, torn down after."""
    import torch.distributed as dist

    from spark_estimator.worker.comm import rendezvous

    monkeypatch.setattr(rendezvous, "_current", None)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_state_commit_restore_and_sync_on_one_process(group_of_one):
    """Outside any task: a group of one (rank 0 of 1), commits in memory."""
    from spark_estimator.worker.comm.rendezvous import current_rank_info

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = elastic.TorchState(model, optimizer, epoch=1, batch=0)
    state.sync()
    assert (current_rank_info().rank, current_rank_info().world_size) == (0, 1)
    state.epoch, state.batch = 3, 7
    with torch.no_grad():
        model.weight.fill_(5.0)
    state.commit()
    state.epoch = 4
    with torch.no_grad():
        model.weight.fill_(-1.0)
    state.restore()
    assert (state.epoch, state.batch) == (3, 7)
    assert torch.equal(model.weight, torch.full((1, 2), 5.0))
    objects = elastic.ObjectState(step=1)
    objects.step = 2
    objects.restore()
    assert objects.step == 1
    calls = []
    state.register_reset_callbacks([lambda: calls.append("reset")])
    state.on_reset()
    assert calls == ["reset"]


RESTORING_SCRIPT = """
from spark_estimator.horovod import elastic
from spark_estimator.shared.serialization import state_to_bytes
from spark_estimator.worker.comm.rendezvous import init_default_group

init_default_group()
state = elastic.ObjectState(epoch=1)


@elastic.run
def train(state):
    print(f"trained from epoch {state.epoch}")


train(state)
"""


def test_a_commit_that_would_run_code_is_refused_not_loaded(spark, store, tmp_path):
    """A commit file planted in the run's store whose unpickling calls open(): the
    launch's hvd.elastic.run refuses it (weights-only, as checkpoints) with an error that
    says what to do, and nothing of it runs."""
    canary = tmp_path / "canary"
    run_folder = store.run("planted")
    planted = {"attributes": {"epoch": RunsCode(str(canary))}}
    store.write_bytes(run_folder.commit, state_to_bytes(planted))
    script = tmp_path / "restoring.py"
    script.write_text(RESTORING_SCRIPT)
    out = Recorder()
    with pytest.raises(TrainingError) as failure:
        run(
            str(script), num_proc=1, use_gpu=False, spark=spark, stdout=out, store=store,
            run_id="planted", verbose=0, max_restarts=0,
        )  # fmt: skip
    message = str(failure.value)
    assert "hvd.elastic: refused to load the run's last commit" in message
    assert run_folder.commit in message and "could run any code" in message
    assert "refused: builtins.open" in message or "refused: io.open" in message
    assert not canary.exists()
    assert not any("trained from" in line for line in out.lines)


class Point:
    """A class of the script's own: a commit holds it only where the script allows it."""

    def __init__(self, x: float):
        self.x = x


@pytest.fixture
def in_a_run(group_of_one, store, monkeypatch):
    """Rank 0 of a ``run`` task's launch (its RunSpec) on a real store: commits go there."""
    spec = run_task.RunSpec(
        payload=None, script=None, env={}, use_gpu=False, rank0_only=False,
        collective_timeout=30.0, store=store, run_id="own", launch_id="launch-0", verbose=0,
        echo=False,
    )  # fmt: skip
    monkeypatch.setattr(run_task, "_current", spec)
    return store.run("own")


def test_a_state_a_commit_could_not_load_fails_at_its_first_commit(in_a_run, store):
    """An attribute that a weights-only load refuses (a class instance, a NumPy array) fails
    the commit that would write it, naming it and the ways out; the commit before stays."""
    import numpy as np

    model = torch.nn.Linear(2, 1)
    state = elastic.TorchState(model, epoch=1, point=None, scale=1.0)
    state.commit()
    state.epoch, state.point = 2, Point(3.0)
    with pytest.raises(TypeError) as refused:
        state.commit()
    message = str(refused.value)
    assert message.startswith("hvd.elastic: cannot commit attribute 'point' (it holds ")
    assert "a tests.horovod.test_elastic.Point" in message and "weights_only=True" in message
    assert "torch.serialization.add_safe_globals([Point])" in message
    assert "state_dict()" in message  # the other way out
    saved = torch.load(io.BytesIO(store.read_bytes(in_a_run.commit)), weights_only=True)
    assert saved["attributes"] == {"epoch": 1, "point": None, "scale": 1.0}

    state.point, state.scale = None, np.ones(2)
    with pytest.raises(
        TypeError, match=r"attribute 'scale' \(it holds a numpy.ndarray\).*as a tensor"
    ):
        state.commit()


def test_classes_the_script_allows_are_committed_and_restored(in_a_run, store):
    model = torch.nn.Linear(2, 1)
    state = elastic.TorchState(model, epoch=1, point=Point(1.0))
    with torch.serialization.safe_globals([Point]):  # add_safe_globals, undone afterwards
        state.epoch, state.point = 4, Point(2.5)
        state.commit()
        with torch.no_grad():
            model.weight.zero_()
        fresh = elastic.TorchState(torch.nn.Linear(2, 1), epoch=1, point=None)
        assert elastic._restore_commit(fresh)
    assert (fresh.epoch, fresh.point.x) == (4, 2.5)
    assert torch.equal(fresh.model.weight, state._saved_model["weight"])
    with pytest.raises(pickle.UnpicklingError, match="refused: tests.horovod.test_elastic.Point"):
        elastic._restore_commit(elastic.TorchState(torch.nn.Linear(2, 1), epoch=1, point=None))
