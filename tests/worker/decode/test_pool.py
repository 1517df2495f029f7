"""Decoding in worker processes (real processes, real shared memory, real PNG bytes and
Parquet): the same batches, bit for bit, as threads and whatever the number of workers;
errors and output as they are; a worker that dies is named within seconds; no process is
left behind; small shared memory."""

import collections
import gc
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

from spark_estimator.decoding import random_crop, random_flip
from spark_estimator.shared.serialization import pack_functions
from spark_estimator.shared.spec import DecodeSpec
from spark_estimator.worker.data.arrow_reader import ROW_ID
from spark_estimator.worker.data.loader import first_rows, open_loader
from spark_estimator.worker.data.shards import StepPlan
from spark_estimator.worker.decode import decoder as decoder_module
from spark_estimator.worker.decode import pool as pool_module
from spark_estimator.worker.decode import shared_memory, shared_rows
from spark_estimator.worker.decode.channel import Channel
from spark_estimator.worker.decode.decoded import BadRow
from spark_estimator.worker.decode.decoder import Decoder
from spark_estimator.worker.decode.pool import (
    GROUP_ROWS,
    IN_FLIGHT,
    VIEWED,
    DecodeTimeout,
    slots_per_worker,
)
from spark_estimator.worker.decode.processes import DecodeWorkerDied
from tests.processes import decode_workers
from tests.worker.data.test_loader import train_spec
from tests.worker.decode.test_decoder import ROWS, augmented, image_dataset, png

pytest.importorskip("PIL.Image", reason="needs Pillow (the vision extra)")


def decoder(
    spec, pool, workers, decode_fn=augmented, batch_rows=4, rank_device=None, **options
) -> Decoder:
    """A rank's decoder (``options``: the DecodeSpec's; ``rank_device``: the rank's)."""
    functions = pack_functions(decode_fn=decode_fn, **options.pop("functions", {}))
    decode = DecodeSpec(functions=functions, pool=pool, workers=workers, **options)
    data = spec.data
    out = Decoder(
        decode,
        data.columns,
        {"y"},
        spec.seed,
        data.row_names,
        device=rank_device,
        batch_rows=batch_rows,
    )
    out.prime(first_rows(spec, "train"))
    return out


def decode_pass(spec, decoding: Decoder, epoch=3, batch=5, share=False, counted=True):
    """Every batch of one shuffled pass, decoded ahead: [(ids, decoded, kept)]; with
    ``share``, the chunks handed to the decoder's ``share`` as a fit's loader does; without
    ``counted``, through an iterator that does not say how many are left (as a fit's
    training steps)."""
    loader = open_loader(spec, "train", 1, 0, pin=False, share=decoding.share if share else None)
    chunks = loader.batches(StepPlan(ROWS, 1, 0, batch).batch_sizes, 2)
    if not counted:
        chunks = uncounted(chunks)
    return [(c[ROW_ID].tolist(), d, k) for c, (d, k) in decoding.ahead(chunks, epoch)]


def uncounted(chunks):
    """``chunks`` without saying how many are left (a fit's training steps): a message
    holds ``group`` batches to the pass's end."""
    yield from chunks


def same(a, b) -> None:
    assert len(a) == len(b)
    for (ids_a, da, ka), (ids_b, db, kb) in zip(a, b):
        assert ids_a == ids_b
        assert (ka is None and kb is None) or ka.tolist() == kb.tolist()
        assert list(da.columns) == list(db.columns) and list(da.masks) == list(db.masks)
        for name in da.columns:
            x, y = da.columns[name], db.columns[name]
            if isinstance(x, torch.Tensor):
                assert x.dtype == y.dtype and torch.equal(x, y), name
            else:
                assert x == y, name
        for name in da.masks:
            assert torch.equal(da.masks[name], db.masks[name])


@pytest.fixture
def no_leftovers():
    """The test's decode worker processes are all gone at its end."""
    before = _workers()
    yield
    deadline = time.monotonic() + 10
    while _workers() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _workers() - before


def _workers() -> set[int]:
    """This test process's decode worker processes (not another pytest worker's)."""
    return set(decode_workers())


