"""Hand-written FSDP2 training under spark_estimator.run: a small transformer on digits.

Each rank shards the model over sd.device_mesh() with FSDP2's ``fully_shard``, trains it
with AdamW and gradient clipping on its slice of the data, saves a sharded checkpoint with
torch.distributed.checkpoint, loads it into a fresh sharded model, and returns the full
state dict gathered on rank 0, which the driver scores unsharded on held-out images. Run:
    PYSPARK_PYTHON=.venv/bin/python .venv/bin/spark-submit --master "local[2]" \
        examples/fsdp_run.py
"""

import argparse
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed.checkpoint as dcp
from pyspark.sql import SparkSession
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard

from spark_estimator import distributed as sd
from spark_estimator import run

BATCH_SIZE, LR, SEED = 32, 3e-3, 0  # a rank's batch; AdamW's; the data split's and weights'


class DigitsTransformer(nn.Module):
    """Each 8x8 image as 8 tokens (its rows of pixels), two pre-norm transformer blocks
    (self-attention, then an MLP), mean-pooled to 10 logits."""

    def __init__(self, dim: int = 64, depth: int = 2, heads: int = 4):
        super().__init__()
        self.embed, self.position = nn.Linear(8, dim), nn.Parameter(0.02 * torch.randn(8, dim))
        block = dict(dim_feedforward=4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        blocks = (nn.TransformerEncoderLayer(dim, heads, **block) for _ in range(depth))
        self.blocks = nn.Sequential(*blocks)
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 10)

    def forward(self, pixels):
        x = self.blocks(self.embed(pixels.view(-1, 8, 8)) + self.position)
        return self.head(self.norm(x).mean(dim=1))


def digits():
    """The same 80/20 split of scikit-learn's bundled digits everywhere (no download)."""
    images, labels = load_digits(return_X_y=True)
    x, y = torch.tensor(images / 16.0, dtype=torch.float32), torch.tensor(labels)
    return train_test_split(x, y, test_size=0.2, random_state=SEED, stratify=labels)


def sharded_model(seed: int) -> nn.Module:
    # Built whole with the same seed on every rank: fully_shard keeps each rank's slice of
    # the same weights. (Built on the "meta" device, then to_empty() and reset_parameters(),
    # a CPU mesh does not coordinate the ranks' random numbers: with one seed every shard
    # gets the same values, rows repeated across shards, unless each rank seeds its own.)
    torch.manual_seed(seed)
    model = DigitsTransformer().to(sd.device())
    for block in model.blocks:  # each block's parameters are gathered only while it runs
        fully_shard(block, mesh=sd.device_mesh())
    return fully_shard(model, mesh=sd.device_mesh())  # the rest: embedding, norm, head


def train(checkpoint: str, epochs: int):
    """One rank's training; spark_estimator.run calls it once per rank, group formed."""
    rank, size, device = sd.rank(), sd.size(), sd.device()
    x_train, _, y_train, _ = digits()
    x, y = x_train[rank::size].to(device), y_train[rank::size].to(device)  # this rank's slice
    steps = len(x_train) // (size * BATCH_SIZE)  # the same on every rank: FSDP's collectives
    model = sharded_model(SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    held = sum(p.to_local().numel() for p in model.parameters())  # DTensors: this rank's shard
    print(f"holds {held} of {sum(p.numel() for p in model.parameters())} parameter elements")
    shuffle = torch.Generator().manual_seed(SEED + rank)
    for epoch in range(1, epochs + 1):
        order, loss_sum = torch.randperm(len(x), generator=shuffle), 0.0
        for step in range(steps):
            batch = order[step * BATCH_SIZE : (step + 1) * BATCH_SIZE]
            loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
            optimizer.zero_grad()
            loss.backward()  # FSDP reduce-scatters the gradients: each rank keeps its shard's
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)  # the global norm
            optimizer.step()
            loss_sum += loss.item()
        mean_loss = sd.allreduce(loss_sum / steps)
        if rank == 0:
            print(f"epoch {epoch}  train loss {mean_loss:.4f}")

    # Each rank writes its own shards (rank 0 the metadata too) into one folder, ...
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=checkpoint)
    # ... from which a freshly built, sharded model (other weights) reads its shards back.
    model = sharded_model(SEED + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=checkpoint)  # in place
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    # Every rank takes part in the gather; rank 0 alone gets the full tensors, on the CPU.
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=options)
    return full if rank == 0 else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", help="store folder (default: a new temporary folder)")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--num-proc", type=int, default=2)
    args = parser.parse_args(argv)
    store = os.path.abspath(args.store or tempfile.mkdtemp(prefix="spark-estimator-fsdp-"))
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # the executors' Python: this one
    builder = SparkSession.builder.appName("spark-estimator FSDP2 digits")
    if "PYSPARK_GATEWAY_PORT" not in os.environ:  # plain Python, not spark-submit: pick a master
        builder = builder.master(os.environ.get("SPARK_MASTER", "local[2]"))
    spark = builder.config("spark.ui.showConsoleProgress", "false").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    checkpoint = os.path.join(store, "checkpoints", "fsdp_digits")
    shutil.rmtree(checkpoint, ignore_errors=True)  # a run with the same --store replaces it
    state = run(
        train,
        args=(checkpoint, args.epochs),
        num_proc=args.num_proc,
        rank0_only=True,  # rank 0's return value: the full state dict
        stdout=sys.stdout,  # the ranks' prints, as "[rank r] ...", on this driver's stdout
        store=store,
    )
    spark.stop()

    model = DigitsTransformer()  # plain, unsharded: the gathered weights load as usual
    model.load_state_dict(state)
    _, x_test, _, y_test = digits()
    with torch.no_grad():
        accuracy = (model.eval()(x_test).argmax(dim=1) == y_test).float().mean().item()
    print(f"sharded checkpoint in {checkpoint}")
    print(f"held-out accuracy: {accuracy:.3f} on {len(y_test)} images")
    return 0 if accuracy >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
