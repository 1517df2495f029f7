"""Horovod's elastic ImageNet ResNet-50 example, on scikit-learn's digits.

It has the shape of Horovod's ``examples/elastic/pytorch/pytorch_imagenet_resnet50_elastic.py``:
the same flags (Horovod, elastic and the arXiv:1706.02677 training settings), the training
and validation sets cut by ``hvd.elastic.ElasticSampler``, a ``TorchState`` holding the
model, the optimizer, both samplers, the epoch and the batch, ``record_batch`` after each
batch, a commit every ``--batches-per-commit`` batches and a ``check_host_updates()`` every
``--batches-per-host-check``, an ``@hvd.elastic.run`` training function, the learning rate
warmed up to ``base_lr x hvd.size()`` over the first epochs and decayed later, and metrics
averaged over the ranks. What differs:

- the import line (``spark_estimator.horovod`` for ``horovod.torch``);
- the data and the network: scikit-learn's bundled 8x8 digits (every fifth image for
  validation: nothing is downloaded) and a small ResNet of the same basic blocks, so that a
  run takes a minute or two on CPUs; the learning rate's decay steps come at a third, two
  thirds and eight ninths of ``--epochs`` (Horovod's 30, 60 and 80 of 90);
- per-epoch lines from rank 0 instead of tqdm bars (the launcher shows lines), and no
  TensorBoard log or checkpoint files (``--log-dir``, ``--checkpoint-format``): the commits
  in the run's store are the checkpoints (``--run-id`` resumes a run);
- a reset callback sets the learning rate for the new ``hvd.size()`` at once (Horovod's
  example leaves it to the next batch's ``adjust_learning_rate``).

Start it with 3 ranks, go on with 2 after a lost one and grow back to 3 when the cluster
offers the slot again:

    .venv/bin/spark-estimator-run -np 3 --min-np 2 --max-np 3 --master spark://host:7077 \\
        --store /shared/store examples/horovod/pytorch_imagenet_elastic.py --epochs 12

or alone, as one process: ``.venv/bin/python examples/horovod/pytorch_imagenet_elastic.py``.
"""

import argparse
import math

import numpy as np
import torch
import torch.backends.cudnn as cudnn
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
from sklearn.datasets import load_digits

import spark_estimator.horovod as hvd

# Training settings
parser = argparse.ArgumentParser(description='Elastic PyTorch ImageNet Example (on digits)',
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)

# Horovod settings
parser.add_argument('--fp16-allreduce', action='store_true', default=False,
                    help='use fp16 compression during allreduce')
parser.add_argument('--batches-per-allreduce', type=int, default=1,
                    help='number of batches processed locally before '
                         'executing allreduce across workers; it multiplies '
                         'total batch size.')
parser.add_argument('--use-adasum', action='store_true', default=False,
                    help='use adasum algorithm to do reduction')
parser.add_argument('--gradient-predivide-factor', type=float, default=1.0,
                    help='apply gradient predivide factor in optimizer (default: 1.0)')

# Elastic Horovod settings
parser.add_argument('--batches-per-commit', type=int, default=10,
                    help='number of batches processed before calling `state.commit()`; '
                         'commits prevent losing progress if an error occurs, but slow '
                         'down training.')
parser.add_argument('--batches-per-host-check', type=int, default=2,
                    help='number of batches processed before calling `state.check_host_updates()`; '
                         'this check is very fast compared to state.commit() (which calls this '
                         'as part of the commit process), but because still incurs some cost due '
                         'to broadcast, so we may not want to perform it every batch.')

# Default settings from https://arxiv.org/abs/1706.02677, for digits.
parser.add_argument('--batch-size', type=int, default=32,
                    help='input batch size for training')
parser.add_argument('--val-batch-size', type=int, default=32,
                    help='input batch size for validation')
parser.add_argument('--epochs', type=int, default=12,
                    help='number of epochs to train')
parser.add_argument('--base-lr', type=float, default=0.0125,
                    help='learning rate for a single GPU')
parser.add_argument('--warmup-epochs', type=float, default=2,
                    help='number of warmup epochs')
parser.add_argument('--momentum', type=float, default=0.9,
                    help='SGD momentum')
parser.add_argument('--wd', type=float, default=0.00005,
                    help='weight decay')

parser.add_argument('--no-cuda', action='store_true', default=False,
                    help='disables CUDA training')
parser.add_argument('--seed', type=int, default=42,
                    help='random seed')


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with batch norm, and the shortcut."""

    def __init__(self, inplanes, planes, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + identity)


class DigitsResNet(nn.Module):
    """A small ResNet for 1 x 8 x 8 images: a stem, two stages of basic blocks (8 x 8 with
    16 channels, 4 x 4 with 32), global average pooling and a linear classifier."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(16), nn.ReLU())
        self.layer1 = BasicBlock(16, 16)
        self.layer2 = BasicBlock(16, 32, stride=2)
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def digits_datasets():
    """(train, validation) TensorDatasets of 1 x 8 x 8 images and labels: every fifth image
    is a validation image; pixels normalized with the training images' mean and std."""
    images, labels = load_digits(return_X_y=True)
    val_rows = torch.from_numpy(np.arange(len(labels)) % 5 == 0)
    x = torch.tensor(images / 16.0, dtype=torch.float32).view(-1, 1, 8, 8)
    y = torch.tensor(labels)
    mean, std = x[~val_rows].mean(), x[~val_rows].std()
    x = (x - mean) / std
    return (torch.utils.data.TensorDataset(x[~val_rows], y[~val_rows]),
            torch.utils.data.TensorDataset(x[val_rows], y[val_rows]))


