"""Shared memory segments: anonymous memory files by default (not files in /dev/shm, so
not bound by its size), files in SPARK_ESTIMATOR_SHM_DIR where set; memory that runs out is
ShmFull when a segment is made; a tensor that outlives its segment keeps its memory."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from spark_estimator.worker.decode import shared_memory
from spark_estimator.worker.decode.shared_memory import Segment, ShmFull


def test_a_segment_is_an_anonymous_memory_file_unless_a_folder_is_given(tmp_path, monkeypatch):
    monkeypatch.delenv(shared_memory.SHM_DIR_ENV, raising=False)
    segment = Segment(1 << 20)
    assert os.readlink(f"/proc/self/fd/{segment.fd}").startswith("/memfd:")
    assert not os.get_inheritable(segment.fd)
    segment.close()
    monkeypatch.setenv(shared_memory.SHM_DIR_ENV, str(tmp_path))
    segment = Segment(1 << 20)
    assert os.readlink(f"/proc/self/fd/{segment.fd}").startswith(str(tmp_path))
    assert not list(tmp_path.iterdir())  # unlinked at once
    segment.close()


def test_a_folder_without_room_refuses_a_segment_when_it_is_made(tmp_path, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("mounts a tmpfs: needs root")
    folder = tmp_path / "tiny"
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], check=True)
    try:
        monkeypatch.setenv(shared_memory.SHM_DIR_ENV, str(folder))
        with pytest.raises(ShmFull, match=f"4.0 MiB of shared memory in files in {folder}"):
            Segment(4 << 20)
        assert shared_memory.shm_free_bytes() == 1 << 20
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_tensor_that_outlives_its_segment_keeps_its_memory():
    script = textwrap.dedent(
        """
        import torch
        from spark_estimator.worker.decode.shared_memory import Segment
        segment = Segment(1 << 20)
        tensor = segment.view(0, torch.uint8, (1 << 20,))
        tensor.fill_(7)
        segment.close()
        del segment
        print(int(tensor.sum()))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]  # not a SIGSEGV
    assert out.stdout.strip() == str(7 << 20)


def test_anonymous_memory_counts_what_the_process_may_still_take():
    free = shared_memory.shm_free_bytes()
    assert 0 < free < 1 << 62
    assert isinstance(Segment(64).view(0, torch.int64, (8,)), torch.Tensor)
