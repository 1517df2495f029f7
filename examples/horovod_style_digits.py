"""Horovod's classic PyTorch MNIST script, converted to spark_estimator.run.

The training function keeps the structure of Horovod's ``pytorch_mnist`` example: init,
pin the GPU, shard the data per rank, scale the learning rate by the number of workers,
start from rank 0's parameters, train, average the test metric over workers, and let
rank 0 report. Each step is commented with the Horovod call it replaces. The data is
scikit-learn's bundled 8x8 digits (no download); DistributedDataParallel stands in for
``hvd.DistributedOptimizer``.

Run it with either of:
    PYSPARK_PYTHON=.venv/bin/python .venv/bin/spark-submit --master "local[2]" \
        examples/horovod_style_digits.py --epochs 10 --num-proc 2
    .venv/bin/python examples/horovod_style_digits.py --epochs 10 --num-proc 2
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from pyspark.sql import SparkSession
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from spark_estimator import distributed as sd
from spark_estimator import run


def spark_session(app_name: str) -> SparkSession:
    builder = SparkSession.builder.appName(app_name).config("spark.ui.showConsoleProgress", "false")
    # Under spark-submit the master comes from its --master or properties file; run as a
    # plain Python script, this picks one.
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        builder = builder.master(os.environ.get("SPARK_MASTER", "local[2]"))
    return builder.getOrCreate()


class Net(torch.nn.Module):
    """Horovod's MNIST network, sized for 8x8 images."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.fc1 = torch.nn.Linear(32 * 2 * 2, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))  # 16 x 4 x 4
        x = F.relu(F.max_pool2d(self.conv2(x), 2))  # 32 x 2 x 2
        x = F.relu(self.fc1(x.flatten(1)))
        return F.log_softmax(self.fc2(x), dim=1)


def digits_datasets(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """The same 80/20 train/test split on every rank."""
    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images / 16.0, dtype=torch.float32).view(-1, 1, 8, 8)
    y = torch.tensor(labels, dtype=torch.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=seed, stratify=y
    )
    return TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)


def train_fn(epochs: int, batch_size: int, lr: float, momentum: float, seed: int) -> list:
    """One worker's training; spark_estimator.run calls it once per rank."""
    # hvd.init(): nothing to do, run() calls this function inside an initialised
    # torch.distributed process group (gloo on CPU, NCCL on GPU).

    # torch.cuda.set_device(hvd.local_rank()): run() already pinned the GPU Spark assigned
    # to this task (or the CPU); sd.device() says which.
    device = sd.device()
    torch.manual_seed(seed)

    # DistributedSampler(train_dataset, num_replicas=hvd.size(), rank=hvd.rank()): the same,
    # with sd.size() and sd.rank(), so each rank trains on its own shard.
    train_set, test_set = digits_datasets(seed)
    train_sampler = DistributedSampler(
        train_set, num_replicas=sd.size(), rank=sd.rank(), shuffle=True, seed=seed
    )
    test_sampler = DistributedSampler(
        test_set, num_replicas=sd.size(), rank=sd.rank(), shuffle=False
    )
    train_loader = DataLoader(train_set, batch_size=batch_size, sampler=train_sampler)
    test_loader = DataLoader(test_set, batch_size=256, sampler=test_sampler)

    model = Net().to(device)
    # lr_scaler = hvd.size(): the effective batch is size() times larger, so is the lr.
    optimizer = torch.optim.SGD(model.parameters(), lr=lr * sd.size(), momentum=momentum)

    # hvd.broadcast_parameters(model.state_dict(), root_rank=0) and
    # hvd.DistributedOptimizer(optimizer, named_parameters=...): DDP broadcasts rank 0's
    # parameters when it wraps the model, then averages gradients across ranks in backward().
    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )

    history = []
    for epoch in range(1, epochs + 1):
        # train_sampler.set_epoch(epoch): unchanged, a new shuffle every epoch.
        train_sampler.set_epoch(epoch)
        ddp.train()
        for data, target in train_loader:
            data, target = data.to(device), target.to(device)
            optimizer.zero_grad()
            F.nll_loss(ddp(data), target).backward()
            optimizer.step()

        # test(): each rank evaluates its shard of the test set ...
        model.eval()
        loss_sum, correct = 0.0, 0
        with torch.no_grad():
            for data, target in test_loader:
                data, target = data.to(device), target.to(device)
                output = model(data)
                loss_sum += F.nll_loss(output, target, reduction="sum").item()
                correct += (output.argmax(dim=1) == target).sum().item()
        shard = len(test_sampler)
        # ... and metric_average(val, name) = hvd.allreduce(torch.tensor(val), name=name)
        # becomes sd.allreduce(val), which averages a Python float over the ranks.
        history.append(
            {
                "epoch": epoch,
                "test_loss": sd.allreduce(loss_sum / shard),
                "test_accuracy": sd.allreduce(correct / shard),
            }
        )
    # if hvd.rank() == 0: print(...): every rank holds the same averages; run(...,
    # rank0_only=True) brings rank 0's back to the driver, which prints them.
    return history


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.02, help="per-worker learning rate")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--use-gpu", action="store_true", help="pin the GPU Spark assigns to each task"
    )
    args = parser.parse_args(argv)

    # Executors must run the same Python as this driver (and find torch in it).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = spark_session("spark-estimator horovod-style digits")
    spark.sparkContext.setLogLevel("ERROR")

    # horovod.spark.run(train_fn, args=..., num_proc=...) becomes:
    history = run(
        train_fn,
        kwargs=dict(
            epochs=args.epochs,
            batch_size=args.batch_size,
            lr=args.lr,
            momentum=args.momentum,
            seed=args.seed,
        ),
        num_proc=args.num_proc,
        use_gpu=args.use_gpu,
        spark=spark,
        rank0_only=True,
    )
    spark.stop()

    print(f"\ntest metrics averaged over {args.num_proc} workers")
    print(f"{'epoch':>5} {'test loss':>10} {'test accuracy':>14}")
    for record in history:
        print(f"{record['epoch']:>5} {record['test_loss']:>10.4f} {record['test_accuracy']:>14.3f}")
    print(f"\nfinal test accuracy: {history[-1]['test_accuracy']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
