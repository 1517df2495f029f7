"""Variable columns through the loader and the decoder (real Parquet, real PNG bytes): rows
decoded in threads, augmented by (seed, epoch, row) whatever the sharding, padded and
masked, bad rows named or skipped."""

import dataclasses
import io
import itertools
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from spark_estimator.decoding import random_crop, random_flip
from spark_estimator.shared.serialization import pack_functions
from spark_estimator.shared.spec import ColumnSpec, DatasetInfo, DecodeSpec
from spark_estimator.worker.data.arrow_reader import ROW_ID
from spark_estimator.worker.data.batch import Batch
from spark_estimator.worker.data.loader import first_rows, open_loader
from spark_estimator.worker.data.remainder import after, own_runs, remainder_batches, reshard
from spark_estimator.worker.data.shards import StepPlan
from spark_estimator.worker.decode.collate import pad_sequences
from spark_estimator.worker.decode.decoded import BadRow
from spark_estimator.worker.decode.decoder import Decoder
from tests.worker.data.test_loader import train_spec

Image = pytest.importorskip("PIL.Image", reason="needs Pillow (the vision extra)")

ROWS = 23


def png(value: int, size: int = 6) -> bytes:
    """A grayscale PNG whose pixels count up from ``value``: each row's image is its own."""
    pixels = (np.arange(size * size).reshape(size, size) + value) % 256
    out = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(out, format="PNG")
    return out.getvalue()


def image_dataset(root, images=None, file_rows=(10, 1, 12), row_group_size=4) -> DatasetInfo:
    """Parquet files of rows with ids 0.. in file order: a PNG ``img`` (``png(id)``), a
    ``path`` naming the row, a ragged ``tokens`` sequence of id % 5 + 1 values, a ``text``
    and the label ``y`` = id."""
    folder = root / "train"
    folder.mkdir(parents=True, exist_ok=True)
    files, start = [], 0
    for i, rows in enumerate(file_rows):
        ids = list(range(start, start + rows))
        start += rows
        table = pa.table(
            {
                "img": pa.array([(images or {}).get(v, png(v)) for v in ids], pa.binary()),
                "path": [f"file:/data/{v}.png" for v in ids],
                "tokens": pa.array([[v] * (v % 5 + 1) for v in ids], pa.list_(pa.int64())),
                "text": [f"row {v}" for v in ids],
                "y": pa.array(ids, pa.int64()),
            }
        )
        path = folder / f"part-{i:05d}.parquet"
        pq.write_table(table, path, row_group_size=row_group_size)
        meta = pq.ParquetFile(path).metadata
        groups = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        files.append((f"train/{path.name}", groups))
    return DatasetInfo(
        path=str(root),
        features=[
            ColumnSpec("img", "binary", "float32"),
            ColumnSpec("tokens", "sequence", "int64"),
            ColumnSpec("text", "string", "float32"),
        ],
        labels=[ColumnSpec("y", "scalar", "int64")],
        files={"train": files},
        row_names="path",
    )


def augmented(row, augment):
    """Decodes the image (1 channel), and in training crops and flips it at random."""
    from spark_estimator.decoding import decode_image

    image = decode_image(row["img"], mode="L")
    if augment is not None:
        image = random_flip(random_crop(image, 4, augment, padding=1), augment)
    else:
        image = image[:, 1:5, 1:5]
    return {"img": image, "tokens": torch.from_numpy(row["tokens"]), "text": row["text"]}


def decoder_for(spec, decode_fn=augmented, collate_fn=None, **options) -> Decoder:
    functions = pack_functions(decode_fn=decode_fn, collate_fn=collate_fn)
    decode = DecodeSpec(**{"functions": functions, "workers": 2, "pool": "threads", **options})
    data = spec.data
    decoder = Decoder(decode, data.columns, {"y"}, spec.seed, data.row_names)
    decoder.prime(None)
    return decoder


