"""An elastic Horovod PyTorch throughput benchmark, as Horovod's elastic synthetic benchmark.

It has the shape of Horovod's ``pytorch_synthetic_benchmark_elastic.py``: the synthetic
benchmark (``pytorch_synthetic_benchmark.py`` here) with its warm-up and timed iterations
inside an ``@hvd.elastic.run`` function. A ``TorchState`` holds the model, the optimizer,
the images per second measured so far, the next iteration and whether the warm-up is done;
it is committed every ``--num-batches-per-commit`` batches and after the warm-up and each
iteration, and a reset callback rescales the learning rate for the new number of ranks.
When a rank is lost, the launcher starts the job again and the benchmark goes on from the
last commit: an iteration reported before is not run again. Besides the import line, the
models and the CPU threads (as in the non-elastic script), one thing differs from Horovod's
script: its state records the iteration just finished, so a restart there repeats it; here
it records the next one.

    .venv/bin/spark-estimator-run -np 2 --master "local[2]" \
        examples/horovod/pytorch_synthetic_benchmark_elastic.py

or alone, as one process:
``.venv/bin/python examples/horovod/pytorch_synthetic_benchmark_elastic.py``.
"""

import argparse
import timeit

import numpy as np
import torch
import torch.backends.cudnn as cudnn
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import spark_estimator.horovod as hvd

IMAGE_SHAPE = (3, 32, 32)  # the random images
CLASSES = 10


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
    """A ResNet of 8 layers: a 3x3 stem, three basic blocks (16, 32, 64 channels; the last
    two halve the resolution), global average pooling and a linear classifier."""
    return nn.Sequential(
        nn.Conv2d(IMAGE_SHAPE[0], 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        BasicBlock(16, 16, 1), BasicBlock(16, 32, 2), BasicBlock(32, 64, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, CLASSES))


def mlp():
    """Two hidden layers of 512 on the flattened image: little compute per parameter, so the
    gradient allreduce weighs more."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(int(np.prod(IMAGE_SHAPE)), 512), nn.ReLU(),
        nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, CLASSES))


MODELS = {"resnet8": resnet8, "mlp": mlp}


# Benchmark settings
parser = argparse.ArgumentParser(description="PyTorch Synthetic Benchmark",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="use fp16 compression during allreduce")

parser.add_argument("--model", type=str, default="resnet8", choices=sorted(MODELS),
                    help="model to benchmark")
parser.add_argument("--batch-size", type=int, default=32,
                    help="input batch size")

parser.add_argument("--num-warmup-batches", type=int, default=10,
                    help="number of warm-up batches that don't count towards benchmark")
parser.add_argument("--num-batches-per-iter", type=int, default=10,
                    help="number of batches per benchmark iteration")
parser.add_argument("--num-iters", type=int, default=10,
                    help="number of benchmark iterations")
parser.add_argument("--num-batches-per-commit", type=int, default=1,
                    help="number of batches per commit of the elastic state object")

parser.add_argument("--no-cuda", action="store_true", default=False,
                    help="disables CUDA training")

parser.add_argument("--use-adasum", action="store_true", default=False,
                    help="use adasum algorithm to do reduction")

args = parser.parse_args()
args.cuda = not args.no_cuda and torch.cuda.is_available()

hvd.init()

if args.cuda:
    # Horovod: pin GPU to local rank.
    torch.cuda.set_device(hvd.local_rank())

cudnn.benchmark = True

# Horovod: limit # of CPU threads to be used per worker (as its MNIST script does).
torch.set_num_threads(1)

# Set up the model.
model = MODELS[args.model]()


def lr_scaler():
    """What the learning rate is multiplied by for the current number of ranks (Adasum
    does not need it scaled up; Horovod scales by local_size for its hierarchical GPU
    Adasum)."""
    if args.use_adasum:
        return hvd.local_size() if args.cuda and hvd.nccl_built() else 1
    return hvd.size()


if args.cuda:
    # Move model to GPU.
    model.cuda()

lr = 0.01
optimizer = optim.SGD(model.parameters(), lr=lr * lr_scaler())

# Horovod: (optional) compression algorithm.
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

# Horovod: wrap optimizer with DistributedOptimizer.
optimizer = hvd.DistributedOptimizer(optimizer,
                                     named_parameters=model.named_parameters(),
                                     compression=compression,
                                     op=hvd.Adasum if args.use_adasum else hvd.Average)

# One fixed batch of random images and labels, trained on at every step.
data = torch.randn(args.batch_size, *IMAGE_SHAPE)
target = torch.randint(CLASSES, (args.batch_size,))
if args.cuda:
    data, target = data.cuda(), target.cuda()


def benchmark_step(state):
    optimizer.zero_grad()
    output = model(data)
    loss = F.cross_entropy(output, target)
    loss.backward()
    optimizer.step()

    state.batch += 1
    if state.batch == args.num_batches_per_commit:
        state.batch = 0
        state.commit()


def log(s, nl=True):
    if hvd.rank() != 0:
        return
    print(s, end="\n" if nl else "")


log(f"Model: {args.model}")
log(f"Batch size: {args.batch_size}")
device = "GPU" if args.cuda else "CPU"
log(f"Number of {device}s: {hvd.size()}")


@hvd.elastic.run
def run_benchmark(state):
    # Warm-up
    if not state.warm:
        log("Running warmup...")
        timeit.timeit(lambda: benchmark_step(state), number=args.num_warmup_batches)
        state.warm = True
        state.commit()

    # Benchmark
    if state.iter == 0:
        log("Running benchmark...")
    for x in range(state.iter, args.num_iters):
        time = timeit.timeit(lambda: benchmark_step(state), number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / time
        log(f"Iter #{x}: {img_sec:.1f} img/sec per {device}")
        state.img_secs.append(img_sec)
        state.iter = x + 1
        state.commit()


def on_state_reset():
    # the number of ranks may have changed: rescale the learning rate
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr * lr_scaler()


state = hvd.elastic.TorchState(model, optimizer, img_secs=[], iter=0, batch=0, warm=False)
state.register_reset_callbacks([on_state_reset])
run_benchmark(state)

# Results
img_sec_mean = np.mean(state.img_secs)
img_sec_conf = 1.96 * np.std(state.img_secs)
log(f"Img/sec per {device}: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
log(f"Total img/sec on {hvd.size()} {device}(s): "
    f"{hvd.size() * img_sec_mean:.1f} +-{hvd.size() * img_sec_conf:.1f}")
