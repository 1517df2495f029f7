"""Demo: train a small CNN on scikit-learn's bundled digits with 2 Spark tasks.

Run it with either of:
    ./dev.sh demo
    PYSPARK_PYTHON=.venv/bin/python .venv/bin/spark-submit --master "local[2]" \
        examples/digits_classifier.py

It fits on 80% of the 1,797 images (20% of those held out for validation), prints the
per-epoch history, measures accuracy on the remaining 20%, saves the model, loads it back
and shows a few predictions. Re-running reuses the Parquet data already in the store.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.ml.linalg import Vectors
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from sklearn.datasets import load_digits

from spark_estimator import Store, TorchEstimator, TorchModel
from spark_estimator.callbacks import BestModel


def spark_session(app_name: str) -> SparkSession:
    builder = SparkSession.builder.appName(app_name).config("spark.ui.showConsoleProgress", "false")
    # Under spark-submit the master comes from its --master or properties file; run as a
    # plain Python script, this picks one.
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        builder = builder.master(os.environ.get("SPARK_MASTER", "local[2]"))
    return builder.getOrCreate()


def digits_frame(spark: SparkSession):
    digits = load_digits()
    rows = [(Vectors.dense(x), int(y)) for x, y in zip(digits.data / 16.0, digits.target)]
    return spark.createDataFrame(rows, ["features", "label"])


def make_net() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, kernel_size=3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, kernel_size=3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 4 * 4, 10),
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--store",
        default=os.path.join(tempfile.gettempdir(), "spark-estimator-demo"),
        help="store folder (default: %(default)s)",
    )
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--num-proc", type=int, default=2)
    args = parser.parse_args(argv)

    # Executors must run the same Python as this driver (and find torch in it).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = spark_session("spark-estimator digits demo")
    spark.sparkContext.setLogLevel("ERROR")

    train, test = digits_frame(spark).randomSplit([0.8, 0.2], seed=7)
    torch.manual_seed(0)
    net = make_net()
    estimator = TorchEstimator(
        model=net,
        optimizer=torch.optim.Adam(net.parameters(), lr=2e-3),
        loss=torch.nn.CrossEntropyLoss(),
        feature_cols=["features"],
        label_cols=["label"],
        input_shapes=[[-1, 1, 8, 8]],
        batch_size=32,
        epochs=args.epochs,
        num_proc=args.num_proc,
        validation=0.2,
        random_seed=42,
        # labels are class indices; transform adds prediction, probability, rawPrediction
        classification=True,
        store=Store.create(args.store),
        # averaged over every row of every process, once per epoch
        metrics={"accuracy": lambda logits, label: (logits.argmax(1) == label).float().mean()},
        # the fitted model holds the weights of the epoch with the best validation accuracy
        callbacks=[BestModel(monitor="validation.accuracy", mode="max")],
    )
    model = estimator.fit(train)

    print(f"\n{'epoch':>5} {'train loss':>11} {'val loss':>9} {'val accuracy':>13}")
    for record in model.getHistory():
        val = record["validation"]
        print(
            f"{record['epoch']:>5} {record['train']['loss']:>11.4f} {val['loss']:>9.4f} "
            f"{val['accuracy']:>13.3f}"
        )
    print(f"model weights from epoch {model.getTrainingSummary()['selected_epoch']}")

    evaluator = MulticlassClassificationEvaluator(metricName="accuracy")
    held_out = evaluator.evaluate(model.transform(test))
    print(f"\nheld-out accuracy: {held_out:.3f} on {test.count()} images")

    path = os.path.join(args.store, "models", "digits")
    model.write().overwrite().save(path)
    loaded = TorchModel.load(path)
    print(f"saved to {path} and loaded back; a few predictions from the loaded model:")
    sample = loaded.transform(test.limit(8)).select(
        "label", F.col("prediction").cast("int").alias("predicted")
    )
    for row in sample.collect():
        print(f"  label {row.label}  predicted {row.predicted}")
    spark.stop()
    return 0 if held_out >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