def test_a_pass_decodes_every_row_with_its_own_augmentation_whatever_the_sharding(tmp_path, store):
    spec = train_spec(image_dataset(tmp_path), store, shuffle=True, shuffle_buffer_size=5)
    seen = {}
    for world, batch in ((1, 4), (3, 3)):
        images = {}
        for rank in range(world):
            decoder = decoder_for(spec)
            sizes = StepPlan(ROWS, world, rank, batch).batch_sizes
            loader = open_loader(spec, "train", world, rank, pin=False)
            for chunk in loader.batches(sizes, 2):
                decoded, kept = decoder(chunk, epoch=3)
                assert kept is None
                ids = chunk[ROW_ID].tolist()
                assert ids == chunk["y"].tolist()  # the row index travels with the row
                images.update({i: t for i, t in zip(ids, decoded["img"])})
            decoder.close()
        assert sorted(images) == list(range(ROWS))
        seen[world] = images
    for i in range(ROWS):  # the same crop and flip for row i in both runs
        torch.testing.assert_close(seen[1][i], seen[3][i], rtol=0, atol=0)
    other_epoch = decoder_for(spec)(first_rows(spec, "train", 4), epoch=4)[0]["img"]
    same_epoch = decoder_for(spec)(first_rows(spec, "train", 4), epoch=3)[0]["img"]
    assert all(torch.equal(same_epoch[i], seen[1][i]) for i in range(4))
    assert not all(torch.equal(other_epoch[i], seen[1][i]) for i in range(4))


@pytest.mark.parametrize(
    "old, new, steps_done, pool", [(3, 2, 1, "threads"), (2, 3, 2, "processes")]
)
def test_a_resized_epoch_trains_every_row_once_with_the_transforms_it_would_have_had(
    tmp_path, store, old, new, steps_done, pool
):
    spec = train_spec(image_dataset(tmp_path), store, shuffle=True, shuffle_buffer_size=2)
    batch, pass_index, epoch = 3, 2, 5
    decoder = decoder_for(spec, pool=pool)  # the reference, and the launches, decoded so
    reference = {}
    plan = StepPlan(ROWS, 1, 0, batch)
    for chunk in open_loader(spec, "train", 1, 0, pin=False).batches(plan.batch_sizes, 1):
        decoded, _ = decoder(chunk, epoch)
        reference.update(zip(chunk[ROW_ID].tolist(), decoded["img"]))

    def loader(world, rank):
        return open_loader(spec, "train", world, rank, pin=False)

    trained, consumed = [], []
    for rank in range(old):  # the first launch trains steps_done batches, then is lost
        sizes = StepPlan(ROWS, old, rank, batch).batch_sizes
        for chunk in itertools.islice(loader(old, rank).batches(sizes, pass_index), steps_done):
            trained.append(Batch(chunk, spec, torch.device("cpu"), None, decoder, epoch))
        consumed.append(sum(sizes[:steps_done]))
    parts = reshard([after(r, n) for r, n in zip(own_runs(ROWS, old), consumed)], new)
    rows = [sum(run.rows for run in p) for p in parts]
    empty = loader(1, 0).layout.empty
    for rank in range(new):
        sizes = StepPlan.over(rows, rank, batch).batch_sizes
        for chunk in remainder_batches(parts[rank], sizes, pass_index, loader, dict(empty)):
            trained.append(Batch(chunk, spec, torch.device("cpu"), None, decoder, epoch))
    ids = [i for b in trained for i in b.labels[0].tolist()]
    assert sorted(Counter(ids).items()) == [(i, 1) for i in range(ROWS)]
    for b in trained:
        for i, image in zip(b.labels[0].tolist(), b.inputs[0]):
            torch.testing.assert_close(image, reference[i], rtol=0, atol=0)
    decoder.close()


def test_sequences_are_padded_with_their_mask_labels_with_minus_100_strings_listed(tmp_path, store):
    spec = train_spec(image_dataset(tmp_path, row_group_size=10), store, shuffle=False)
    decoder = decoder_for(spec, padding_value=7.0)
    batch = Batch(first_rows(spec, "train", 6), spec, torch.device("cpu"), None, decoder, 1)
    image, tokens, mask, text = batch.inputs  # the mask right after its column
    assert image.shape == (6, 1, 4, 4) and image.dtype == torch.uint8
    assert tokens.tolist()[3] == [3, 3, 3, 3, 7] and tokens.dtype == torch.int64
    assert mask.tolist()[3] == [True] * 4 + [False] and mask.shape == (6, 5)
    assert text == [f"row {i}" for i in range(6)]
    assert decoder.padding == [1 + 2 + 3 + 4 + 5 + 1, 6 * 5]
    padded, label_mask = pad_sequences([torch.tensor([1, 2]), torch.tensor([3])], -100)
    assert padded.tolist() == [[1, 2], [3, -100]] and label_mask.tolist()[1] == [True, False]


