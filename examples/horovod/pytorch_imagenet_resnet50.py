"""Horovod's ImageNet ResNet-50 training script, in its shape, on scikit-learn's digits.

It has the shape of Horovod's ``pytorch_imagenet_resnet50.py``: the same flags and ``hvd``
calls in the same order. Rank 0 looks for the last epoch's checkpoint and broadcasts the
epoch to resume from; the learning rate is scaled by the number of ranks (and by
``--batches-per-allreduce``) after a linear warm-up (Goyal et al., "Accurate, Large
Minibatch SGD", https://arxiv.org/abs/1706.02677) and divided by 10 three times later on;
each optimizer step takes ``--batches-per-allreduce`` batches of ``--batch-size`` on each
rank (``backward_passes_per_step``); training and validation metrics are averaged over the
ranks with ``hvd.allreduce``; rank 0 writes TensorBoard logs and a checkpoint per epoch.

What differs from Horovod's script, besides the import line (``spark_estimator.horovod``
for ``horovod.torch``):

- the data: scikit-learn's bundled 8x8 digits (every fifth image validates), so there is no
  ``--train-dir`` / ``--val-dir``; training images are shifted by up to one pixel at random
  where Horovod's are cropped and flipped;
- the model: a ResNet of 8 layers for 8x8 images (three basic blocks), not ResNet-50;
- the schedule: the rate is divided by 10 after 1/3, 2/3 and 8/9 of ``--epochs`` (Horovod's
  epochs 30, 60 and 80 of 90), so that short runs see it too;
- the defaults: 9 epochs, the first 2 warming up (Horovod's: 90 and 5);
- progress: rank 0 prints one line per epoch for training and one for validation, where
  Horovod's draws tqdm progress bars; data loaders use no worker processes.

    .venv/bin/spark-estimator-run -np 2 --master "local[2]" \
        examples/horovod/pytorch_imagenet_resnet50.py --epochs 9

or alone, as one process: ``.venv/bin/python examples/horovod/pytorch_imagenet_resnet50.py``.
Started again with the same ``--checkpoint-format``, it resumes after the last checkpoint.
"""

import argparse
import math
import os

import numpy as np
import torch
import torch.backends.cudnn as cudnn
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
from sklearn.datasets import load_digits
from torch.utils.tensorboard import SummaryWriter

import spark_estimator.horovod as hvd

# Training settings
parser = argparse.ArgumentParser(description="PyTorch ImageNet-style example on digits",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--log-dir", default="./logs",
                    help="tensorboard log directory")
parser.add_argument("--checkpoint-format", default="./checkpoint-{epoch}.pth.tar",
                    help="checkpoint file format")
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="use fp16 compression during allreduce")
parser.add_argument("--batches-per-allreduce", type=int, default=1,
                    help="number of batches processed locally before executing allreduce "
                         "across workers; it multiplies total batch size.")
parser.add_argument("--use-adasum", action="store_true", default=False,
                    help="use adasum algorithm to do reduction")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0,
                    help="apply gradient predivide factor in optimizer (default: 1.0)")

# Default settings from https://arxiv.org/abs/1706.02677, for fewer and smaller images.
parser.add_argument("--batch-size", type=int, default=32,
                    help="input batch size for training")
parser.add_argument("--val-batch-size", type=int, default=32,
                    help="input batch size for validation")
parser.add_argument("--epochs", type=int, default=9,
                    help="number of epochs to train")
parser.add_argument("--base-lr", type=float, default=0.0125,
                    help="learning rate for a single worker")
parser.add_argument("--warmup-epochs", type=float, default=2,
                    help="number of warmup epochs")
parser.add_argument("--momentum", type=float, default=0.9,
                    help="SGD momentum")
parser.add_argument("--wd", type=float, default=0.00005,
                    help="weight decay")

parser.add_argument("--no-cuda", action="store_true", default=False,
                    help="disables CUDA training")
parser.add_argument("--seed", type=int, default=42,
                    help="random seed")


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a shortcut (a 1x1 convolution where the
    shape changes), as in ResNet-18/34."""

    def __init__(self, inputs, outputs, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.shortcut = nn.Sequential()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(
                nn.Conv2d(inputs, outputs, 1, stride=stride, bias=False), nn.BatchNorm2d(outputs))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet8():
    """A ResNet of 8 layers for 1x8x8 images: a 3x3 stem, three basic blocks (16, 32, 64
    channels: 8x8, 4x4, 2x2), global average pooling and a linear classifier."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        BasicBlock(16, 16, 1), BasicBlock(16, 32, 2), BasicBlock(32, 64, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


