"""Executor: ``hvd.elastic.ElasticSampler``, a sampler whose epoch survives a resize.

Like ``DistributedSampler``, each rank takes every size()-th index of the epoch's order
(shuffled by ``seed + epoch``, the same on every rank), the last ones repeated so all ranks
take as many. It also counts the samples the ranks have processed this epoch
(``record_batch`` after each batch: every rank processes one batch, so ``batch_size x
size()`` more); a ``TorchState`` holding it commits that count with the rest, and after a
reset (a job started again with another number of ranks) the epoch's remaining indices are
cut over the new ranks, so none is repeated or skipped. ``set_epoch`` at the end of an
epoch starts the next one's order and count, as Horovod's.
"""

from __future__ import annotations

import math
import random

import torch.utils.data

from .basics import rank, size


class ElasticSampler(torch.utils.data.Sampler):
    """Horovod's ``ElasticSampler(dataset, shuffle=True, seed=0)``."""

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: its order, nothing processed yet (call it at the end of
        an epoch, so that an epoch cut short is not processed again)."""
        self.epoch, self.processed_num = epoch, 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """One more batch of ``batch_size`` processed on every rank."""
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices) -> None:
        """A batch of ``indices`` (this rank's, in the order drawn) processed on every rank."""
        self.processed_num += len(indices) * self.num_replicas

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.processed_num = state["epoch"], state["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Cut the epoch's indices not processed yet over the ranks there are now."""
        self.num_replicas, self.rank = size(), rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num :]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        indices = self.remaining_indices[:]
        while indices and len(indices) < self.total_size:  # repeat to fill every rank
            indices += indices[: self.total_size - len(indices)]
        return iter(indices[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples
