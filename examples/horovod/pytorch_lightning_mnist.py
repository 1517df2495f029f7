"""Horovod's PyTorch Lightning MNIST script, in its shape, on scikit-learn's digits.

Horovod's ``pytorch_lightning_mnist.py`` is started by ``horovodrun`` and trains a
LightningModule with ``Trainer(accelerator='horovod')``: each process builds its own
distributed loaders (``DistributedSampler`` with ``hvd.size()`` and ``hvd.rank()``), fits,
then tests with the metrics averaged by ``hvd.allreduce``. This script keeps that shape
(flags, module, loaders, callback, test) and is started by ``spark-estimator-run``
instead. What differs, besides the import line (``spark_estimator.horovod`` for
``horovod.torch``):

- Lightning 2 has no Horovod accelerator. The Trainer runs Lightning's DDP strategy on the
  process group ``hvd.init()`` formed, told the ranks by ``HorovodEnvironment`` below (every
  rank a node of one device, as the ranks of Spark tasks are); the gradients are averaged by
  DDP. Lightning's Horovod support multiplied the learning rate by ``hvd.size()``:
  ``configure_optimizers`` does it here.
- Lightning 2's hooks: the validation loss is logged with ``self.log`` in
  ``on_validation_epoch_end`` (``validation_epoch_end`` is gone) and the callback counts
  ``on_train_epoch_end`` and ``on_validation_epoch_end`` (``on_epoch_end`` is gone).
- The data: scikit-learn's bundled 8x8 digits (every fifth image tests), so there is no
  download, no ``--data-dir`` and no file lock; the network is sized for 8x8 images, and the
  loaders use no worker processes. The rate is a flag, ``--lr``, 0.1 by default where
  Horovod's is 0.01: the digits give 23 steps an epoch, MNIST 938.
- No progress bar: each rank's lines reach the launcher's terminal as they are printed.
- One CPU thread per rank (``torch.set_num_threads(1)``, as Horovod's MNIST script sets):
  ranks sharing a host's cores otherwise wait on each other's threads.

    .venv/bin/spark-estimator-run -np 2 --master "local[2]" \
        examples/horovod/pytorch_lightning_mnist.py --epochs 10

or alone, as one process: ``.venv/bin/python examples/horovod/pytorch_lightning_mnist.py``.
Needs Lightning: ``.venv/bin/pip install -e '.[lightning]'``.
"""

import argparse
import os
import tempfile

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.environments import ClusterEnvironment
from lightning.pytorch.strategies import DDPStrategy
from sklearn.datasets import load_digits

import spark_estimator.horovod as hvd

# Training settings
parser = argparse.ArgumentParser(description="PyTorch Lightning digits example")
parser.add_argument("--batch-size", type=int, default=64, metavar="N",
                    help="input batch size for training (default: 64)")
parser.add_argument("--test-batch-size", type=int, default=1000, metavar="N",
                    help="input batch size for testing (default: 1000)")
parser.add_argument("--epochs", type=int, default=10, metavar="N",
                    help="number of epochs to train (default: 10)")
parser.add_argument("--lr", type=float, default=0.1, metavar="LR",
                    help="learning rate for one process (default: 0.1)")
parser.add_argument("--no-cuda", action="store_true", default=False,
                    help="disables CUDA training")
parser.add_argument("--seed", type=int, default=42, metavar="S",
                    help="random seed (default: 42)")


# The model, with nothing about Horovod in it but the rate's scaling.
class Net(LightningModule):
    def __init__(self, lr):
        super().__init__()
        self.lr = lr
        self.conv1 = nn.Conv2d(1, 10, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=3, padding=1)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(80, 50)
        self.fc2 = nn.Linear(50, 10)
        self.val_losses = []

    def forward(self, x):
        x = x.float()
        x = F.relu(F.max_pool2d(self.conv1(x), 2))  # 10 x 4 x 4
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))  # 20 x 2 x 2
        x = x.view(-1, 80)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, -1)

    def configure_optimizers(self):
        # Lightning's Horovod support scaled the rate by the number of processes
        return optim.SGD(self.parameters(), lr=self.lr * hvd.size(), momentum=0.5)

    def training_step(self, batch, batch_nb):
        x, y = batch[0], batch[1]
        y_hat = self(x)
        loss = F.nll_loss(y_hat, y.long())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_nb):
        x, y = batch[0], batch[1]
        y_hat = self(x)
        self.val_losses.append(F.nll_loss(y_hat, y.long()))

    def on_validation_epoch_end(self):
        self.log("avg_val_loss", torch.stack(self.val_losses).mean(), sync_dist=True)
        self.val_losses.clear()


