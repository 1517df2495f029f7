"""Training on a real GPU assigned by Spark; skipped where CUDA is absent."""

import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_fit_uses_the_gpu_spark_assigned(tmp_path):
    # A separate process: GPU scheduling needs its own Spark conf (worker resources).
    discovery = tmp_path / "gpus.sh"
    discovery.write_text('#!/bin/sh\necho \'{"name": "gpu", "addresses": ["0"]}\'\n')
    discovery.chmod(discovery.stat().st_mode | stat.S_IEXEC)
    script = textwrap.dedent(
        f"""
        import json, os, sys
        os.environ["PYSPARK_PYTHON"] = sys.executable
        import torch
        from pyspark.sql import SparkSession
        from spark_estimator import Store, TorchEstimator
        spark = (SparkSession.builder.master("local-cluster[1,2,4096]")
                 .config("spark.worker.resource.gpu.amount", "1")
                 .config("spark.worker.resource.gpu.discoveryScript", {str(discovery)!r})
                 .config("spark.executor.resource.gpu.amount", "1")
                 .config("spark.task.resource.gpu.amount", "1")
                 .getOrCreate())
        rows = [([float(i % 7), 1.0], float(i % 7)) for i in range(256)]
        df = spark.createDataFrame(rows, "x array<float>, y float")
        net = torch.nn.Linear(2, 1)
        store = Store.create({str(tmp_path / "store")!r})
        est = TorchEstimator(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.01),
                             loss=torch.nn.MSELoss(), feature_cols=["x"], label_cols=["y"],
                             epochs=3, num_proc=1, store=store, use_gpu=True)
        model = est.fit(df)
        ranks = store.read_json(store.join("runs", model.getRunId(), "ranks.json"))
        out = model.transform(df).count()
        print(json.dumps({{"device": ranks[0]["device"], "rows": out,
                          "param_device": next(model.getModel().parameters()).device.type}}))
        spark.stop()
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYSPARK_PYTHON=sys.executable),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"device": "cuda:0", "rows": 256, "param_device": "cpu"}
