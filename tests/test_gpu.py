"""Training on a real GPU assigned by Spark; skipped where CUDA is absent.

Each test starts its own Spark in a subprocess: GPU scheduling needs worker resources in
the Spark conf, found by the discovery script shipped in conf/.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DISCOVERY = Path(__file__).parent.parent / "conf" / "get_gpus_resources.sh"


# executors of 2 cores and one GPU, tasks of half a GPU: the training job and transform
# get the whole GPU and both cores through a task resource profile (stage-level scheduling)
STAGE_LEVEL = {"spark.executor.cores": "2", "spark.task.resource.gpu.amount": "0.5"}


def run_on_gpu_spark(
    tmp_path, body: str, conf: dict[str, str] | None = None, jpeg_size: int | None = None
) -> dict:
    """Run ``body`` with ``spark`` (one executor, one GPU per task, unless ``conf`` says
    otherwise) and ``store`` defined, and with ``jpeg_size`` also ``folder`` (64 JPEGs of
    that size, of 2 classes: dark and light) and ``images`` (its ``binaryFile`` DataFrame
    with their ``label``); it must print one JSON line last, which is returned."""
    settings = {
        "spark.worker.resource.gpu.amount": "1",
        "spark.worker.resource.gpu.discoveryScript": str(DISCOVERY),
        "spark.executor.resource.gpu.amount": "1",
        "spark.task.resource.gpu.amount": "1",
        **(conf or {}),
    }
    configs = "".join(f"\n                 .config({k!r}, {v!r})" for k, v in settings.items())
    script = (
        textwrap.dedent(
            f"""
        import json, os, sys
        os.environ["PYSPARK_PYTHON"] = sys.executable
        import torch
        from pyspark.sql import SparkSession
        from spark_estimator import Store, TorchEstimator, TorchModel
        spark = (SparkSession.builder.master("local-cluster[1,2,4096]"){configs}
                 .getOrCreate())
        store = Store.create({str(tmp_path / "store")!r})
        rows = [([float(i % 7), 1.0], float(i % 7)) for i in range(256)]
        df = spark.createDataFrame(rows, "x array<float>, y float")
        """
        )
        + (_jpeg_images(tmp_path, jpeg_size) if jpeg_size else "")
        + textwrap.dedent(body)
        + "\nspark.stop()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYSPARK_PYTHON=sys.executable),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _jpeg_images(tmp_path, size: int) -> str:
    return textwrap.dedent(
        f"""
        import numpy as np
        from PIL import Image
        from pyspark.sql import functions as F
        folder = {str(tmp_path / "jpegs")!r}
        os.makedirs(folder)
        rng = np.random.default_rng(0)
        for i in range(64):
            pixels = np.full(({size}, {size}, 3), 40 + 150 * (i % 2), np.uint8)
            pixels += rng.integers(0, 20, pixels.shape, dtype=np.uint8)
            Image.fromarray(pixels).save(f"{{folder}}/{{i % 2}}-{{i}}.jpg", quality=95)
        images = spark.read.format("binaryFile").load(folder)
        images = images.withColumn(
            "label", F.regexp_extract("path", r"/(\\d)-", 1).cast("long"))
        """
    )


def test_fit_uses_the_gpu_spark_assigned(tmp_path):
    result = run_on_gpu_spark(
        tmp_path,
        """
        net = torch.nn.Linear(2, 1)
        est = TorchEstimator(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.01),
                             loss=torch.nn.MSELoss(), feature_cols=["x"], label_cols=["y"],
                             epochs=3, num_proc=1, store=store, use_gpu=True)
        model = est.fit(df)
        ranks = store.read_json(store.run(model.getRunId()).ranks)
        out = model.transform(df).count()
        print(json.dumps({"device": ranks[0]["device"], "rows": out,
                          "param_device": next(model.getModel().parameters()).device.type}))
        """,
    )
    assert result == {"device": "cuda:0", "rows": 256, "param_device": "cpu"}


def test_mixed_precision_and_compression_on_nccl(tmp_path):
    result = run_on_gpu_spark(
        tmp_path,
        """
        from spark_estimator.shared.serialization import state_from_bytes
        net = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        est = TorchEstimator(model=net, optimizer=torch.optim.Adam(net.parameters(), lr=0.01),
                             loss=torch.nn.MSELoss(), feature_cols=["x"], label_cols=["y"],
                             epochs=4, num_proc=1, store=store, use_gpu=True,
                             mixed_precision="fp16", gradient_compression="fp16",
                             backward_passes_per_step=2)
        model = est.fit(df)
        ranks = store.read_json(store.run(model.getRunId()).ranks)
        ckpt = state_from_bytes(store.read_bytes(store.run(model.getRunId()).checkpoint(4)))
        history = model.getHistory()
        print(json.dumps({"device": ranks[0]["device"], "sent": ranks[0]["communicated_dtypes"],
                          "scaler": "scaler" in ckpt,
                          "improved": history[-1]["train"]["loss"] < history[0]["train"]["loss"]}))
        """,
    )
    # one process communicates nothing (no DDP wrapper, no hook): the record says None, as the
    # CPU's (tests/test_estimator_training.py); compression itself is tested on gloo there
    assert result == {"device": "cuda:0", "sent": None, "scaler": True, "improved": True}


def test_an_fsdp_fit_of_a_meta_model_function_trains_in_bf16_on_nccl_and_resumes(tmp_path):
    result = run_on_gpu_spark(
        tmp_path,
        """
        def build():
            torch.manual_seed(0)
            with torch.device("meta"):
                return torch.nn.Sequential(torch.nn.Linear(2, 64), torch.nn.ReLU(),
                                           torch.nn.Linear(64, 1))
        def fit(epochs):
            est = TorchEstimator(model=build, loss=torch.nn.MSELoss(), feature_cols=["x"],
                                 optimizer=lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
                                 label_cols=["y"], epochs=epochs, num_proc=1, store=store,
                                 use_gpu=True, parallelism="fsdp", fsdp_wrap=["Linear"],
                                 mixed_precision="bf16", run_id="fsdp")
            return est.fit(df)
        fit(2)
        model = fit(4)
        summary = model.getTrainingSummary()
        ranks = store.read_json(store.run(model.getRunId()).ranks)
        history = model.getHistory()
        print(json.dumps({"device": ranks[0]["device"], "parallelism": summary["parallelism"],
                          "memory": summary["rank_memory"][0]["memory"],
                          "resumed": summary["resumed_from_epoch"],
                          "dtype": str(model.getModel()[0].weight.dtype),
                          "improved": history[-1]["train"]["loss"] < history[0]["train"]["loss"]}))
        """,
    )
    assert result == {
        "device": "cuda:0",
        "parallelism": "fsdp",
        "memory": "cuda max allocated",
        "resumed": 2,
        "dtype": "torch.float32",
        "improved": True,
    }


def test_run_pins_the_assigned_gpu_and_reduces_on_nccl(tmp_path):
    result = run_on_gpu_spark(
        tmp_path,
        """
        from spark_estimator import distributed as sd, run
        def fn():
            return {"device": str(sd.device()), "current": torch.cuda.current_device(),
                    "sum": sd.allreduce(torch.ones(3, device=sd.device()), average=False).tolist()}
        print(json.dumps(run(fn, num_proc=1, use_gpu=True)[0]))
        """,
    )
    assert result == {"device": "cuda:0", "current": 0, "sum": [1.0, 1.0, 1.0]}


def test_a_lightning_module_trains_on_the_assigned_gpu_over_nccl(tmp_path):
    pytest.importorskip("lightning.pytorch")
    result = run_on_gpu_spark(
        tmp_path,
        """
        import lightning.pytorch as pl
        from spark_estimator import LightningEstimator

        class Regression(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.ReLU(),
                                               torch.nn.Linear(16, 1))

            def forward(self, x):
                return self.net(x).squeeze(-1)

            def training_step(self, batch, batch_idx):
                self.log("device_is_cuda", float(batch["x"].is_cuda), on_epoch=True)
                return torch.nn.functional.mse_loss(self(batch["x"]), batch["y"])

            def configure_optimizers(self):
                return torch.optim.Adam(self.parameters(), lr=0.01)

        est = LightningEstimator(model=Regression(), feature_cols=["x"], label_cols=["y"],
                                 epochs=4, num_proc=1, store=store, use_gpu=True,
                                 trainer_args={"precision": "bf16-mixed"})
        model = est.fit(df)
        ranks = store.read_json(store.run(model.getRunId()).ranks)
        history = model.getHistory()
        print(json.dumps({"device": ranks[0]["device"],
                          "on_cuda": history[0]["train"]["device_is_cuda"],
                          "precision": model.getTrainingSummary()["precision"],
                          "improved": history[-1]["train"]["loss"] < history[0]["train"]["loss"],
                          "rows": model.transform(df).count()}))
        """,
    )
    assert result == {
        "device": "cuda:0",
        "on_cuda": 1.0,
        "precision": "bf16-mixed",
        "improved": True,
        "rows": 256,
    }


def test_stage_level_fit_and_transform_give_one_process_the_whole_gpu_and_both_cores(tmp_path):
    result = run_on_gpu_spark(
        tmp_path,
        """
        net = torch.nn.Linear(2, 1)
        est = TorchEstimator(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.01),
                             loss=torch.nn.MSELoss(), feature_cols=["x"], label_cols=["y"],
                             epochs=2, store=store, use_gpu=True)  # num_proc: the GPU slots
        model = est.fit(df)
        summary = model.getTrainingSummary()
        ranks = store.read_json(store.run(model.getRunId()).ranks)

        class Where(torch.nn.Module):  # per row: 10 x the task's cpus + 1 on the GPU
            def forward(self, x):
                from pyspark import TaskContext
                return torch.full((x.shape[0],), 10.0 * TaskContext.get().cpus() + x.is_cuda)

        where = TorchModel(model=Where(), feature_cols=["x"], output_shapes=[[]]).transform(df)
        print(json.dumps({"world": summary["world_size"], "resources": summary["task_resources"],
                          "device": ranks[0]["device"], "gpus": ranks[0]["gpu_addresses"],
                          "transform": sorted({r.prediction for r in where.collect()})}))
        """,
        conf=STAGE_LEVEL,
    )
    assert result == {
        "world": 1,  # one GPU slot, though the executor runs 2 tasks of half a GPU at once
        "resources": {
            "stage_level_scheduling": True,
            "task_cpus": 2,
            "task_gpus": 1.0,
            "reason": None,
        },
        "device": "cuda:0",
        "gpus": ["0"],
        "transform": [21.0],  # 2 cpus, on the GPU
    }


def test_stage_level_run_pins_the_gpu_with_the_executors_cores(tmp_path):
    result = run_on_gpu_spark(
        tmp_path,
        """
        from pyspark import TaskContext
        from spark_estimator import distributed as sd, run
        def fn():
            ctx = TaskContext.get()
            return {"device": str(sd.device()), "cpus": ctx.cpus(),
                    "gpus": list(ctx.resources()["gpu"].addresses),
                    "threads": torch.get_num_threads(),
                    "sum": sd.allreduce(torch.ones(2, device=sd.device()), average=False).tolist()}
        print(json.dumps({"ranks": run(fn, use_gpu=True)}))
        """,
        conf=STAGE_LEVEL,
    )
    assert result == {
        "ranks": [{"device": "cuda:0", "cpus": 2, "gpus": ["0"], "threads": 2, "sum": [1.0, 1.0]}]
    }


def _adasum_on_nccl(rank: int, world: int, folder: str) -> None:
    import torch.distributed as dist

    from spark_estimator.worker.comm.adasum import adasum_allreduce_
    from tests.worker.comm.test_adasum import cases

    torch.cuda.set_device(rank)
    store = dist.FileStore(os.path.join(folder, "pg-store"), world)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world)
    results = {}
    for name, tensors in cases(rank, world).items():
        on_gpu = [t.cuda() for t in tensors]
        adasum_allreduce_(on_gpu)
        results[name] = [t.cpu() for t in on_gpu]
    torch.save(results, os.path.join(folder, f"rank-{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank: two GPUs")
def test_adasum_over_nccl_matches_the_reference(tmp_path):
    import numpy as np

    from tests.worker.comm.test_adasum import cases, reference_adasum, spawn_ranks

    world = min(torch.cuda.device_count(), 3)  # 3: the extra rank beyond the power of two
    ranks = spawn_ranks(_adasum_on_nccl, world, tmp_path)
    inputs = [cases(r, world) for r in range(world)]
    for name, got_tensors in ranks[0].items():
        for i, got in enumerate(got_tensors):
            want = reference_adasum([inputs[r][name][i].numpy() for r in range(world)])
            tol = 1e-3 if got.dtype == torch.float16 else 1e-6
            np.testing.assert_allclose(got.numpy().astype(np.float64), want, rtol=tol, atol=tol)
            for other in ranks[1:]:
                assert torch.equal(other[name][i], got)


@pytest.mark.parametrize("fraction", [0.5, 0.0])
def test_no_step_after_an_epochs_first_synchronises_with_the_gpu(
    tmp_path, store, monkeypatch, fraction
):
    """On the GPU, with ``torch.cuda.set_sync_debug_mode("error")`` from the end of an
    epoch's first step to its one reduction: any call that makes the host wait for the
    device raises, on the held and the streamed path (the CPU twin in test_train.py counts
    the calls that would)."""
    import torch.distributed as dist

    from spark_estimator.worker.comm.ranks import RankInfo
    from spark_estimator.worker.loop import train as train_module
    from spark_estimator.worker.loop.metrics import EpochSums
    from spark_estimator.worker.loop.step import Stepper
    from tests.worker.loop.test_train import regression_spec

    step, reduce = Stepper.__call__, EpochSums.reduce

    def stepped(self, *args):
        result = step(self, *args)
        torch.cuda.set_sync_debug_mode("error")
        return result

    def reduced(self, *args):
        torch.cuda.set_sync_debug_mode("default")
        return reduce(self, *args)

    monkeypatch.setattr(Stepper, "__call__", stepped)
    monkeypatch.setattr(EpochSums, "reduce", reduced)
    torch.cuda.set_device(0)
    group_store = dist.FileStore(str(tmp_path / "pg-store"), 1)
    dist.init_process_group("nccl", store=group_store, rank=0, world_size=1)
    try:
        spec = regression_spec(tmp_path, store, device_cache_fraction=fraction)
        summary = train_module.train(spec, RankInfo(0, 1, 0, 1, torch.device("cuda:0")))
    finally:
        torch.cuda.set_sync_debug_mode("default")
        dist.destroy_process_group()
    assert summary.batches_per_epoch == [12, 12]
    assert summary.data_placement.startswith("held" if fraction else "streaming")


def test_jpegs_decoded_on_the_gpu_train_as_pillows_do(tmp_path):
    """decode_device='cuda': a batch's JPEGs decoded by torchvision on the rank's GPU; the
    pixels match Pillow's within JPEG's decoder differences, and a fit trains on them."""
    pytest.importorskip("torchvision.io")
    result = run_on_gpu_spark(
        tmp_path,
        """
        import io
        from spark_estimator.decoding import decode_image
        from spark_estimator.worker.decode.gpu_jpeg import decode_jpegs
        blobs = [open(f"{folder}/1-1.jpg", "rb").read()]
        on_gpu = decode_jpegs("content", blobs, torch.device("cuda"))[0].cpu()
        on_cpu = decode_image(blobs[0])
        difference = (on_gpu.int() - on_cpu.int()).abs().max().item()
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.out = torch.nn.Linear(3, 2)
            def forward(self, image):
                return self.out(image.float().mean((2, 3)) / 255)
        net = Net()
        model = TorchEstimator(model=net, optimizer=torch.optim.Adam(net.parameters(), lr=0.1),
                               loss=torch.nn.CrossEntropyLoss(), feature_cols=["content"],
                               label_cols=["label"], epochs=10, batch_size=16, num_proc=1,
                               decode_device="cuda", store=store, use_gpu=True).fit(images)
        scored = model.transform(images).collect()
        right = sum(int(np.argmax(r.prediction)) == r.label for r in scored)
        print(json.dumps({"difference": difference, "right": right,
                          "loss": model.getHistory()[-1]["train"]["loss"]}))
        """,
        jpeg_size=16,
    )
    assert result["difference"] <= 8  # JPEG decoders may round differently
    assert result["right"] == 64 and result["loss"] < 0.3


def test_gpu_decoding_augments_each_row_on_the_gpu_with_decode_batch_fn(tmp_path):
    """decode_device='cuda' with decode_batch_fn: the batch's JPEGs decoded on the GPU reach
    decode_batch_fn as one uint8 CUDA tensor with each row's generator; the batch forms of
    random_crop/random_flip crop there; the fit and transform run."""
    pytest.importorskip("torchvision.io")
    result = run_on_gpu_spark(
        tmp_path,
        f"""
        from spark_estimator.decoding import center_crop, random_crop, random_flip
        seen = {str(tmp_path / "seen")!r}
        def augment(rows, augments):
            batch = rows["content"]
            assert batch.is_cuda and batch.dtype == torch.uint8 and batch.shape[1:] == (3, 20, 20)
            open(seen, "w").write(str(batch.device))
            if augments is None:
                return {{"content": center_crop(batch, 16)}}
            return {{"content": random_flip(random_crop(batch, 16, augments), augments)}}
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.out = torch.nn.Linear(3, 2)
            def forward(self, image):
                assert image.shape[2:] == (16, 16)
                return self.out(image.float().mean((2, 3)) / 255)
        net = Net()
        model = TorchEstimator(model=net, optimizer=torch.optim.Adam(net.parameters(), lr=0.1),
                               loss=torch.nn.CrossEntropyLoss(), feature_cols=["content"],
                               label_cols=["label"], epochs=10, batch_size=16, num_proc=1,
                               decode_device="cuda", decode_batch_fn=augment, store=store,
                               use_gpu=True).fit(images)
        scored = model.transform(images).collect()
        right = sum(int(np.argmax(r.prediction)) == r.label for r in scored)
        print(json.dumps({{"seen": open(seen).read(), "right": right,
                          "decoding": model.getTrainingSummary()["decoding"][0]["pool"]}}))
        """,
        jpeg_size=20,
    )
    assert result["seen"].startswith("cuda") and result["right"] == 64
    assert result["decoding"] == "gpu"  # nothing left for decode workers


def test_decode_worker_processes_feed_a_gpu_rank_with_pinned_batches(tmp_path):
    """decode_pool='processes' on a GPU rank: the workers (no GPU of their own) decode on
    the CPU, the rank copies their batches into pinned memory and trains on its GPU as a
    rank decoding in threads does."""
    result = run_on_gpu_spark(
        tmp_path,
        """
        from spark_estimator.decoding import decode_image
        def decode(row, augment):
            assert not torch.cuda.is_available()  # a decode worker has no GPU
            return {"content": decode_image(row["content"])}
        def fit(pool):
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 2))
            return TorchEstimator(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.01),
                                  loss=torch.nn.CrossEntropyLoss(), feature_cols=["content"],
                                  label_cols=["label"], epochs=3, batch_size=16, num_proc=1,
                                  decode_fn=decode, decode_pool=pool, decode_workers=2,
                                  store=store, use_gpu=True, shuffle=False).fit(images)
        threads, processes = fit("threads"), fit("processes")
        losses = lambda m: [h["train"]["loss"] for h in m.getHistory()]
        ranks = store.read_json(store.run(processes.getRunId()).ranks)
        print(json.dumps({"threads": losses(threads), "processes": losses(processes),
                          "pool": processes.getTrainingSummary()["decoding"][0]["pool"],
                          "device": ranks[0]["device"]}))
        """,
        jpeg_size=16,
    )
    assert result["pool"] == "processes" and result["device"] == "cuda:0"
    assert result["processes"] == pytest.approx(result["threads"], rel=1e-5)


def test_a_gpu_rank_gets_its_batches_copied_to_the_device_straight_from_the_slots(tmp_path, store):
    """Decode worker processes on a GPU rank: each batch is copied to the GPU straight
    from its worker's slot (registered with CUDA: no host copy), the slot given back once
    the copy is done, the batches equal to those decoded in threads."""
    from spark_estimator.worker.decode.pool import slots_per_worker
    from tests.worker.data.test_loader import train_spec
    from tests.worker.decode.test_decoder import ROWS, image_dataset
    from tests.worker.decode.test_pool import decode_pass, decoder, same

    spec = train_spec(image_dataset(tmp_path), store, shuffle=True, shuffle_buffer_size=7)
    reference = decoder(spec, "threads", 1)
    on_gpu = decoder(spec, "processes", 2, rank_device=torch.device("cuda"))
    try:
        want = decode_pass(spec, reference)
        got = decode_pass(spec, on_gpu)
        pool = on_gpu.processes
        assert pool.delivery.mode == "device" and pool.delivery.registered
        for _, decoded, _ in got:
            assert decoded["img"].is_cuda and decoded.masks["tokens"].is_cuda
        torch.cuda.synchronize()
        as_cpu = [(ids, _on_cpu(d), kept) for ids, d, kept in got]
        same(as_cpu, want)
        assert sum(len(ids) for ids, _, _ in got) <= ROWS
        with pool.changed:
            pool.delivery.poll()
            pool._take_back()
            most = slots_per_worker("device")  # two decoded into, one copied out of
            assert all(s.made <= most and not s.viewed for s in pool.slots.values())
    finally:
        reference.close()
        on_gpu.close()
    assert not on_gpu.processes.delivery.registered  # unregistered at the end


def _on_cpu(decoded):
    columns = {n: v.cpu() if torch.is_tensor(v) else v for n, v in decoded.columns.items()}
    return type(decoded)(columns, {n: m.cpu() for n, m in decoded.masks.items()}, decoded.rows)


def test_transform_on_a_gpu_joins_its_parts_in_pinned_memory():
    from spark_estimator.worker.decode.decoded import Decoded
    from spark_estimator.worker.predict_decode import join_parts

    pixels = torch.randint(0, 255, (6, 4, 4, 3), dtype=torch.uint8).pin_memory()
    images = pixels.permute(0, 3, 1, 2)  # channels-last, as decoded
    parts = [Decoded({"img": images[:4]}, {}, 4), Decoded({"img": images[4:]}, {}, 2)]
    joined = join_parts(parts, 0.0)["img"]
    assert joined.is_pinned() and torch.equal(joined, images)
    assert joined.is_contiguous(memory_format=torch.channels_last)