class HorovodEnvironment(ClusterEnvironment):
    """The ranks as ``hvd`` sees them, for Lightning: each rank is a node with one device;
    the processes and their group exist already (``hvd.init()``)."""

    @property
    def creates_processes_externally(self):
        return True

    @property
    def main_address(self):
        return os.environ.get("MASTER_ADDR", "127.0.0.1")  # unused: the group is formed

    @property
    def main_port(self):
        return int(os.environ.get("MASTER_PORT", 0))

    @staticmethod
    def detect():
        return hvd.is_initialized()

    def world_size(self):
        return hvd.size()

    def set_world_size(self, size):
        if size != hvd.size():
            raise ValueError(f"Lightning asked for {size} processes; hvd has {hvd.size()}")

    def global_rank(self):
        return hvd.rank()

    def set_global_rank(self, rank):
        if rank != hvd.rank():
            raise ValueError(f"Lightning gave rank {rank} to hvd's rank {hvd.rank()}")

    def local_rank(self):
        return 0

    def node_rank(self):
        return hvd.rank()


def digits(train):
    """Every fifth image is a test image; the others train. Pixels scaled to [0, 1] and
    normalized with the training images' mean and standard deviation."""
    images, labels = load_digits(return_X_y=True)
    test_rows = np.arange(len(labels)) % 5 == 0
    x = torch.tensor(images / 16.0, dtype=torch.float32).view(-1, 1, 8, 8)
    mean, std = x[~test_rows].mean(), x[~test_rows].std()
    rows = torch.from_numpy(test_rows if not train else ~test_rows)
    return torch.utils.data.TensorDataset((x[rows] - mean) / std, torch.tensor(labels)[rows])


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def test():
    model.eval()
    test_loss = 0.
    test_accuracy = 0.
    with torch.no_grad():
        for data, target in test_loader:
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            output = model(data)
            # sum up batch loss
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            # get the index of the max log-probability
            pred = output.data.max(1, keepdim=True)[1]
            test_accuracy += pred.eq(target.data.view_as(pred)).cpu().float().sum().item()

    # Horovod: use test_sampler to determine the number of examples in
    # this worker's partition.
    test_loss /= len(test_sampler)
    test_accuracy /= len(test_sampler)

    # Horovod: average metric values across workers.
    test_loss = metric_average(test_loss, "avg_loss")
    test_accuracy = metric_average(test_accuracy, "avg_accuracy")

    # Horovod: print output only on first rank.
    if hvd.rank() == 0:
        print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {100. * test_accuracy:.2f}%\n")


if __name__ == "__main__":
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    hvd.init()
    args.cuda = not args.no_cuda and torch.cuda.is_available()
    if args.cuda:
        torch.cuda.set_device(hvd.local_rank())
        torch.cuda.manual_seed(args.seed)

    # Horovod: limit # of CPU threads to be used per worker (as its MNIST script does).
    torch.set_num_threads(1)

    train_dataset = digits(train=True)

    # set training data loader
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, sampler=train_sampler)

    test_dataset = digits(train=False)

    # set validation data loader
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size,
                                              sampler=test_sampler)

    epochs = args.epochs
    with tempfile.TemporaryDirectory() as run_output_dir:
        ckpt_path = os.path.join(run_output_dir, "checkpoint")
        os.makedirs(ckpt_path, exist_ok=True)

        logs_path = os.path.join(run_output_dir, "logger")
        os.makedirs(logs_path, exist_ok=True)
        logger = TensorBoardLogger(logs_path)

        train_percent = 1.0
        val_percent = 1.0

        model = Net(args.lr)
        setattr(model, "train_dataloader", lambda: train_loader)  # noqa: B010 (as Horovod's)
        setattr(model, "val_dataloader", lambda: test_loader)  # noqa: B010

        class MyDummyCallback(Callback):
            def __init__(self):
                self.val_epoch_end_counter = 0
                self.train_epoch_end_counter = 0

            def on_validation_epoch_end(self, trainer, model):
                print("A validation epoch ended.")
                self.val_epoch_end_counter += 1

            def on_train_epoch_end(self, trainer, model):
                print("A train epoch ended.")
                self.train_epoch_end_counter += 1

            def on_train_end(self, trainer, model):
                print("Training ends")
                assert self.val_epoch_end_counter == epochs
                assert self.train_epoch_end_counter == epochs

        callbacks = [MyDummyCallback(), ModelCheckpoint(dirpath=ckpt_path)]

        trainer = Trainer(accelerator="gpu" if args.cuda else "cpu",
                          devices=[hvd.local_rank()] if args.cuda else 1,
                          num_nodes=hvd.size(),
                          strategy=DDPStrategy(cluster_environment=HorovodEnvironment()),
                          callbacks=callbacks,
                          max_epochs=epochs,
                          limit_train_batches=train_percent,
                          limit_val_batches=val_percent,
                          logger=logger,
                          num_sanity_val_steps=0,
                          enable_progress_bar=False)

        trainer.fit(model)
        if args.cuda:
            model = model.cuda()
        test()