def test_a_collate_fn_gives_the_batch_and_its_masks(tmp_path, store):
    spec = train_spec(image_dataset(tmp_path), store, shuffle=False)

    def collate(rows):
        lengths = torch.tensor([len(r["tokens"]) for r in rows])
        longest = int(lengths.max())
        ids = torch.stack(
            [torch.nn.functional.pad(r["tokens"], (0, longest - len(r["tokens"]))) for r in rows]
        )
        return {
            "img": torch.stack([r["img"] for r in rows]).float() / 255,
            "tokens": ids,
            "tokens_mask": torch.arange(longest)[None] < lengths[:, None],
            "text": [r["text"].upper() for r in rows],
        }

    decoder = decoder_for(spec, collate_fn=collate)
    batch = Batch(first_rows(spec, "train", 3), spec, torch.device("cpu"), None, decoder)
    image, tokens, mask, text = batch.inputs
    assert image.dtype == torch.float32 and mask.tolist()[0] == [True, False, False]
    assert text == ["ROW 0", "ROW 1", "ROW 2"]


def test_a_row_that_does_not_decode_is_named_or_skipped_and_counted(tmp_path, store):
    data = image_dataset(tmp_path, images={4: b"not an image"}, row_group_size=10)
    spec = train_spec(data, store, shuffle=False)
    rows = first_rows(spec, "train", 6)
    default = Decoder(DecodeSpec(workers=2), data.columns, {"y"}, 0, data.row_names)
    with pytest.raises(BadRow) as info:
        default(rows, None)
    message = str(info.value)
    assert message.startswith(
        "feature_cols: column 'img': row 4 of the split (path file:/data/4.png)"
    )
    assert "UnidentifiedImageError" in message and "bad_rows='skip'" in message
    with pytest.raises(BadRow) as info:
        decoder_for(spec)(rows, None)
    assert str(info.value).startswith(
        "decode_fn: row 4 of the split (path file:/data/4.png) could not be decoded from "
        "columns 'img', 'tokens', 'text' (UnidentifiedImageError"
    )
    skipping = decoder_for(spec, bad_rows="skip")
    batch = Batch(rows, spec, torch.device("cpu"), None, skipping, 1)
    assert batch.labels[0].tolist() == [0, 1, 2, 3, 5] and batch.drawn == 6 and batch.size == 5
    assert batch.inputs[0].shape[0] == 5 and len(batch.inputs[3]) == 5
    assert skipping.skipped == 1


def test_a_failing_decode_batch_fn_is_named_with_the_columns_it_was_given(tmp_path, store):
    data = image_dataset(tmp_path, row_group_size=10)
    spec = train_spec(data, store, shuffle=False)

    def fails(batch, augments):
        raise OSError("cannot read")

    decode = DecodeSpec(functions=pack_functions(decode_batch_fn=fails))
    with pytest.raises(BadRow) as info:
        Decoder(decode, data.columns, {"y"}, 0, data.row_names)(first_rows(spec, "train", 3), None)
    assert str(info.value).startswith(
        "decode_batch_fn: failed on columns 'img', 'tokens', 'text' of the batch whose first "
        "row is 0 of the split (path file:/data/0.png) (OSError: cannot read)"
    )


def test_images_of_different_sizes_are_refused_naming_two_sizes_and_the_fix(tmp_path, store):
    data = image_dataset(tmp_path, images={1: png(1, size=9)})
    spec = train_spec(data, store, shuffle=False)
    default = Decoder(DecodeSpec(workers=1), data.columns, {"y"}, 0, data.row_names)
    with pytest.raises(ValueError) as info:
        default(first_rows(spec, "train", 3), None)
    assert str(info.value).startswith(
        "feature_cols: column 'img' has rows of different shapes in one batch (3x6x6 and 3x9x9)"
    )
    assert "decode_fn that resizes or crops them" in str(info.value)


def test_a_rank_without_rows_gets_empty_batches_shaped_as_decoded_rows(tmp_path, store):
    spec = train_spec(image_dataset(tmp_path, file_rows=(2,)), store, shuffle=False)
    decoder = decoder_for(spec)
    decoder.prime(first_rows(spec, "train"))
    loader = open_loader(spec, "train", 3, 2, pin=False)  # 2 rows on 3 ranks: none here
    batch = Batch(next(loader.batches([0], 1)), spec, torch.device("cpu"), None, decoder, 1)
    image, tokens, mask, text = batch.inputs
    assert image.shape == (0, 1, 4, 4) and tokens.shape[0] == 0 and mask.dtype == torch.bool
    assert batch.size == 0 and text == []
    assert decoder.padding == [0, 0] and decoder.skipped == 0  # priming is not counted


def test_a_bad_row_skipped_in_several_epochs_is_counted_once(tmp_path, store):
    data = image_dataset(tmp_path, images={4: b"not an image"}, row_group_size=10)
    spec = train_spec(data, store, shuffle=False)
    rows = first_rows(spec, "train", 6)
    skipping = decoder_for(spec, bad_rows="skip")
    for epoch in (1, 2, 3):
        assert skipping(rows, epoch)[1].tolist() == [0, 1, 2, 3, 5]
    skipping(rows, None)  # the same index in validation is another row
    assert skipping.skipped == 2


