"""hvd.start_timeline / stop_timeline in a one-rank task: a Chrome trace of the collectives."""

import json

import pytest
import torch

import spark_estimator.horovod as hvd


def test_a_timeline_records_each_collective_with_its_name_and_duration(one_rank, tmp_path):
    hvd.init()
    hvd.allreduce(torch.ones(3), name="before")  # not recorded: no timeline yet
    path = tmp_path / "timeline.json"
    hvd.start_timeline(str(path))
    hvd.allreduce(torch.ones(3), name="loss")
    hvd.broadcast(torch.ones(2), 0, name="weights")
    hvd.allgather_object({"a": 1})
    hvd.stop_timeline()
    hvd.allreduce(torch.ones(3), name="after")  # nor after it
    events = json.loads(path.read_text())["traceEvents"]
    names = [e["name"] for e in events]
    assert names[:4] == [
        "allreduce (in flight) loss",
        "allreduce loss",
        "broadcast weights",
        "allgather_object",
    ]
    assert len(names) == 4  # (a DistributedOptimizer's reductions are "in flight" ones)
    assert not any("before" in n or "after" in n for n in names)
    assert all(e["ph"] == "X" and e["dur"] >= 0 and e["pid"] == 0 for e in events)
    ordered = [e["ts"] for e in events if not e["name"].startswith("allreduce (in flight)")]
    assert ordered == sorted(ordered)


def test_what_a_timeline_cannot_do_is_refused(one_rank, tmp_path):
    hvd.init()
    with pytest.raises(ValueError, match="mark_cycles: spark_estimator.horovod has no"):
        hvd.start_timeline(str(tmp_path / "t.json"), mark_cycles=True)
    with pytest.raises(ValueError, match="file_path: folder .* does not exist"):
        hvd.start_timeline(str(tmp_path / "nowhere" / "t.json"))
