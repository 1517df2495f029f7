"""The example configuration in conf/: the GPU discovery script's output is what Spark reads."""

import json
import os
import subprocess
from pathlib import Path

import pytest

CONF = Path(__file__).parent.parent / "conf"


@pytest.mark.parametrize("indices,expected", [("0 1", ["0", "1"]), ("", [])])
def test_gpu_discovery_script_prints_spark_resource_json(tmp_path, indices, expected):
    fake = tmp_path / "nvidia-smi"  # stands in for the real one on this GPU-less machine
    lines = "".join(f"echo {i}\n" for i in indices.split())
    fake.write_text("#!/bin/sh\n" + lines)
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}")
    out = subprocess.run(
        [str(CONF / "get_gpus_resources.sh")], capture_output=True, text=True, env=env, check=True
    ).stdout
    assert json.loads(out) == {"name": "gpu", "addresses": expected}


def test_gpu_conf_names_the_shipped_discovery_script_and_one_gpu_per_task():
    settings = dict(
        line.split(None, 1)
        for line in (CONF / "spark-defaults.gpu.conf").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )
    assert settings["spark.task.resource.gpu.amount"].strip() == "1"
    assert (
        settings["spark.executor.resource.gpu.discoveryScript"]
        .strip()
        .endswith("/conf/get_gpus_resources.sh")
    )