def test_processes_decode_every_batch_as_threads_do_bit_for_bit(
    tmp_path, store, no_leftovers, monkeypatch
):
    data = image_dataset(tmp_path, images={6: b"not an image"})
    spec = train_spec(data, store, shuffle=True, shuffle_buffer_size=7)
    monkeypatch.setattr(shared_rows, "SHARE_FROM", 1)  # these small PNGs shared too
    results = {}
    runs = [("threads", 1), ("threads", 3), ("processes", 1), ("processes", 2)]
    for pool, workers, share in [(p, w, False) for p, w in runs] + [("processes", 2, True)]:
        decoding = decoder(spec, pool, workers, bad_rows="skip", padding_value=9.0)
        assert decoding.kind == pool and decoding.workers == workers
        try:
            results[pool, workers, share] = (
                decode_pass(spec, decoding, share=share),
                decode_pass(spec, decoding, epoch=None, share=share),  # validation
                decoding.skipped_rows,
                decoding.padding,
            )
            if share:  # the rows were read into shared chunk segments and read there
                assert next(decoding.processes.shared.keys) > 0
            summary = decoding.summary()
        finally:
            decoding.close()
        assert summary["pool"] == pool and summary["workers"] == workers
        if pool == "processes":
            for memory in ("uss", "pss", "rss"):
                found = summary[f"worker_{memory}_bytes"]
                assert len(found) == workers and all(b > 2**20 for b in found), memory
            # what a worker holds of its own is less than what it shares with its server
            pairs = zip(summary["worker_uss_bytes"], summary["worker_rss_bytes"])
            assert all(uss < rss / 2 for uss, rss in pairs)
            assert len(summary["worker_start_seconds"]) == workers
    reference = results["threads", 1, False]
    assert reference[2] == {(False, 6), (True, 6)} and reference[3][0] > 0
    assert any(k is not None for _, _, k in reference[0])  # the bad row was left out
    for key, (train, validation, skipped, padding) in results.items():
        same(train, reference[0])
        same(validation, reference[1])
        assert (skipped, padding) == (reference[2], reference[3]), key


