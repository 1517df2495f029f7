"""An elastic Horovod PyTorch training script, as Horovod's PyTorch guide shapes them.

It follows the elastic PyTorch example of Horovod's guide: initialise, pin the GPU, scale
the learning rate by the number of workers, wrap the optimizer, then train inside an
``@hvd.elastic.run`` function whose state (model, optimizer, epoch and batch) is committed
every few batches; a reset callback rescales the learning rate. As in the guide, each
worker draws random batches. Two things differ from a Horovod user's script: the import
line (``spark_estimator.horovod`` for ``horovod.torch``) and the data (scikit-learn's
bundled 8x8 digits; the network is sized for them).

When a rank's process or executor is lost, the launcher starts the job again and every
rank continues from the last commit:

    .venv/bin/spark-estimator-run -np 2 --master "local[2]" \
        examples/horovod/pytorch_digits_elastic.py

or alone, as one process: ``.venv/bin/python examples/horovod/pytorch_digits_elastic.py``.
"""

import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from sklearn.datasets import load_digits

import spark_estimator.horovod as hvd

parser = argparse.ArgumentParser(description="Elastic PyTorch digits example")
parser.add_argument("--batch-size", type=int, default=64, metavar="N",
                    help="input batch size for training (default: 64)")
parser.add_argument("--epochs", type=int, default=10, metavar="N",
                    help="number of epochs to train (default: 10)")
parser.add_argument("--batches-per-commit", type=int, default=4, metavar="N",
                    help="number of batches between commits of the state (default: 4)")
parser.add_argument("--lr", type=float, default=0.01, metavar="LR",
                    help="learning rate for a single worker (default: 0.01)")
parser.add_argument("--momentum", type=float, default=0.5, metavar="M",
                    help="SGD momentum (default: 0.5)")
parser.add_argument("--no-cuda", action="store_true", default=False,
                    help="disables CUDA training")
parser.add_argument("--seed", type=int, default=42, metavar="S",
                    help="random seed (default: 42)")
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="use fp16 compression during allreduce")
parser.add_argument("--use-adasum", action="store_true", default=False,
                    help="use adasum algorithm to do reduction")

args = parser.parse_args()
args.cuda = not args.no_cuda and torch.cuda.is_available()


class Net(nn.Module):
    """Two convolutions with max-pooling, dropout, two linear layers: for 8x8 images."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=3, padding=1)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(80, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))  # 10 x 4 x 4
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))  # 20 x 2 x 2
        x = x.view(-1, 80)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def digits():
    """(train images, train labels, test images, test labels): every fifth image is a
    test image. Pixels scaled to [0, 1] and normalized with the training images' mean and
    standard deviation."""
    images, labels = load_digits(return_X_y=True)
    test_rows = torch.from_numpy(np.arange(len(labels)) % 5 == 0)
    x = torch.tensor(images / 16.0, dtype=torch.float32).view(-1, 1, 8, 8)
    y = torch.tensor(labels)
    mean, std = x[~test_rows].mean(), x[~test_rows].std()
    x = (x - mean) / std
    return x[~test_rows], y[~test_rows], x[test_rows], y[test_rows]


hvd.init()
torch.manual_seed(args.seed)

if args.cuda:
    torch.cuda.set_device(hvd.local_rank())

x_train, y_train, x_test, y_test = digits()
device = torch.device("cuda" if args.cuda else "cpu")
x_train, y_train = x_train.to(device), y_train.to(device)
x_test, y_test = x_test.to(device), y_test.to(device)
# each worker draws its own random batches
generator = torch.Generator(device=device).manual_seed(args.seed + hvd.rank())


def get_random_batch():
    rows = torch.randint(len(y_train), (args.batch_size,), generator=generator, device=device)
    return x_train[rows], y_train[rows]


def batches_per_epoch():
    return len(y_train) // (args.batch_size * hvd.size())


model = Net().to(device)

lr_scaler = hvd.size() if not args.use_adasum else 1
optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer,
                                     named_parameters=model.named_parameters(),
                                     compression=compression,
                                     op=hvd.Adasum if args.use_adasum else hvd.Average)


def test(epoch):
    model.eval()
    with torch.no_grad():
        output = model(x_test)
        test_loss = F.nll_loss(output, y_test).item()
        accuracy = output.argmax(dim=1).eq(y_test).float().mean().item()
    model.train()
    if hvd.rank() == 0:
        print(f"Epoch {epoch}: test loss {test_loss:.4f}, Accuracy: {100. * accuracy:.2f}%")


@hvd.elastic.run
def train(state):
    for state.epoch in range(state.epoch, args.epochs):  # noqa: B020 (as Horovod's guide)
        for state.batch in range(state.batch, batches_per_epoch()):  # noqa: B020
            data, target = get_random_batch()

            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            optimizer.step()

            if state.batch % args.batches_per_commit == 0:
                state.commit()
        state.batch = 0
        test(state.epoch + 1)


def on_state_reset():
    # adjust learning rate on reset
    for param_group in optimizer.param_groups:
        param_group["lr"] = args.lr * (hvd.size() if not args.use_adasum else 1)


state = hvd.elastic.TorchState(model, optimizer, batch=0, epoch=0)
state.register_reset_callbacks([on_state_reset])
train(state)