class Digits(torch.utils.data.Dataset):
    """scikit-learn's digits, every fifth image for validation; pixels scaled to [0, 1] and
    normalized with the training images' mean and standard deviation. Training images are
    shifted by -1, 0 or 1 pixel in each direction at random (zeros fill in)."""

    def __init__(self, train):
        images, labels = load_digits(return_X_y=True)
        validation = np.arange(len(labels)) % 5 == 0
        x = torch.tensor(images / 16.0, dtype=torch.float32).view(-1, 1, 8, 8)
        mean, std = x[~validation].mean(), x[~validation].std()
        rows = torch.from_numpy(~validation if train else validation)
        self.images, self.labels = (x[rows] - mean) / std, torch.tensor(labels)[rows]
        self.train = train

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        image = self.images[i]
        if self.train:
            dy, dx = torch.randint(-1, 2, (2,)).tolist()
            image = torch.roll(F.pad(image, (1, 1, 1, 1)), (dy, dx), dims=(1, 2))[:, 1:9, 1:9]
        return image, self.labels[i]


def train(epoch):
    model.train()
    train_sampler.set_epoch(epoch)
    train_loss = Metric("train_loss")
    train_accuracy = Metric("train_accuracy")

    for batch_idx, (data, target) in enumerate(train_loader):
        adjust_learning_rate(epoch, batch_idx)

        if args.cuda:
            data, target = data.cuda(), target.cuda()
        optimizer.zero_grad()
        # Split data into sub-batches of size batch_size
        for i in range(0, len(data), args.batch_size):
            data_batch = data[i:i + args.batch_size]
            target_batch = target[i:i + args.batch_size]
            output = model(data_batch)
            train_accuracy.update(accuracy(output, target_batch))
            loss = F.cross_entropy(output, target_batch)
            train_loss.update(loss)
            # Average gradients among sub-batches
            loss.div_(math.ceil(float(len(data)) / args.batch_size))
            loss.backward()
        # Gradient is applied across all ranks
        optimizer.step()

    if verbose:
        print(f"Train Epoch #{epoch + 1}: loss {train_loss.avg.item():.4f}, "
              f"accuracy {100. * train_accuracy.avg.item():.2f}%")
    if log_writer:
        log_writer.add_scalar("train/loss", train_loss.avg, epoch)
        log_writer.add_scalar("train/accuracy", train_accuracy.avg, epoch)


def validate(epoch):
    model.eval()
    val_loss = Metric("val_loss")
    val_accuracy = Metric("val_accuracy")

    with torch.no_grad():
        for data, target in val_loader:
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            output = model(data)

            val_loss.update(F.cross_entropy(output, target))
            val_accuracy.update(accuracy(output, target))

    if verbose:
        print(f"Validate Epoch #{epoch + 1}: loss {val_loss.avg.item():.4f}, "
              f"Accuracy: {100. * val_accuracy.avg.item():.2f}%")
    if log_writer:
        log_writer.add_scalar("val/loss", val_loss.avg, epoch)
        log_writer.add_scalar("val/accuracy", val_accuracy.avg, epoch)


# Horovod: using `lr = base_lr * hvd.size()` from the very beginning leads to worse final
# accuracy. Scale the learning rate from `base_lr` to `base_lr * hvd.size()` linearly during
# the first warmup epochs (https://arxiv.org/abs/1706.02677). After the warmup, divide it by
# 10 after 1/3, 2/3 and 8/9 of the epochs.
def adjust_learning_rate(epoch, batch_idx):
    if epoch < args.warmup_epochs:
        epoch += float(batch_idx + 1) / len(train_loader)
        lr_adj = 1. / hvd.size() * (epoch * (hvd.size() - 1) / args.warmup_epochs + 1)
    elif epoch < args.epochs / 3:
        lr_adj = 1.
    elif epoch < args.epochs * 2 / 3:
        lr_adj = 1e-1
    elif epoch < args.epochs * 8 / 9:
        lr_adj = 1e-2
    else:
        lr_adj = 1e-3
    for param_group in optimizer.param_groups:
        param_group["lr"] = args.base_lr * hvd.size() * args.batches_per_allreduce * lr_adj