def test_small_batches_travel_several_a_message_each_decoded_as_alone(
    tmp_path, store, no_leftovers, monkeypatch
):
    spec = train_spec(image_dataset(tmp_path), store, shuffle=True, shuffle_buffer_size=7)
    sent, answered = collections.Counter(), collections.Counter()  # batches a message: count
    send, arrived = Channel.send, pool_module.DecodePool._arrived

    def sending(self, message, fds=()):
        if message[0] == "decode":
            sent[len(message[1])] += 1
        return send(self, message, fds)

    def arriving(self, worker, outcomes, fds):
        answered[len(outcomes)] += 1
        return arrived(self, worker, outcomes, fds)

    monkeypatch.setattr(Channel, "send", sending)
    monkeypatch.setattr(pool_module.DecodePool, "_arrived", arriving)
    passes = {}
    for group in (1, 3):
        decoding = decoder(spec, "processes", 2, batch_rows=GROUP_ROWS // group)
        try:
            assert decoding.processes.group == group
            for counted in (False, True):
                sent.clear()
                answered.clear()
                # 12 batches (11 of 2 rows, 1 of 1)
                passes[group, counted] = decode_pass(spec, decoding, batch=2, counted=counted)
                if not counted or group == 1:
                    assert sent == answered == {group: 12 // group}, (group, counted)
                else:  # a pass that says how many are left: its last ones spread out
                    assert sent == answered == {3: 3, 1: 3}
        finally:
            decoding.close()
    for found in passes.values():
        same(found, passes[1, False])


def test_decode_batch_fn_gets_each_rows_generator_and_decodes_as_decode_fn_in_any_pool(
    tmp_path, store, no_leftovers
):
    spec = train_spec(image_dataset(tmp_path), store, shuffle=True, shuffle_buffer_size=7)

    def batch_of_rows(rows, augments):  # the per-row decode_fn over the batch
        count = len(rows["img"])
        decoded = [
            augmented({n: rows[n][i] for n in rows}, None if augments is None else augments[i])
            for i in range(count)
        ]
        return {name: [d[name] for d in decoded] for name in rows}

    per_row = decoder(spec, "threads", 1)
    try:
        reference = decode_pass(spec, per_row)
    finally:
        per_row.close()
    for pool in ("threads", "processes"):
        functions = {"decode_batch_fn": batch_of_rows}
        batched = decoder(spec, pool, 2, decode_fn=None, functions=functions)
        try:
            same(decode_pass(spec, batched), reference)
            assert batched.padding == per_row.padding
        finally:
            batched.close()


def test_the_init_fn_runs_once_in_each_worker_and_shares_the_decode_fns_globals(
    tmp_path, store, capfd, no_leftovers
):
    spec = train_spec(image_dataset(tmp_path), store, shuffle=False)
    marks = tmp_path / "marks"
    marks.mkdir()
    state = {}

    def init():
        state["pid"] = os.getpid()
        (marks / str(os.getpid())).write_text("")
        print("init ran", flush=True)

    def decode(row, augment):
        out = augmented(row, augment)
        print(f"decoded row {int(row['tokens'][0])} in {state['pid']}")
        return {**out, "img": out["img"] * 0 + state["pid"] % 7}

    decoding = decoder(spec, "processes", 2, decode_fn=decode, functions={"decode_init_fn": init})
    try:
        batches = decode_pass(spec, decoding, batch=4)
        pids = {int(p.name) for p in marks.iterdir()}
        workers = decoding.processes.processes.workers.values()
        assert pids == {w.pid for w in workers}  # once in each, not here nor in the server
        for _, decoded, _ in batches:
            assert {int(v) for v in decoded["img"].flatten().unique()} <= {p % 7 for p in pids}
    finally:
        decoding.close()
    out = capfd.readouterr().out
    assert out.count("init ran") == 2  # in each worker, not in the rank
    assert f"in {os.getpid()}" not in out
    assert any(f"in {pid}" in out for pid in pids)


def test_a_bad_row_and_an_error_of_the_user_are_raised_as_threads_raise_them(
    tmp_path, store, caplog, capfd, no_leftovers
):
    data = image_dataset(tmp_path, images={2: b"not an image"}, row_group_size=10)
    spec = train_spec(data, store, shuffle=False)
    rows = first_rows(spec, "train", 5)
    messages = []
    for pool in ("threads", "processes"):
        decoding = decoder(spec, pool, 2)
        try:
            with pytest.raises(BadRow) as info:
                decoding(rows, None)
            messages.append(re.sub(r"0x[0-9a-f]+", "0x..", str(info.value)))
        finally:
            decoding.close()
    assert messages[0] == messages[1]
    assert messages[1].startswith("decode_fn: row 2 of the split (path file:/data/2.png)")
    skipping = decoder(spec, "processes", 1, bad_rows="skip")
    try:
        decoded, kept = skipping(rows, 1)
        assert kept.tolist() == [0, 1, 3, 4] and decoded.rows == 4
    finally:
        skipping.close()
    err = capfd.readouterr().err  # the worker's warning, through the rank's stderr
    assert "WARNING spark_estimator.worker.decode: decode_fn: row 2 of the split" in err

    def broken(rows):
        raise ZeroDivisionError("the user's own")

    with pytest.raises(ZeroDivisionError, match="the user's own") as info:
        decoder(spec, "processes", 1, functions={"collate_fn": broken})  # while priming
    assert "in the decode worker" in str(info.value.__cause__)


def slow_row(row, augment):
    """Decodes as ``augmented``, but sleeps on row 9 (a long batch to kill a worker in)."""
    if int(row["tokens"][0]) == 9:
        time.sleep(60)
    return augmented(row, augment)


def crash_row(row, augment):
    """Decodes as ``augmented``, but crashes the process in native code on row 9."""
    if int(row["tokens"][0]) == 9:
        os.kill(os.getpid(), signal.SIGSEGV)
    return augmented(row, augment)


@pytest.mark.parametrize(
    "how, batch_rows", [("killed", GROUP_ROWS), ("crashed", GROUP_ROWS), ("crashed", 4)]
)
def test_a_worker_that_dies_is_named_with_its_batch_and_cause_within_seconds(
    tmp_path, store, how, batch_rows, no_leftovers
):
    spec = train_spec(image_dataset(tmp_path, row_group_size=10), store, shuffle=False)
    decode_fn = slow_row if how == "killed" else crash_row
    # batches of 4 rows travel 8 a message: the four of this pass in one, to one worker
    decoding = decoder(spec, "processes", 2, decode_fn=decode_fn, batch_rows=batch_rows)
    decoding.rank = 3
    loader = open_loader(spec, "train", 1, 0, pin=False)
    chunks = uncounted(loader.batches([4, 4, 4, 11], 1))  # row 9 in the third (rows 8-11)
    if how == "killed":

        def kill_when_busy():
            time.sleep(2.0)
            pool = decoding.processes
            for index, slots in pool.slots.items():
                if slots.in_flight:
                    os.kill(pool.processes.workers[index].pid, signal.SIGKILL)

        threading.Thread(target=kill_when_busy, daemon=True).start()
    started = time.monotonic()
    try:
        with pytest.raises(DecodeWorkerDied) as info:
            for _ in decoding.ahead(chunks, 1):
                pass
        assert time.monotonic() - started < 15
    finally:
        decoding.close()
    message = str(info.value)
    assert "of rank 3 died while decoding the batch whose first row is" in message
    if how == "killed":
        assert "killed by SIGKILL (out of memory, or killed from outside)" in message
    elif batch_rows == 4:  # the worker died in one of them: which, it cannot say
        assert (
            "first row is 0 of the split (path file:/data/0.png) or one of the 3 sent with it, "
            "whose first rows are 4 (path file:/data/4.png), 8 (path file:/data/8.png), 12 "
            "(path file:/data/12.png): killed by SIGSEGV"
        ) in message
    else:
        assert "first row is 8 of the split (path file:/data/8.png)" in message
        assert "killed by SIGSEGV (a crash in native code)" in message
        assert "Fatal Python error: Segmentation fault" in message  # its stderr's last lines


RANK_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from spark_estimator.shared.serialization import pack_functions
    from spark_estimator.shared.spec import ColumnSpec, DecodeSpec
    from spark_estimator.worker.decode.decoder import Decoder
    spec = DecodeSpec(pool="processes", workers=2)
    decoder = Decoder(spec, [ColumnSpec("text", "string", "float32")], set(), 0)
    decoder.prime(None)
    decoder.processes.wait_ready()
    processes = decoder.processes.processes
    pids = [processes.server.pid, *(w.pid for w in processes.workers.values())]
    print(" ".join(map(str, pids)), flush=True)
    time.sleep(600)
    """
)


def test_workers_end_when_their_rank_is_killed(tmp_path, no_leftovers):
    rank = subprocess.Popen(
        [sys.executable, "-c", RANK_SCRIPT], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    try:
        pids = [int(p) for p in rank.stdout.readline().split()]  # the server and 2 workers
        assert len(pids) == 3 and all(_alive(p) for p in pids)
        rank.kill()
        rank.wait()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids)
    finally:
        rank.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def tiny_shm(tmp_path, monkeypatch):
    """SPARK_ESTIMATOR_SHM_DIR on a tmpfs of 512 KiB (a container's small /dev/shm)."""
    folder = tmp_path / "shm"
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(folder)], capture_output=True
    )
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    monkeypatch.setenv(shared_memory.SHM_DIR_ENV, str(folder))
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=False)


