"""The configuration in conf/: the GPU discovery script's output is what Spark reads, and
spark-defaults.conf and log4j2.properties are what a spark-submit job runs with."""

import json
import os
import subprocess
import sys
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


def _facts(name: str, master: str, version: str):
    """The stage-level decision's facts of a conf file's settings on ``master``."""
    from spark_estimator.driver.stage_profile import ClusterFacts

    settings = conf_settings(CONF / name)
    return ClusterFacts(
        version=version,
        master=master,
        local=False,
        connect=False,
        takes_profile=True,
        executor_gpus=float(settings["spark.executor.resource.gpu.amount"]),
        task_gpus=float(settings["spark.task.resource.gpu.amount"]),
        executor_cores=int(settings["spark.executor.cores"]),
        task_cpus=int(settings["spark.task.cpus"]),
        dynamic_allocation=settings["spark.dynamicAllocation.enabled"] == "true",
    )


@pytest.mark.parametrize(
    "master, version", [("spark://h:7077", "3.4.0"), ("yarn", "3.5.1"), ("k8s://h", "4.0.0")]
)
def test_the_fractional_gpu_conf_gives_training_one_gpu_and_the_executors_cores(master, version):
    from spark_estimator.driver.stage_profile import decide

    facts = _facts("spark-defaults.gpu-fractional.conf", master, version)
    assert facts.task_gpus * facts.executor_cores == 1  # ETL: a task per core
    assert decide(facts, True, "auto", "training") == (facts.executor_cores, None)
    assert decide(facts, True, "auto", "transform") == (facts.executor_cores, None)


def test_the_whole_gpu_conf_needs_no_profile():
    from spark_estimator.driver.stage_profile import decide

    facts = _facts("spark-defaults.gpu.conf", "spark://h:7077", "4.0.0")
    assert decide(facts, True, "auto", "training") == (
        None,
        "each task already gets a whole GPU (spark.task.resource.gpu.amount=1)",
    )


# A job that sets nothing itself: it reports the settings it runs with and logs one INFO
# and one WARN line through a Spark logger; with --run it also forms a 2-process group with
# run(fn), which the local settings (loopback driver address, 4 slots) must allow.
CONF_JOB = """
import json
import sys
from pyspark.sql import SparkSession
from spark_estimator import distributed, run

spark = SparkSession.builder.appName("conf check").getOrCreate()
log = spark.sparkContext._jvm.org.apache.logging.log4j.LogManager.getLogger(
    "org.apache.spark.ConfCheck"
)
log.info("conf-check INFO marker")
log.warn("conf-check WARN marker")
if "--run" in sys.argv:
    mean_rank = lambda: distributed.allreduce(float(distributed.rank()))
    print("RANKS " + json.dumps(run(mean_rank, num_proc=2, use_gpu=False)))
settings = dict(spark.sparkContext.getConf().getAll())
settings["spark.sql.shuffle.partitions"] = spark.conf.get("spark.sql.shuffle.partitions")
print("SETTINGS " + json.dumps(settings))
spark.stop()
"""


def conf_settings(path: Path) -> dict[str, str]:
    lines = path.read_text().splitlines()
    pairs = (line.split(None, 1) for line in lines if line.strip() and not line.startswith("#"))
    return {key: value.strip() for key, value in pairs}


@pytest.mark.parametrize("how", ["properties-file", "SPARK_CONF_DIR"])
def test_local_conf_and_quiet_logging_reach_a_spark_submit_job(tmp_path, how):
    """Both ways conf/README.md gives: every spark-defaults.conf setting is what the job
    runs with, and log4j2.properties leaves Spark's warnings but none of its INFO lines."""
    job = tmp_path / "job.py"
    job.write_text(CONF_JOB)
    spark_submit = str(Path(sys.executable).parent / "spark-submit")
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable)
    for name in ("PYSPARK_DRIVER_PYTHON", "SPARK_CONF_DIR", "SPARK_MASTER"):
        env.pop(name, None)
    if how == "properties-file":
        argv = [
            spark_submit,
            "--properties-file",
            "conf/spark-defaults.conf",
            "--driver-java-options",
            "-Dlog4j2.configurationFile=conf/log4j2.properties",
            str(job),
            "--run",
        ]
    else:
        env["SPARK_CONF_DIR"] = str(CONF)
        argv = [spark_submit, str(job)]
    done = subprocess.run(
        argv, cwd=CONF.parent, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]

    seen = json.loads(done.stdout.split("SETTINGS ", 1)[1].splitlines()[0])
    wanted = conf_settings(CONF / "spark-defaults.conf")
    assert {key: seen.get(key) for key in wanted} == wanted
    if how == "properties-file":  # one process group is enough to show training works
        assert json.loads(done.stdout.split("RANKS ", 1)[1].splitlines()[0]) == [0.5, 0.5]

    assert "conf-check WARN marker" in done.stderr
    assert "conf-check INFO marker" not in done.stderr
    assert "Using Spark's default log4j profile" not in done.stderr
    info_lines = [line for line in done.stderr.splitlines() if " INFO " in line]
    assert info_lines == []
