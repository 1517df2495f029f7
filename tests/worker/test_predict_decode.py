"""transform's decoders kept per Python worker (``decoder_for``): held while a task uses
them, however long it decodes, and closed once idle and unheld, or once a task did not
finish with them."""

import time

import pyarrow as pa
import pytest
import torch

from spark_estimator.shared.serialization import dumps, pack_functions
from spark_estimator.shared.spec import ColumnSpec, DecodeSpec
from spark_estimator.worker import predict, predict_decode
from tests.processes import decode_workers

FEATURES = [ColumnSpec("text", "string", "float32")]
IDLE_S = 0.3  # the kept decoders' idle time in these tests


@pytest.fixture(autouse=True)
def short_idle(monkeypatch):
    monkeypatch.setattr(predict_decode, "IDLE_S", IDLE_S)


@pytest.fixture
def used(monkeypatch) -> list:
    """The decoders ``predict_batches`` is given, in order."""
    made = []

    def decoder_for(*args):
        made.append(predict_decode.decoder_for(*args))
        return made[-1]

    monkeypatch.setattr(predict, "decoder_for", decoder_for)
    return made


class Texts(torch.nn.Module):
    def forward(self, text, mask):  # a decoded 1-d column is a padded sequence
        return text


def slow(row, augment):
    """A decode_fn taking longer over a task's rows than a kept decoder may stay idle."""
    time.sleep(0.1)
    return {"text": torch.full((2,), float(len(row["text"])))}


def picky(row, augment):
    if row["text"] == "bad":
        raise OSError("a read error")
    return {"text": torch.ones(2)}


def transform(texts: list[list[str]], decode_fn, pool="threads", workers=2):
    """``predict_batches`` of one Arrow batch of each of ``texts``: its outputs, as read."""
    functions = pack_functions(decode_fn=decode_fn)
    decode = DecodeSpec(functions=functions, pool=pool, workers=workers)
    batches = [pa.RecordBatch.from_arrays([pa.array(t)], ["text"]) for t in texts]
    model = dumps(Texts(), "model")
    return predict.predict_batches(
        iter(batches), model, FEATURES, None, ["prediction"], [False], decode=decode
    )


def rows(out) -> list:
    return [row for batch in out for row in batch.column("prediction").to_pylist()]


def kept(decoder) -> bool:
    return any(k.decoder is decoder for k in predict_decode._kept)


def reaped(decoder) -> bool:
    """Whether ``decoder`` is closed and dropped within a few idle times."""
    deadline = time.monotonic() + 20 * IDLE_S
    while kept(decoder) and time.monotonic() < deadline:
        time.sleep(IDLE_S / 4)
    return not kept(decoder)


@pytest.mark.parametrize("pool, workers", [("threads", 2), ("processes", 1)])
def test_a_task_decoding_longer_than_the_idle_time_keeps_its_decoder(pool, workers, used):
    before = set(decode_workers())
    out = rows(transform([["ab", "c", "def"]] * 3, slow, pool, workers))
    assert out == [[2.0, 2.0], [1.0, 1.0], [3.0, 3.0]] * 3  # 0.9 s of decoding in all
    (decoder,) = used
    assert decoder.kind == pool and reaped(decoder)  # once the task let it go
    if pool == "threads":
        with pytest.raises(RuntimeError, match="after shutdown"):
            decoder.threads.submit(print)
    deadline = time.monotonic() + 10
    while set(decode_workers()) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not set(decode_workers()) - before


def test_a_decoder_is_closed_only_when_its_last_user_lets_it_go():
    spec = DecodeSpec(functions=pack_functions(decode_fn=slow), pool="threads", workers=1)
    first = predict_decode.decoder_for(spec, FEATURES, None, [], "task 1", False)
    second = predict_decode.decoder_for(spec, FEATURES, None, [], "task 2", False)
    assert second is first
    predict_decode.release(first, True)
    time.sleep(3 * IDLE_S)
    assert kept(first)  # task 2 still holds it
    predict_decode.release(second, True)
    assert reaped(first)
    third = predict_decode.decoder_for(spec, FEATURES, None, [], "task 3", False)
    predict_decode.release(third, True)
    assert third is not first


def test_a_task_that_fails_or_stops_early_leaves_the_next_a_fresh_decoder(used):
    with pytest.raises(
        ValueError, match=r"row 0 of the batch could not be decoded from column .text. \(OSError"
    ):
        rows(transform([["bad", "b"]], picky))  # its decoder closed by the error
    stopped = transform([["a"], ["b"]], picky)
    next(stopped)
    stopped.close()  # its decoder left mid-pass
    assert rows(transform([["a", "b"]], picky)) == [[1.0, 1.0]] * 2
    failed, left, fresh = used
    assert failed is not fresh and left is not fresh and kept(fresh)
    assert reaped(failed) and reaped(left)