def train(state):
    model.train()
    epoch = state.epoch
    train_loss = Metric('train_loss')
    train_accuracy = Metric('train_accuracy')

    batch_offset = state.batch
    for idx, (data, target) in enumerate(train_loader):
        # Elastic Horovod: update the current batch index this epoch
        # and commit / check for host updates. Do not check hosts when
        # we commit as it would be redundant.
        state.batch = batch_idx = batch_offset + idx
        if args.batches_per_commit > 0 and \
                state.batch % args.batches_per_commit == 0:
            state.commit()
        elif args.batches_per_host_check > 0 and \
                state.batch % args.batches_per_host_check == 0:
            state.check_host_updates()

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

        # Elastic Horovod: record which samples were processed this batch
        # so we do not reprocess them if a reset event occurs
        state.train_sampler.record_batch(idx, allreduce_batch_size)

        # Gradient is applied across all ranks
        optimizer.step()

    # an epoch resumed after its last batch (the job grew at the commit below) has none here
    if verbose and train_loss.n > 0:
        print(f'Train Epoch #{epoch + 1}: size {hvd.size()}, loss {train_loss.avg.item():.4f}, '
              f'accuracy {100. * train_accuracy.avg.item():.2f}%', flush=True)

    state.commit()


def validate(epoch):
    model.eval()
    val_loss = Metric('val_loss')
    val_accuracy = Metric('val_accuracy')

    with torch.no_grad():
        for data, target in val_loader:
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            output = model(data)

            val_loss.update(F.cross_entropy(output, target))
            val_accuracy.update(accuracy(output, target))

    if verbose:
        print(f'Validate Epoch #{epoch + 1}: loss {val_loss.avg.item():.4f}, '
              f'Accuracy: {100. * val_accuracy.avg.item():.2f}%', flush=True)


# Horovod: using `lr = base_lr * hvd.size()` from the very beginning leads to worse final
# accuracy. Scale the learning rate `lr = base_lr` ---> `lr = base_lr * hvd.size()` during
# the first epochs (--warmup-epochs). See https://arxiv.org/abs/1706.02677 for details.
# After the warmup reduce learning rate by 10 at a third, two thirds and eight ninths of
# the epochs (Horovod's 30th, 60th and 80th of 90).
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
        param_group['lr'] = args.base_lr * hvd.size() * args.batches_per_allreduce * lr_adj


def accuracy(output, target):
    # get the index of the max log-probability
    pred = output.max(1, keepdim=True)[1]
    return pred.eq(target.view_as(pred)).cpu().float().mean()


def end_epoch(state):
    state.epoch += 1
    state.batch = 0
    state.train_sampler.set_epoch(state.epoch)
    state.commit()


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


@hvd.elastic.run
def full_train(state):
    while state.epoch < args.epochs:
        train(state)
        validate(state.epoch)
        end_epoch(state)


def on_state_reset():
    # Elastic Horovod: the job has another number of ranks now; set the learning rate for
    # it before the next batch
    adjust_learning_rate(state.epoch, state.batch)


if __name__ == '__main__':
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

    # Horovod: print logs on the first worker.
    verbose = 1 if hvd.rank() == 0 else 0

    # Horovod: limit # of CPU threads to be used per worker (one: the network is small).
    torch.set_num_threads(1)

    kwargs = {'num_workers': 4, 'pin_memory': True} if args.cuda else {}
    # When supported, use 'forkserver' to spawn dataloader workers instead of 'fork' to prevent
    # issues with Infiniband implementations that are not fork-safe
    if (kwargs.get('num_workers', 0) > 0 and hasattr(mp, '_supports_context') and
            mp._supports_context and 'forkserver' in mp.get_all_start_methods()):
        kwargs['multiprocessing_context'] = 'forkserver'

    train_dataset, val_dataset = digits_datasets()
    # Elastic Horovod: use ElasticSampler to partition data among workers.
    train_sampler = hvd.elastic.ElasticSampler(train_dataset)
    train_loader = torch.utils.data.DataLoader(
        train_dataset,
        batch_size=allreduce_batch_size,
        sampler=train_sampler,
        **kwargs)

    val_sampler = hvd.elastic.ElasticSampler(val_dataset)
    val_loader = torch.utils.data.DataLoader(
        val_dataset,
        batch_size=args.val_batch_size,
        sampler=val_sampler,
        **kwargs)

    # Set up the small ResNet.
    model = DigitsResNet()

    # By default, Adasum doesn't need scaling up learning rate.
    # For sum/average with gradient Accumulation: scale learning rate by batches_per_allreduce
    lr_scaler = args.batches_per_allreduce * hvd.size() if not args.use_adasum else 1

    if args.cuda:
        # Move model to GPU.
        model.cuda()
        # If using GPU Adasum allreduce, scale learning rate by local_size.
        if args.use_adasum and hvd.nccl_built():
            lr_scaler = args.batches_per_allreduce * hvd.local_size()

    # Horovod: scale learning rate by the number of GPUs.
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

    state = hvd.elastic.TorchState(model=model,
                                   optimizer=optimizer,
                                   train_sampler=train_sampler,
                                   val_sampler=val_sampler,
                                   epoch=0,
                                   batch=0)
    state.register_reset_callbacks([on_state_reset])

    full_train(state)