def test_small_batches_go_fewer_a_message_where_memory_is_short(
    tmp_path, store, no_leftovers, monkeypatch
):
    spec = train_spec(image_dataset(tmp_path), store, shuffle=False)
    roomy = decoder(spec, "processes", 2)  # batches of 4 rows: 8 a message
    try:
        assert roomy.processes.group == 8 and roomy.slot_bytes > 0
    finally:
        roomy.close()
    # the two workers' slots fit with one batch a message, not with two
    free = roomy.slot_bytes * slots_per_worker("view", 1) * 2 * 1.5 / decoder_module.SHM_SHARE
    monkeypatch.setattr(decoder_module, "shm_free_bytes", lambda: int(free))
    decoding, threads = decoder(spec, "processes", 2), decoder(spec, "threads", 1)
    try:
        assert decoding.kind == "processes" and decoding.note is None
        assert decoding.processes.group == 1
        assert decoding.processes.most_slots == slots_per_worker("view", 1)
        same(decode_pass(spec, decoding), decode_pass(spec, threads))
    finally:
        decoding.close()
        threads.close()


def test_too_little_shared_memory_decodes_in_threads_saying_which_setting(
    tmp_path, store, tiny_shm, no_leftovers
):
    spec = train_spec(image_dataset(tmp_path), store, shuffle=False)
    decoding = decoder(spec, "processes", 2, batch_rows=4096)  # 2 x 2 slots of ~1 MiB
    try:
        assert decoding.kind == "threads" and decoding.processes is None
        assert decoding.summary()["note"] == decoding.note
        decoded, _ = decoding(first_rows(spec, "train", 4), None)
        assert decoded["img"].shape == (4, 1, 4, 4)
    finally:
        decoding.close()
    assert f"shared memory (files in {tiny_shm}), of which 0 MiB is free" in decoding.note
    assert "decoding in threads instead" in decoding.note
    assert f"set {shared_memory.SHM_DIR_ENV} to a larger tmpfs, or unset it" in decoding.note


