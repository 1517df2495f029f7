"""benchmarks/gpu_check.py: the one command that runs every GPU check and tabulates them."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_gpu_check_is_run_gpu_tests_both_fit_sizes_eager_and_compiled_and_the_cuda_loop():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run"], capture_output=True, text=True, check=True
    )
    commands = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert commands["gpu-tests"].startswith("python -m pytest -m gpu tests")
    fits = [c for c in commands.values() if "benchmarks/gpu_fit.py" in c]
    assert sorted(("--hidden 256" in c, "--compile" in c) for c in fits) == [
        (False, False),
        (False, True),
        (True, False),
        (True, True),
    ]
    assert commands["loop-cuda"] == "python benchmarks/loop_overhead.py --device cuda"
    for command in commands.values():  # each names a file of the repository
        script = command.split()[1] if command.split()[1] != "-m" else None
        assert script is None or (ROOT / script).is_file()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_it_says_so_and_exits_2():
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 2
    assert "needs a CUDA GPU" in done.stderr


def test_an_unknown_check_is_refused_naming_the_checks():
    done = subprocess.run([sys.executable, str(SCRIPT), "fit-huge"], capture_output=True, text=True)
    assert done.returncode == 2 and "unknown check(s) ['fit-huge']" in done.stderr


def test_the_table_gives_each_checks_headline():
    module = gpu_check()
    fit = "x\n- Ours (training loop) / baseline: **0.97** (target >= 0.95: met); whole fit: 0.9\n"
    loop = "| Linear(32, 1) | 900 | 880 | **0.98** (0.97) | 500 | 0.56 |\n"
    assert module.headline("fit-large", fit).startswith(
        "- Ours (training loop) / baseline: **0.97**"
    )
    assert module.headline("loop-cuda", loop) == "Linear(32, 1) 900 880 **0.98** (0.97) 500 0.56"
    assert (
        module.headline("gpu-tests", "...\n===== 7 passed in 174.2s =====\n")
        == "7 passed in 174.2s"
    )
    assert module.headline("fit-small", "Traceback ...") == "no figures printed"
    rows = [("gpu-tests", 0, 174.2, "7 passed"), ("fit-large", 1, 60.0, "no figures printed")]
    assert module.table(rows).splitlines()[2:] == [
        "| gpu-tests | 0 | 174 | 7 passed |",
        "| fit-large | 1 | 60 | no figures printed |",
    ]


# -- benchmarks/fsdp_memory.py: its sizes and its arithmetic, without Spark --------------------
def fsdp_memory():
    spec = importlib.util.spec_from_file_location(
        "fsdp_memory", ROOT / "benchmarks" / "fsdp_memory.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["fsdp_memory"] = module  # its dataclass looks its module up while made
    spec.loader.exec_module(module)
    return module


def test_fsdp_memory_full_size_is_over_300m_parameters_with_a_block_per_layer_built_on_meta():
    module = fsdp_memory()
    assert module.parameters(module.FULL) >= 300_000_000
    model = module.model_function(module.FULL)()
    assert all(p.is_meta for p in model.parameters())
    assert sum(isinstance(m, module.Block) for m in model.modules()) == module.FULL.layers
    small = module.Config(width=32, layers=2, heads=4)
    deeper = module.Config(width=32, layers=4, heads=4)
    assert 0 < module.activation_bytes(small) < module.activation_bytes(deeper)


def test_fsdp_memory_per_rank_measures_targets_and_limit():
    module = fsdp_memory()
    mib = 2**20
    history = [
        {
            "seconds": {"train": [4.0, 6.0]},
            "train": {"loss": 1.0},
            "bench_memory": [
                {
                    "rank": r,
                    "baseline_rss": 400 * mib,
                    "peak_rss": (400 + 3000 + r) * mib,
                    "vm_peak": 9000 * mib,
                    "vm_hwm": 7000 * mib,
                    "rlimit_as": -1,
                }
                for r in (1, 0)
            ],
        },
        {"seconds": {"train": [3.0, 2.0]}, "train": {"loss": 0.5}},
    ]
    summary = {
        "rank_memory": [
            {"rank": r, "parameter_elements": 50, "peak_memory_mib": 5000.0} for r in (0, 1)
        ]
    }
    ranks = [{"rank": 0, "batches_per_epoch": [2, 3]}, {"rank": 1, "batches_per_epoch": [2, 2]}]
    got = module.measures(history, summary, ranks)
    assert got["step_s"] == [3.0, 1.0]  # the slowest rank's seconds per batch, per epoch
    assert [r["train_mib"] for r in got["per_rank"]] == [3000, 3001]
    assert got["per_rank"][0]["virtual_overhead_mib"] == 2000
    assert module.train_mib(got) == 3001 and module.train_mib(got, "min") == 3000

    assert module.memory_target(1900, 6000, 4, 50)["met"]  # bound 1.3 x 1500 + 50
    assert not module.memory_target(2100, 6000, 4, 50)["met"]
    assert module.time_target(6.0, 4.0) == {"ratio": 1.5, "met": True}
    assert not module.time_target(6.1, 4.0)["met"]
    assert module.limit_between(4000, 7000) == 5376  # halfway, in steps of 256 MiB
    assert module.limit_between(4000, 4400) is None  # less than 0.5 GiB apart
    params, base = 300_000_000, 0.5 * 2**30
    ddp2, fsdp4 = (module.needed_bytes(params, n, p, base) for n, p in ((2, "ddp"), (4, "fsdp")))
    assert ddp2 == 2 * (base + 20 * params) + 12 * params
    assert fsdp4 == 4 * (base + 4 * params) + 8 * params


# -- benchmarks/image_fit.py and text_fit.py: their pieces, without Spark or timing -------------
def benchmark(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # bench_common registers itself for pickling by value
    spec.loader.exec_module(module)
    return module


def test_the_data_and_communication_shares_are_summed_over_ranks_and_epochs():
    bench_common = benchmark("bench_common")
    history = [
        {"seconds": {"train": [4.0, 4.0], "data": [1.0, 3.0], "communication": [0.5, 0.5]}},
        {"seconds": {"train": [2.0, 2.0], "data": [0.0, 2.0], "communication": [0.0, 0.0]}},
        {"train": {"loss": 1.0}},  # a record without timings
    ]
    assert bench_common.time_share(history) == 0.5
    assert bench_common.time_share(history, "communication") == pytest.approx(1 / 12)
    assert bench_common.time_share([{"train": {"loss": 1.0}}]) is None
    assert bench_common.thread_counts("2,1,2") == [1, 2]


def test_image_fit_decodes_its_generated_jpegs_to_crops_both_models_take():
    pytest.importorskip("PIL")
    import numpy as np

    module = benchmark("image_fit")
    data = module.make_image(13)
    assert data[:2] == b"\xff\xd8" and data == module.make_image(13)  # JPEG, reproducible
    train = module.decode({"content": data}, np.random.default_rng(0))["content"]
    assert train.dtype == torch.uint8 and tuple(train.shape) == (3, module.CROP, module.CROP)
    centre = module.decode({"content": data}, None)["content"]
    assert tuple(centre.shape) == (3, module.CROP, module.CROP)
    batch = torch.stack([train, centre])
    for name in module.MODELS:
        assert tuple(module.build(name)(batch).shape) == (2, module.CLASSES)


def test_image_gpu_crops_a_batch_as_the_per_row_decode_fn_does_from_bytes_or_decoded_images():
    pytest.importorskip("PIL")
    import numpy as np

    module = benchmark("image_gpu")
    blobs = [module.image_fit.make_image(i) for i in range(6)]

    def generators():  # each row's, as a fit seeds them: (seed, epoch, row)
        return [np.random.default_rng([0, 2, i]) for i in range(6)]

    per_row = [
        module.image_fit.decode({"content": b}, g)["content"] for b, g in zip(blobs, generators())
    ]
    expected = torch.stack(per_row)
    # decode_device="cuda" hands decode_batch_fn the batch already decoded, stacked [B, 3, H, W]
    decoded = torch.stack([module.decoding.decode_image(b) for b in blobs])
    assert torch.equal(
        module.augment_batch({"content": decoded}, generators())["content"], expected
    )
    if hasattr(module.decoding, "decode_images"):  # the default decoding's column: the bytes
        from_bytes = module.augment_batch({"content": blobs}, generators())["content"]
        assert torch.equal(from_bytes, expected)
    centre = module.augment_batch({"content": decoded}, None)["content"]
    assert tuple(centre.shape) == (6, 3, module.CROP, module.CROP)
    assert tuple(module.build("small")(expected).shape) == (6, module.CLASSES)


def test_text_fit_tokenizes_pickles_without_its_tokenizer_and_pads_with_a_mask(tmp_path):
    import cloudpickle
    import numpy as np

    module = benchmark("text_fit")
    texts, labels = module.sentences(8)
    assert module.sentences(4)[0] == texts[:4] and set(labels) <= set(range(module.CLASSES))
    (tmp_path / "words.json").write_text(__import__("json").dumps(module.vocabulary()))
    tokenize = module.Tokenize(tmp_path)  # the word -> id dict (no tokenizer.json here)
    ids = tokenize({"text": texts[0]}, None)["text"]
    assert ids.dtype == torch.int64 and len(ids) == len(texts[0].split()) and ids.min() >= 2
    again = cloudpickle.loads(cloudpickle.dumps(tokenize))
    assert again._encode is None and torch.equal(again.ids(texts[0]), ids)
    rows = [(tokenize.ids(t), int(y)) for t, y in zip(texts[:3], labels[:3])]
    padded, mask, y = module.pad_collate(rows)
    lengths = [len(r[0]) for r in rows]
    assert padded.shape == (3, max(lengths)) and mask.sum(1).tolist() == lengths
    assert (padded[~mask] == 0).all() and y.tolist() == [int(v) for v in labels[:3]]
    assert tuple(module.build()(padded, mask).shape) == (3, module.CLASSES)
    assert np.isfinite(module.build()(padded, mask).detach().numpy()).all()


# -- benchmarks/decode_pool.py: the decode_fn that times itself ---------------------------------
def _busy(row: dict, augment) -> dict:
    """A decode_fn taking 5 ms of its thread's CPU time."""
    import time

    start = time.thread_time()
    while time.thread_time() - start < 0.005:
        pass
    return {"content": row["content"] + 1}


def test_a_self_timed_decode_fn_sums_its_own_cpu_time_over_the_processes_it_ran_in(tmp_path):
    import multiprocessing

    import cloudpickle

    module = benchmark("decode_pool")
    timed = module.SelfTimed(_busy, tmp_path)
    copy = cloudpickle.loads(cloudpickle.dumps(timed))  # as a decode worker gets it
    assert timed({"content": 1}, None) == {"content": 2}  # the decode_fn's own result
    child = multiprocessing.get_context("fork").Process(
        target=lambda: [copy({"content": i}, None) for i in range(3)]
    )
    child.start()
    child.join()
    assert child.exitcode == 0
    assert len(list(tmp_path.iterdir())) == 2  # a total for each process
    assert 4 * 0.005 <= timed.seconds() < 4 * 0.005 + 0.05