def accuracy(output, target):
    # get the index of the max log-probability
    pred = output.max(1, keepdim=True)[1]
    return pred.eq(target.view_as(pred)).cpu().float().mean()


def save_checkpoint(epoch):
    if hvd.rank() == 0:
        filepath = args.checkpoint_format.format(epoch=epoch + 1)
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
        }
        torch.save(state, filepath)


# Horovod: average metrics from distributed training.
class Metric:
    def __init__(self, name):
        self.name = name
        self.sum = torch.tensor(0.)
        self.n = torch.tensor(0.)

    def update(self, val):
        self.sum += hvd.allreduce(val.detach().cpu(), name=self.name)
        self.n += 1

    @property
    def avg(self):
        return self.sum / self.n


if __name__ == "__main__":
    args = parser.parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()

    allreduce_batch_size = args.batch_size * args.batches_per_allreduce

    hvd.init()
    torch.manual_seed(args.seed)

    if args.cuda:
        # Horovod: pin GPU to local rank.
        torch.cuda.set_device(hvd.local_rank())
        torch.cuda.manual_seed(args.seed)

    cudnn.benchmark = True

    # If set > 0, will resume training from a given checkpoint.
    resume_from_epoch = 0
    for try_epoch in range(args.epochs, 0, -1):
        if os.path.exists(args.checkpoint_format.format(epoch=try_epoch)):
            resume_from_epoch = try_epoch
            break

    # Horovod: broadcast resume_from_epoch from rank 0 (which will have
    # checkpoints) to other ranks.
    resume_from_epoch = hvd.broadcast(torch.tensor(resume_from_epoch), root_rank=0,
                                      name="resume_from_epoch").item()

    # Horovod: print logs on the first worker.
    verbose = 1 if hvd.rank() == 0 else 0

    # Horovod: write TensorBoard logs on first worker.
    log_writer = SummaryWriter(args.log_dir) if hvd.rank() == 0 else None

    # Horovod: limit # of CPU threads to be used per worker.
    torch.set_num_threads(1)

    kwargs = {"pin_memory": True} if args.cuda else {}

    train_dataset = Digits(train=True)
    # Horovod: use DistributedSampler to partition data among workers. Manually specify
    # `num_replicas=hvd.size()` and `rank=hvd.rank()`.
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=allreduce_batch_size,
        sampler=train_sampler, **kwargs)

    val_dataset = Digits(train=False)
    val_sampler = torch.utils.data.distributed.DistributedSampler(
        val_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    val_loader = torch.utils.data.DataLoader(val_dataset, batch_size=args.val_batch_size,
                                             sampler=val_sampler, **kwargs)

    # Set up the ResNet.
    model = resnet8()

    # By default, Adasum doesn't need scaling up learning rate.
    # For sum/average with gradient Accumulation: scale learning rate by batches_per_allreduce
    lr_scaler = args.batches_per_allreduce * hvd.size() if not args.use_adasum else 1

    if args.cuda:
        # Move model to GPU.
        model.cuda()
        # Horovod scales by local_size for its hierarchical GPU Adasum (docs/horovod.md#adasum).
        if args.use_adasum and hvd.nccl_built():
            lr_scaler = args.batches_per_allreduce * hvd.local_size()

    # Horovod: scale learning rate by the number of workers.
    optimizer = optim.SGD(model.parameters(),
                          lr=(args.base_lr *
                              lr_scaler),
                          momentum=args.momentum, weight_decay=args.wd)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: wrap optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=compression,
        backward_passes_per_step=args.batches_per_allreduce,
        op=hvd.Adasum if args.use_adasum else hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor)

    # Restore from a previous checkpoint, if initial_epoch is specified.
    # Horovod: restore on the first worker which will broadcast weights to other workers.
    if resume_from_epoch > 0 and hvd.rank() == 0:
        filepath = args.checkpoint_format.format(epoch=resume_from_epoch)
        checkpoint = torch.load(filepath)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])

    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    for epoch in range(resume_from_epoch, args.epochs):
        train(epoch)
        validate(epoch)
        save_checkpoint(epoch)