def test_a_batch_that_outgrows_shared_memory_travels_through_the_socket(
    tmp_path, store, tiny_shm, no_leftovers, monkeypatch
):
    images = {i: png(i, size=160) for i in range(ROWS)}  # 25 KiB a row decoded (1 x 160 x 160)
    data = image_dataset(tmp_path, images=images, file_rows=(ROWS,), row_group_size=ROWS)
    spec = train_spec(data, store)

    def whole(row, augment):
        from spark_estimator.decoding import decode_image

        return {**augmented(row, None), "img": decode_image(row["img"], mode="L")}

    threads = decoder(spec, "threads", 1, decode_fn=whole)
    monkeypatch.setattr(pool_module, "GROUP_MOST", 1)  # slots for batches of a row, one a message
    processes = decoder(spec, "processes", 1, decode_fn=whole, batch_rows=1)
    try:
        assert processes.kind == "processes"
        rows = first_rows(spec, "train", ROWS)  # 23 rows of 25 KiB: more than 512 KiB
        big, _ = processes(rows, None)
        assert torch.equal(big["img"], threads(rows, None)[0]["img"])
        note = processes.summary()["note"]
    finally:
        threads.close()
        processes.close()
    assert "no shared memory could be had for some batches" in note
    assert "they went through the workers' sockets" in note


def test_an_empty_batch_and_a_rank_without_rows_decode_to_zero_rows(tmp_path, store, no_leftovers):
    spec = train_spec(image_dataset(tmp_path, file_rows=(2,)), store, shuffle=False)
    decoding = decoder(spec, "processes", 1)
    try:
        loader = open_loader(spec, "train", 3, 2, pin=False)  # 2 rows on 3 ranks: none here
        ((_, (decoded, kept)),) = list(decoding.ahead(loader.batches([0], 1), 1))
        assert decoded.rows == 0 and kept is None
        assert decoded["img"].shape == (0, 1, 4, 4) and decoded.masks["tokens"].shape[0] == 0
    finally:
        decoding.close()
    assert np.asarray(decoding.padding).tolist() == [0, 0]


