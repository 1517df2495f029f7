"""examples/horovod/: Horovod PyTorch scripts run unchanged (but for the import line) by
``spark-estimator-run`` on Spark barrier tasks, and learn as well as on one process."""

import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from tests.clusters import StandaloneCluster

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "horovod"
LAUNCHER = Path(sys.executable).parent / "spark-estimator-run"
CLUSTER = "local-cluster[2,1,1024]"
EPOCHS = 20
CLASSIC = [str(EXAMPLES / "pytorch_digits.py"), "--epochs", str(EPOCHS), "--lr", "0.05"]
ELASTIC = [str(EXAMPLES / "pytorch_digits_elastic.py"), "--epochs", str(EPOCHS), "--lr", "0.05"]


def accuracies(output: str) -> list[float]:
    """Every test accuracy rank 0 printed, in order."""
    return [float(a) for a in re.findall(r"Accuracy: ([0-9.]+)%", output)]


def final(output: str) -> float:
    """The accuracy a run ends with: the mean of its last 3 epochs' (dropout and 360 test
    images make single epochs vary by a few points)."""
    return sum(accuracies(output)[-3:]) / 3


def run(argv: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    # as typed in a shell: on a local master the launcher has its tasks run its own Python
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_")}, **env}
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def launch(script: list[str], master: str, tmp_path: Path, *flags: str):
    return run([str(LAUNCHER), "-np", "2", "--master", master, *script, *flags], tmp_path)


_alone: dict[tuple, float] = {}


def alone(script: list[str], tmp_path: Path, *args: str) -> float:
    """The final test accuracy of ``script`` as one plain Python process (size 1, so
    without any allreduce flag)."""
    key = (*script, *args)
    if key not in _alone:
        _alone[key] = final(run([sys.executable, *script, *args], tmp_path).stdout)
    return _alone[key]


@pytest.mark.parametrize(
    "master, flags",
    [  # the plain allreduce on a local-cluster, the compressed Adasum one on local[2]
        pytest.param(CLUSTER, (), marks=pytest.mark.cluster),
        ("local[2]", ("--fp16-allreduce", "--use-adasum")),
    ],
)
def test_the_classic_script_learns_as_well_as_on_one_process(master, flags, tmp_path):
    done = launch(CLASSIC, master, tmp_path, *flags)
    epochs = accuracies(done.stdout)
    assert len(epochs) == EPOCHS, done.stdout[-3000:]  # rank 0 alone reports, once per epoch
    assert re.search(rf"^\[rank 1\] Train Epoch: {EPOCHS} ", done.stdout, re.M)  # both train
    assert final(done.stdout) >= alone(CLASSIC, tmp_path) - 2.0
    assert final(done.stdout) > 90.0


@pytest.mark.cluster
def test_the_elastic_script_learns_as_well_as_on_one_process(tmp_path):
    # the compressed Adasum allreduce on a local-cluster; the plain one on local[2] is
    # the next test's (a rank killed on the way, the same epochs and accuracy asked)
    done = launch(ELASTIC, CLUSTER, tmp_path, "--fp16-allreduce", "--use-adasum")
    epochs = re.findall(r"^\[rank 0\] Epoch (\d+):", done.stdout, re.M)
    assert epochs == [str(e) for e in range(1, EPOCHS + 1)], done.stdout[-3000:]
    assert final(done.stdout) >= alone(ELASTIC, tmp_path) - 2.0


KILLER = """
    # Runs the example, and kills this process (SIGKILL: nothing raised, nothing cleaned
    # up) on rank 1 at its {step}th optimizer step, once: the marker file says it happened.
    import os, runpy, signal, sys
    from torch.optim.optimizer import register_optimizer_step_post_hook

    marker, script = sys.argv[1], sys.argv[2]
    steps = [0]

    def kill_once(optimizer, args, kwargs):
        steps[0] += 1
        if os.environ["RANK"] == "1" and steps[0] == {step} and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)

    register_optimizer_step_post_hook(kill_once)
    sys.argv = sys.argv[2:]
    runpy.run_path(script, run_name="__main__")
"""


def test_the_elastic_script_resumes_from_its_last_commit_when_a_rank_is_killed(tmp_path):
    # 1,437 training images, 2 ranks, batch 64: 11 steps per epoch. The kill comes at
    # rank 1's 29th step, in epoch 3 after its commit at batch 4 (--batches-per-commit 4).
    killer = tmp_path / "kill_rank_1.py"
    killer.write_text(textwrap.dedent(KILLER.format(step=29)))
    marker = tmp_path / "killed"
    done = launch([str(killer), str(marker), *ELASTIC], "local[2]", tmp_path)
    assert marker.exists()  # the kill happened
    epochs = re.findall(r"^\[rank 0\] Epoch (\d+):", done.stdout, re.M)
    assert epochs == [str(e) for e in range(1, EPOCHS + 1)], done.stdout[-3000:]
    assert final(done.stdout) >= alone(ELASTIC, tmp_path) - 2.0


IMAGENET_EPOCHS = 8
IMAGENET = [str(EXAMPLES / "pytorch_imagenet_elastic.py"), "--epochs", str(IMAGENET_EPOCHS)]
TRAIN_IMAGES = 1437  # the digits' training images (every fifth of 1,797 validates)

SHRINK_AND_GROW = """
    # Runs the example; every launch says its size first. Rank 1, at its {step}th optimizer
    # step, SIGKILLs the standalone Worker that started its executor, then the executor:
    # that slot is gone until the test starts a new Worker. While the job runs with 2 ranks,
    # each step takes {pause} s more, so that the new Worker comes up before the run ends.
    # Each rank appends to a file of its own, one line per training batch (the sampler's
    # epoch, processed count before it and the rank's indices) and one per reset of the
    # training sampler (epoch, processed count, time), written as they happen.
    import os, runpy, signal, sys, time
    from torch.optim.optimizer import register_optimizer_step_post_hook
    import spark_estimator.horovod as hvd

    marker, folder, script = sys.argv[1], sys.argv[2], sys.argv[3]
    size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    print("size", size, flush=True)
    launch = os.environ["MASTER_ADDR"] + "-" + os.environ["MASTER_PORT"]
    log = open(os.path.join(folder, f"{{launch}}-rank{{rank}}.txt"), "w", buffering=1)
    sampler = hvd.elastic.ElasticSampler
    record_batch, load_state_dict = sampler.record_batch, sampler.load_state_dict

    def record(self, batch_idx, batch_size):
        mine = list(iter(self))[batch_idx * batch_size:(batch_idx + 1) * batch_size]
        log.write(f"batch {{self.epoch}} {{self.processed_num}} {{' '.join(map(str, mine))}}\\n")
        record_batch(self, batch_idx, batch_size)

    def load(self, state):
        load_state_dict(self, state)
        if len(self.dataset) == {train}:
            log.write(f"reset {{self.epoch}} {{self.processed_num}} {{time.time()}}\\n")

    sampler.record_batch, sampler.load_state_dict = record, load
    steps = [0]

    def parent(pid):
        with open(f"/proc/{{pid}}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])

    def cmdline(pid):
        with open(f"/proc/{{pid}}/cmdline", "rb") as f:
            return f.read()

    def after_step(optimizer, args, kwargs):
        steps[0] += 1
        # the launch's size now: Spark reuses this Python process for the next launch,
        # whose hook is added to this one
        if os.environ["WORLD_SIZE"] == "2":
            time.sleep({pause})
        if rank == 1 and steps[0] == {step} and not os.path.exists(marker):
            open(marker, "w").close()
            executor = parent(os.getpid())
            while b"CoarseGrainedExecutorBackend" not in cmdline(executor):
                executor = parent(executor)
            os.kill(parent(executor), signal.SIGKILL)
            os.kill(executor, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)

    register_optimizer_step_post_hook(after_step)
    sys.argv = sys.argv[3:]
    runpy.run_path(script, run_name="__main__")
"""


def sampled(folder: Path) -> dict[int, list[int]]:
    """Every training index whose batch counts, by epoch: each launch's batches, less
    those after the commit the next launch resumed from (they were done again)."""
    launches: dict[str, dict] = {}
    for path in folder.glob("*-rank*.txt"):
        launch = launches.setdefault(path.name.rsplit("-rank", 1)[0], {"batches": []})
        for line in path.read_text().splitlines():
            kind, *values = line.split()
            if kind == "reset":
                launch.setdefault("reset", (int(values[0]), int(values[1]), float(values[2])))
            else:
                launch["batches"].append((int(values[0]), int(values[1]), values[2:]))
    ordered = sorted(launches.values(), key=lambda launch: launch["reset"][2])
    indices: dict[int, list[int]] = {}
    for launch, following in zip(ordered, [*ordered[1:], None]):
        resumed = following["reset"][:2] if following else (1 << 30, 0)
        for epoch, before, mine in launch["batches"]:
            if (epoch, before) < resumed:
                indices.setdefault(epoch, []).extend(int(i) for i in mine)
    return indices


@pytest.mark.cluster
def test_the_imagenet_style_script_shrinks_after_losing_a_worker_and_grows_back(tmp_path):
    # 1,437 training images, 3 ranks, batch 32: 15 steps per epoch. Rank 1's 40th step is in
    # the third epoch, after its commit at batch 0 (--batches-per-commit 10): the run goes on
    # with 2 ranks from there; once it does, a new Worker is started and it grows back to 3
    # at a host check (every 2 batches) or commit, within the same spark-estimator-run.
    # (A run that stays at 2 ranks to its end, its Worker lost for good, is the fit's:
    # tests/driver/test_elastic.py: a run's launches are restarted by the same
    # ``driver.elastic`` code as a fit's.)
    harness = tmp_path / "shrink_and_grow.py"
    harness.write_text(
        textwrap.dedent(SHRINK_AND_GROW.format(step=40, pause=0.5, train=TRAIN_IMAGES))
    )
    marker, batches = tmp_path / "killed", tmp_path / "batches"
    batches.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_")}
    with StandaloneCluster(workers=3) as cluster:
        argv = [str(LAUNCHER), "-np", "3", "--min-np", "2", "--max-np", "3"]
        argv += ["--master", cluster.url, "--store", str(tmp_path / "store")]
        argv += [str(harness), str(marker), str(batches), *IMAGENET]
        proc = subprocess.Popen(
            argv, cwd=tmp_path, env={**env, "PYSPARK_PYTHON": sys.executable},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        out, err, shrunk = [], [], threading.Event()

        def read(stream, lines):
            for line in stream:
                lines.append(line)
                if line.rstrip("\n") == "[rank 0] size 2":
                    shrunk.set()

        readers = [
            threading.Thread(target=read, args=a) for a in ((proc.stdout, out), (proc.stderr, err))
        ]
        for reader in readers:
            reader.start()
        try:
            if shrunk.wait(300):
                cluster.start_worker()
            proc.wait(600)
        finally:
            proc.kill()
            for reader in readers:
                reader.join()
        stdout, stderr = "".join(out), "".join(err)
        assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
        assert len(cluster.alive_workers()) == 3
    assert marker.exists()
    sizes = re.findall(r"^\[rank 0\] size (\d+)$", stdout, re.M)
    assert sizes == ["3", "2", "3"], stdout[-3000:]
    assert re.search(r"ranks were lost .*starting the job again with 2 ranks", stderr)
    assert "starting the job again with 3 ranks (was 2)" in stderr, stderr[-3000:]
    epochs = re.findall(r"^\[rank 0\] Validate Epoch #(\d+):", stdout, re.M)
    assert epochs == [str(e) for e in range(1, IMAGENET_EPOCHS + 1)], stdout[-3000:]
    # ElasticSampler: every image once per epoch, but for the padding that fills the last
    # batch of every rank (fewer than 3 images per launch that ends the epoch)
    by_epoch = sampled(batches)
    assert sorted(by_epoch) == list(range(IMAGENET_EPOCHS))
    for epoch, indices in by_epoch.items():
        assert set(indices) == set(range(TRAIN_IMAGES)), epoch
        assert len(indices) - TRAIN_IMAGES < 3, (epoch, len(indices))
    assert final(stdout) >= alone(IMAGENET, tmp_path) - 3.0


BENCHMARK = ["--num-warmup-batches", "2", "--num-batches-per-iter", "3", "--num-iters", "4"]


def check_benchmark_report(stdout: str, iters: int) -> None:
    """Rank 0 alone reports: 2 CPUs, one line per timed iteration, their mean, and the
    total over the ranks (2 x the mean, as printed)."""
    assert re.search(r"^\[rank 0\] Number of CPUs: 2$", stdout, re.M), stdout[-3000:]
    assert not re.search(r"^\[rank 1\]", stdout, re.M)
    lines = re.findall(r"^\[rank 0\] Iter #(\d+): ([0-9.]+) img/sec per CPU$", stdout, re.M)
    assert [int(i) for i, _ in lines] == list(range(iters)), stdout[-3000:]
    mean = float(re.search(r"^\[rank 0\] Img/sec per CPU: ([0-9.]+) \+-", stdout, re.M)[1])
    assert abs(mean - sum(float(s) for _, s in lines) / iters) <= 0.1
    total = re.search(r"^\[rank 0\] Total img/sec on 2 CPU\(s\): ([0-9.]+) \+-", stdout, re.M)
    assert abs(float(total[1]) - 2 * mean) <= 0.2


def test_the_synthetic_benchmark_reports_images_per_second_per_rank_and_in_total(tmp_path):
    script = [str(EXAMPLES / "pytorch_synthetic_benchmark.py"), *BENCHMARK]
    done = launch(script, "local[2]", tmp_path, "--fp16-allreduce")
    check_benchmark_report(done.stdout, iters=4)


def test_the_elastic_benchmark_goes_on_from_its_last_commit_when_a_rank_is_killed(tmp_path):
    # 2 warm-up batches, then 4 iterations of 3: rank 1's 7th step is iteration 1's second
    # batch. The relaunch repeats iteration 1 and none before it.
    killer = tmp_path / "kill_rank_1.py"
    killer.write_text(textwrap.dedent(KILLER.format(step=7)))
    marker = tmp_path / "killed"
    script = [str(EXAMPLES / "pytorch_synthetic_benchmark_elastic.py"), *BENCHMARK]
    done = launch([str(killer), str(marker), *script], "local[2]", tmp_path)
    assert marker.exists()
    assert len(re.findall(r"^\[rank 0\] Model: resnet8$", done.stdout, re.M)) == 2  # 2 launches
    assert len(re.findall(r"Running warmup", done.stdout)) == 1
    check_benchmark_report(done.stdout, iters=4)


AGREE = """
    # Runs the example, then prints how far apart the ranks' model parameters are (each
    # rank's largest difference from rank 0's; 0.0 when one model was trained).
    import runpy, sys
    import torch
    import spark_estimator.horovod as hvd

    sys.argv = sys.argv[1:]
    model = runpy.run_path(sys.argv[0], run_name="__main__")["model"]
    mine = torch.cat([p.detach().flatten().float().cpu() for p in model.parameters()])
    ranks = hvd.allgather(mine[None])
    print("max difference between ranks:", (ranks - ranks[0]).abs().max().item())
"""


def launch_agreeing(script: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """Launch ``script`` on 2 ranks, then check that they end with the same parameters."""
    agree = tmp_path / "agree.py"
    agree.write_text(textwrap.dedent(AGREE))
    done = launch([str(agree), *script], "local[2]", tmp_path)
    differences = re.findall(r"^\[rank \d\] max difference between ranks: (.*)$", done.stdout, re.M)
    assert differences == ["0.0", "0.0"], done.stdout[-3000:]
    return done


def test_the_imagenet_script_learns_as_well_as_on_one_process(tmp_path):
    # 9 epochs (2 warming up), each optimizer step 2 batches of 32 per rank
    script = [str(EXAMPLES / "pytorch_imagenet_resnet50.py"), "--batches-per-allreduce", "2"]
    out = tmp_path / "two"
    out.mkdir()
    files = ["--log-dir", str(out / "logs"), "--checkpoint-format", str(out / "ckpt-{epoch}.pt")]
    done = launch_agreeing([*script, *files], tmp_path)
    assert len(accuracies(done.stdout)) == 9, done.stdout[-3000:]  # rank 0 validates per epoch
    assert sorted(p.name for p in out.glob("ckpt-*")) == [f"ckpt-{e}.pt" for e in range(1, 10)]
    assert len(list((out / "logs").glob("events.out.tfevents.*"))) == 1  # rank 0's alone
    one = tmp_path / "one"
    files = ["--log-dir", str(one / "logs"), "--checkpoint-format", str(one / "ckpt-{epoch}.pt")]
    one.mkdir()
    assert final(done.stdout) >= alone(script, tmp_path, *files) - 2.0
    assert final(done.stdout) > 90.0


def test_the_lightning_script_trains_one_model_over_the_ranks(tmp_path):
    script = [str(EXAMPLES / "pytorch_lightning_mnist.py"), "--epochs", "10"]
    done = launch_agreeing(script, tmp_path)
    for rank in (0, 1):  # its callback counted 10 training and 10 validation epochs
        assert re.search(rf"^\[rank {rank}\] Training ends$", done.stdout, re.M)
        ended = re.findall(rf"^\[rank {rank}\] A (train|validation) epoch ended", done.stdout, re.M)
        assert ended == ["validation", "train"] * 10  # Lightning 2 validates inside the epoch
    (accuracy,) = accuracies(done.stdout)  # rank 0 tests once, after fitting
    assert accuracy >= accuracies(run([sys.executable, *script], tmp_path).stdout)[0] - 2.0
    assert accuracy > 90.0
