"""hvd.elastic.ElasticSampler: the epoch's indices cut over the ranks there are, before and
after a resize, and kept by a TorchState (ranks simulated by giving the sampler the size
and rank a launch of that size would have)."""

import pytest
import torch

import spark_estimator.horovod as hvd
from spark_estimator.horovod import elastic, elastic_sampler


def on_ranks(monkeypatch, world: int, rank: int) -> None:
    monkeypatch.setattr(elastic_sampler, "size", lambda: world)
    monkeypatch.setattr(elastic_sampler, "rank", lambda: rank)


def samplers(monkeypatch, world: int, state: dict | None = None, data=range(10)):
    made = []
    for r in range(world):
        on_ranks(monkeypatch, world, r)
        sampler = hvd.elastic.ElasticSampler(list(data), shuffle=True, seed=3)
        if state is not None:
            sampler.load_state_dict(state)
        made.append(sampler)
    return made


def test_every_index_of_an_epoch_once_across_a_resize_from_3_to_2_ranks(monkeypatch):
    three = samplers(monkeypatch, 3)
    epoch = [list(s) for s in three]
    order = [i for batch in zip(*epoch) for i in batch]  # the epoch's order, strided
    assert sorted(set(order)) == list(range(10)) and len(order) == 12  # 2 repeated to fill
    # two batches of one on each of 3 ranks, then a rank is lost
    done = [epoch[r][:2] for r in range(3)]
    for sampler in three:
        sampler.record_batch(0, 1)
        sampler.record_batch(1, 1)
    saved = three[0].state_dict()
    assert saved == {"epoch": 0, "processed_num": 6}
    two = samplers(monkeypatch, 2, saved)  # the job started again on 2 ranks
    rest = [list(s) for s in two]
    assert len(rest[0]) == len(rest[1]) == 2
    seen = [i for part in done for i in part] + [i for part in rest for i in part]
    assert sorted(seen) == list(range(10))  # none repeated, none skipped
    two[0].set_epoch(1)  # the next epoch: another order, nothing processed
    assert two[0].processed_num == 0 and len(two[0]) == 5


def test_a_torch_state_commits_and_restores_its_sampler_in_place(one_rank, monkeypatch):
    hvd.init()
    sampler = hvd.elastic.ElasticSampler(list(range(8)), shuffle=False)
    model = torch.nn.Linear(1, 1)
    state = elastic.TorchState(model, None, train_sampler=sampler, epoch=0)
    sampler.record_batch(0, 2)
    state.commit()
    sampler.record_batch(1, 2)
    assert list(sampler) == list(range(8))  # iteration follows reset(), not the counter
    state.restore()
    assert state.train_sampler is sampler and sampler.processed_num == 2
    assert list(sampler) == list(range(2, 8))  # restored: reset to what is left
    assert state.state_dict()["attributes"]["train_sampler"] == {"epoch": 0, "processed_num": 2}
    state.sync()
    assert state.train_sampler is sampler and sampler.processed_num == 2


@pytest.mark.parametrize("indices", [[0, 1], [5, 6]])
def test_record_indices_counts_a_batch_as_record_batch_does(monkeypatch, indices):
    on_ranks(monkeypatch, 2, 0)
    sampler = hvd.elastic.ElasticSampler(list(range(6)))
    sampler.record_indices(indices)
    assert sampler.processed_num == 4