@pytest.mark.parametrize("pool", ["threads", "processes"])
def test_gpu_decoding_gets_the_rows_bytes_and_decode_batch_fn_the_decoded_batch(
    tmp_path, store, monkeypatch, pool, no_leftovers
):
    """decode_device="cuda", simulated on the CPU (the GPU decoder swapped for Pillow):
    the images reach on_device as the rows' bytes, the other columns decoded by the pool;
    with decode_batch_fn, it gets the decoded images as one tensor and each row's
    generator, and crops as decode_fn would."""
    from spark_estimator.decoding import decode_image
    from spark_estimator.worker.decode import gpu_jpeg as decode_module

    decoded_on = []

    def on_cpu(name, images, device):
        decoded_on.append(len(images))
        return torch.stack([decode_image(b, mode="L") for b in images])

    monkeypatch.setattr(decode_module, "decode_jpegs", on_cpu)
    spec = train_spec(image_dataset(tmp_path), store, shuffle=True, shuffle_buffer_size=7)
    cpu = torch.device("cpu")

    plain = decoder(spec, pool, 2, decode_fn=None, device="cuda")
    try:
        assert plain.gpu.images == ["img"] and [c.name for c in plain.recipe.columns] == [
            "tokens",
            "text",
        ]
        for ids, decoded, _ in decode_pass(spec, plain):
            assert decoded["img"] == [png(i) for i in ids]  # still bytes, in the rows' order
            plain.on_device(decoded, cpu)
            assert decoded["img"].shape == (len(ids), 1, 6, 6) and decoded["text"][0].startswith(
                "row"
            )
    finally:
        plain.close()

    def crops(rows, augments):  # per row, as ``augmented`` crops and flips
        images = rows["img"]
        assert isinstance(images, torch.Tensor)
        out = []
        for image, augment in zip(images, augments or [None] * len(images)):
            if augment is None:
                out.append(image[:, 1:5, 1:5])
            else:
                out.append(random_flip(random_crop(image, 4, augment, padding=1), augment))
        tokens = [torch.from_numpy(t) for t in rows["tokens"]]
        return {"img": torch.stack(out), "tokens": tokens, "text": rows["text"]}

    batched = decoder(
        spec, pool, 2, decode_fn=None, device="cuda", functions={"decode_batch_fn": crops}
    )
    reference = decoder(spec, "threads", 1)
    try:
        assert batched.gpu.whole and batched.processes is None  # all of it in the rank
        assert batched.summary() == {"pool": "gpu", "workers": 0}
        want = decode_pass(spec, reference)
        got = decode_pass(spec, batched)
        for (_, decoded, _), (_, expected, _) in zip(got, want):
            batched.on_device(decoded, cpu, 3)
            assert torch.equal(decoded["img"], expected["img"])
            assert torch.equal(decoded["tokens"], expected["tokens"])
            assert torch.equal(decoded.masks["tokens"], expected.masks["tokens"])
        assert batched.padding == reference.padding
    finally:
        batched.close()
        reference.close()


def test_the_default_decoding_decodes_a_batch_into_one_buffer_in_any_pool(
    tmp_path, store, no_leftovers
):
    from spark_estimator.decoding import decode_image

    data = image_dataset(tmp_path, images={5: b"not an image"}, row_group_size=10)
    spec = train_spec(data, store, shuffle=False)
    rows = first_rows(spec, "train", 10)
    results = []
    for pool in ("threads", "processes"):
        decoding = decoder(spec, pool, 2, decode_fn=None, bad_rows="skip")
        try:
            results.append(decoding(rows, None))
        finally:
            decoding.close()
    for decoded, kept in results:
        assert kept.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9]
        images = decoded["img"]  # [B, 3, H, W], channels-last in memory
        assert images.shape == (9, 3, 6, 6)
        assert images.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(images, torch.stack([decode_image(png(i)) for i in kept.tolist()]))
        assert decoded["text"] == [f"row {i}" for i in kept.tolist()]
    assert torch.equal(results[0][0]["tokens"], results[1][0]["tokens"])


def stuck_row(row, augment):
    """Decodes as ``augmented``, but waits 8 s on row 9 (a read that does not return)."""
    if int(row["tokens"][0]) == 9:
        time.sleep(8)
    return augmented(row, augment)


@pytest.mark.parametrize(
    "pool, batch_rows", [("threads", GROUP_ROWS), ("processes", GROUP_ROWS), ("processes", 128)]
)
def test_a_batch_slower_than_decode_timeout_is_named_and_the_workers_stopped_at_once(
    tmp_path, store, pool, batch_rows, no_leftovers
):
    spec = train_spec(image_dataset(tmp_path, row_group_size=10), store, shuffle=False)
    held = len(held_shared_memory())  # other tests' batches, which their failures may keep
    # batches of 128 rows travel 2 a message: rows 8-11 with 12-22, waited for 2 x 1.5 s
    decoding = decoder(spec, pool, 2, decode_fn=stuck_row, timeout=1.5, batch_rows=batch_rows)
    decoding.rank = 3
    loader = open_loader(spec, "train", 1, 0, pin=False)
    started = time.monotonic()
    try:
        with pytest.raises(DecodeTimeout) as info:
            chunks = uncounted(loader.batches([4, 4, 4, 11], 1))
            collections.deque(decoding.ahead(chunks, 1), maxlen=0)
        assert time.monotonic() - started < 6
    finally:
        closing = time.monotonic()
        decoding.close()
        assert time.monotonic() - closing < 2  # not behind the stuck batch
    message = str(info.value)
    del info
    gc.collect()
    assert message.startswith("decode_timeout: ")
    assert "the batch whose first row is 8 of the split (path file:/data/8.png)" in message
    if pool == "processes":
        assert re.search(r"decode worker \d \(pid \d+\) of rank 3", message)
    if batch_rows == 128:
        assert "more than 3 s on the batch whose first row is 8" in message
        assert "and the 1 sent with it (1.5 s a batch)" in message
    else:
        assert "more than 1.5 s" in message
    assert len(held_shared_memory()) <= held