def test_a_decode_fn_that_returns_a_list_is_told_to_return_a_tensor(tmp_path, store):
    spec = train_spec(image_dataset(tmp_path), store, shuffle=False)

    def as_lists(row, augment):
        return {**augmented(row, augment), "tokens": row["tokens"].tolist()}

    decoder = decoder_for(spec, decode_fn=as_lists)
    with pytest.raises(TypeError) as info:
        decoder(first_rows(spec, "train", 3), None)
    assert str(info.value).startswith(
        "decode_fn: returned a list of 1 values for column 'tokens' of row 0; return a tensor"
    )
    collated = decoder_for(  # with a collate_fn, the rows are its to batch
        spec,
        decode_fn=as_lists,
        collate_fn=lambda rows: {"n": torch.tensor([len(r["tokens"]) for r in rows])},
    )
    assert collated(first_rows(spec, "train", 3), None)[0]["n"].tolist() == [1, 2, 3]


def test_images_of_other_channel_counts_in_a_batch_are_told_to_decode_in_one_mode(tmp_path, store):
    spec = train_spec(image_dataset(tmp_path), store, shuffle=False)

    def mixed(row, augment):  # row 1 in RGB, the rest grayscale
        from spark_estimator.decoding import decode_image

        mode = "RGB" if row["tokens"][0] == 1 else "L"
        return {**augmented(row, None), "img": decode_image(row["img"], mode=mode)}

    with pytest.raises(ValueError) as info:
        decoder_for(spec, decode_fn=mixed)(first_rows(spec, "train", 3), None)
    message = str(info.value)
    assert message.startswith(
        "feature_cols: column 'img' has images of 1 and 3 channels in one batch (1x6x6 and 3x6x6)"
    )
    assert "mode='RGB'" in message and "resizes" not in message


def test_in_transform_a_bad_row_is_named_with_what_to_filter_and_labels_read_are_told(
    tmp_path, store
):
    data = image_dataset(tmp_path, images={1: b"not an image"}, row_group_size=10)
    spec = train_spec(data, store, shuffle=False)
    rows = first_rows(spec, "train", 3)
    features = [c for c in data.columns if c.name != "y"]
    transform = Decoder(DecodeSpec(), features, set(), 0, data.row_names, fit_labels=["y"])
    with pytest.raises(BadRow) as info:
        transform(rows, None)
    message = str(info.value)
    assert message.startswith(
        "feature_cols: column 'img': row 1 of the batch (path file:/data/1.png)"
    )
    assert "filter such rows out of the DataFrame before transform" in message
    assert "bad_rows" not in message
    with_fn = DecodeSpec(functions=pack_functions(decode_fn=augmented))
    transform = Decoder(with_fn, features, set(), 0, data.row_names, fit_labels=["y"])
    with pytest.raises(BadRow) as info:
        transform(rows, None)
    assert str(info.value).startswith(
        "decode_fn: row 1 of the batch (path file:/data/1.png) could not be decoded from "
        "columns 'img', 'tokens', 'text' (UnidentifiedImageError"
    )

    def reads_label(row, augment):
        return {**augmented(row, augment), "y": torch.tensor(row["y"])}

    decode = DecodeSpec(functions=pack_functions(decode_fn=reads_label))
    good = image_dataset(tmp_path / "good", row_group_size=10)
    with pytest.raises(KeyError) as info:
        Decoder(decode, features, set(), 0, None, fit_labels=["y"])(
            first_rows(train_spec(good, store, shuffle=False), "train", 2), None
        )
    assert info.value.args[0].startswith(
        "decode_fn: read 'y', a label column of the fit; transform's rows hold only the "
        "variable feature columns (img, text, tokens)"
    )


def test_input_shapes_on_a_sequence_whose_rows_vary_in_length_says_so(tmp_path, store):
    data = image_dataset(tmp_path, row_group_size=10)
    spec = train_spec(data, store, shuffle=False)
    shaped = dataclasses.replace(spec, input_shapes=[[-1, 1, 4, 4], [-1, 4], [-1]])
    with pytest.raises(ValueError) as info:
        Batch(first_rows(spec, "train", 6), shaped, torch.device("cpu"), None, decoder_for(spec))
    assert str(info.value).startswith(
        "input_shapes: column 'tokens' holds sequences whose rows vary in length (1 to 5 "
        "values in this batch)"
    )
    assert "cannot shape a sequence" in str(info.value)