def held_shared_memory() -> list[str]:
    """This process's descriptors and mappings of decode segments."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except FileNotFoundError:  # listdir's own
            pass
    with open("/proc/self/maps") as maps:
        mapped = [line for line in maps if "spark-estimator-decode" in line]
    return [fd for fd in fds if "spark-estimator-decode" in fd] + mapped


def exiting_row(row, augment):
    """Ends its worker on row 9 as user code may (``sys.exit(3)``)."""
    if int(row["tokens"][0]) == 9:
        sys.exit(3)
    return augmented(row, augment)


def test_workers_ignore_sigint_and_a_user_exit_ends_the_worker_named_with_its_status(
    tmp_path, store, no_leftovers
):
    spec = train_spec(image_dataset(tmp_path, row_group_size=10), store, shuffle=False)
    decoding = decoder(spec, "processes", 1, decode_fn=exiting_row, batch_rows=GROUP_ROWS)
    loader = open_loader(spec, "train", 1, 0, pin=False)
    try:
        (worker,) = decoding.processes.processes.workers.values()
        os.kill(worker.pid, signal.SIGINT)  # a Ctrl-C reaches every process of the group
        assert len(list(decoding.ahead(loader.batches([4, 4], 1), 1))) == 2
        with pytest.raises(DecodeWorkerDied) as info:
            list(decoding.ahead(loader.batches([4, 4, 4, 11], 1), 1))
    finally:
        decoding.close()
    assert "died while decoding the batch whose first row is 8" in str(info.value)
    assert "exited with status 3" in str(info.value)


def test_a_worker_that_dies_between_batches_is_named_with_its_cause(tmp_path, store, no_leftovers):
    spec = train_spec(image_dataset(tmp_path), store, shuffle=False)
    decoding = decoder(spec, "processes", 2)
    loader = open_loader(spec, "train", 1, 0, pin=False)
    try:
        os.kill(decoding.processes.processes.workers[1].pid, signal.SIGKILL)
        time.sleep(0.5)  # dead before the rank's next batch
        with pytest.raises(DecodeWorkerDied) as info:
            for _ in range(5):  # whenever the rank learns of it: at once, or at a batch
                list(decoding.ahead(loader.batches([4, 4], 1), 1))
                time.sleep(0.5)
    finally:
        decoding.close()
    message = str(info.value)
    assert "decode worker 1 (pid" in message and "died between batches" in message
    assert "killed by SIGKILL" in message


def test_closing_does_not_wait_behind_the_batches_in_flight(tmp_path, store, no_leftovers):
    spec = train_spec(image_dataset(tmp_path, row_group_size=10), store, shuffle=False)
    decoding = decoder(spec, "processes", 1, decode_fn=slow_row)  # row 9 takes 60 s
    loader = open_loader(spec, "train", 1, 0, pin=False)
    errors = []

    def consume():
        try:
            list(decoding.ahead(loader.batches([4, 4, 4, 11], 1), 1))
        except Exception as e:
            errors.append(e)

    consumer = threading.Thread(target=consume)
    consumer.start()
    time.sleep(2.0)  # the worker is in row 9's batch, the next one queued behind it
    started = time.monotonic()
    decoding.close()
    consumer.join(timeout=5)
    assert time.monotonic() - started < 3 and not consumer.is_alive()
    assert "were closed" in str(errors[0])


def test_a_pass_whose_slots_an_abandoned_pass_holds_waits_for_them(tmp_path, store, no_leftovers):
    spec = train_spec(image_dataset(tmp_path), store, shuffle=False)
    decoding = decoder(spec, "processes", 1, decode_fn=slow_first, batch_rows=128)  # 2 a message
    sizes = [3] * 7 + [2]
    try:
        loader = open_loader(spec, "train", 1, 0, pin=False)
        pool = decoding.processes
        chunks = loader.batches(sizes, 1)
        taken = []
        while True:  # a pass abandoned with every slot of the worker in flight
            with pool.changed:
                slots = pool._take_slots(pool.group)
            if slots is None:
                break
            raws = [(*decoding._raw(next(chunks)), 1) for _ in slots[1]]
            taken += pool._submit(*slots, raws)
        with pool.changed:
            pool.abandoned.update(taken)
        assert pool.group == 2 and len(taken) == IN_FLIGHT * 2
        again = list(decoding.ahead(loader.batches(sizes, 1), 3))
        assert len(again) == len(sizes)
    finally:
        decoding.close()


def slow_first(row, augment):
    if int(row["tokens"][0]) == 0:
        time.sleep(1.0)
    return augmented(row, augment)


@pytest.mark.parametrize("group", [1, 2])
def test_a_cpu_rank_takes_views_of_the_slots_given_back_once_the_batch_is_gone(
    tmp_path, store, group, no_leftovers
):
    spec = train_spec(image_dataset(tmp_path), store, shuffle=False)
    decoding = decoder(spec, "processes", 1, batch_rows=GROUP_ROWS // group)
    loader = open_loader(spec, "train", 1, 0, pin=False)
    pool = decoding.processes
    try:
        kept = []
        chunks = uncounted(loader.batches([4] * 5, 1))
        for index, (_, (decoded, _)) in enumerate(decoding.ahead(chunks, 1)):
            address = decoded["tokens"].data_ptr()
            segments = pool.slots[0].segments.values()
            viewed = any(s.address() <= address < s.address() + s.size for s in segments)
            assert viewed == (index < VIEWED * group)  # beyond what it may view: copies
            kept.append(decoded)
        assert pool.group == group
        messages = -(-5 // group)  # the last one's spare slot made, and given back unused
        assert pool.slots[0].made == min(messages * group, (IN_FLIGHT + VIEWED) * group)
        kept.clear()
        gc.collect()
        with pool.changed:
            pool._take_back()
            assert not pool.slots[0].viewed
    finally:
        decoding.close()


SMALL_SHM = textwrap.dedent(
    """
    import numpy as np, torch
    from spark_estimator.shared.serialization import pack_functions
    from spark_estimator.shared.spec import ColumnSpec, DecodeSpec
    from spark_estimator.worker.decode.decoder import Decoder

    def big(row, augment):  # 96 KiB a row: 48 MiB a batch of 512
        return {"text": torch.full((3, 128, 256), len(row["text"]), dtype=torch.uint8)}

    spec = DecodeSpec(functions=pack_functions(decode_fn=big), pool="processes", workers=1)
    decoder = Decoder(spec, [ColumnSpec("text", "string", "float32")], set(), 0, batch_rows=512)
    rows = {"text": np.array(["x" * (i % 7) for i in range(512)], dtype=object)}
    decoder.prime(rows)
    print(decoder.kind, decoder.note)
    held = [d["text"] for _, (d, _) in decoder.ahead([rows] * 4, None)]  # 4 x 48 MiB at once
    print(all(int(t[i].max()) == i % 7 for t in held for i in range(512)))
    decoder.close()
    """
)


def test_a_container_s_64_mib_of_dev_shm_leaves_the_workers_to_decode(tmp_path):
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare (a private mount namespace)")
    script = tmp_path / "small_shm.py"
    script.write_text(SMALL_SHM)
    command = f"mount -t tmpfs -o size=64m tmpfs /dev/shm && exec {sys.executable} {script}"
    out = subprocess.run(
        ["unshare", "-m", "sh", "-c", command], capture_output=True, text=True, cwd=os.getcwd()
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:2] == ["processes None", "True"]
