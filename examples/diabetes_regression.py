"""Tabular regression: predict diabetes progression from 10 clinical features.

Run it with either of:
    PYSPARK_PYTHON=.venv/bin/python .venv/bin/spark-submit --master "local[2]" \
        examples/diabetes_regression.py
    .venv/bin/python examples/diabetes_regression.py

scikit-learn's diabetes data (442 patients, no download) becomes a Spark DataFrame; Spark
ML's VectorAssembler and StandardScaler turn its columns into one scaled feature vector.
A small MLP is fitted on 80% of the rows (20% of those held out for validation, and the
weights of the epoch with the lowest validation loss kept), then the held-out 20% are
scored with Spark ML's RegressionEvaluator: RMSE (in the target's units) and R^2, next to
the RMSE of always predicting the training mean. The model is saved and loaded back.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
from pyspark.ml import Pipeline
from pyspark.ml.evaluation import RegressionEvaluator
from pyspark.ml.feature import StandardScaler, VectorAssembler
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from sklearn.datasets import load_diabetes

from spark_estimator import Store, TorchEstimator, TorchModel
from spark_estimator.callbacks import BestModel


def spark_session(app_name: str) -> SparkSession:
    builder = SparkSession.builder.appName(app_name).config("spark.ui.showConsoleProgress", "false")
    # Under spark-submit the master comes from its --master or properties file; run as a
    # plain Python script, this picks one.
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        builder = builder.master(os.environ.get("SPARK_MASTER", "local[2]"))
    return builder.getOrCreate()


def diabetes_frame(spark: SparkSession):
    """One row per patient: the 10 feature columns and the double column 'target'."""
    data = load_diabetes(as_frame=True).frame
    return spark.createDataFrame(data)


def make_net(inputs: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(inputs, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 1),  # one output per row: transform() gives a double column
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--store",
        default=os.path.join(tempfile.gettempdir(), "spark-estimator-diabetes"),
        help="store folder (default: %(default)s)",
    )
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--num-proc", type=int, default=2)
    args = parser.parse_args(argv)

    # Executors must run the same Python as this driver (and find torch in it).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = spark_session("spark-estimator diabetes regression")
    spark.sparkContext.setLogLevel("ERROR")

    df = diabetes_frame(spark)
    feature_names = [c for c in df.columns if c != "target"]
    train, test = df.randomSplit([0.8, 0.2], seed=7)

    # Scale the features (fitted on the training rows only) ...
    prep = Pipeline(
        stages=[
            VectorAssembler(inputCols=feature_names, outputCol="raw_features"),
            StandardScaler(inputCol="raw_features", outputCol="features", withMean=True),
        ]
    ).fit(train)
    # ... and the target: the network learns (target - mean) / std.
    mean, std = train.select(F.mean("target"), F.stddev("target")).first()
    scaled_label = ((F.col("target") - mean) / std).alias("label")
    train_rows = prep.transform(train).select("features", scaled_label)

    torch.manual_seed(0)
    net = make_net(len(feature_names))
    estimator = TorchEstimator(
        model=net,
        optimizer=torch.optim.Adam(net.parameters(), lr=3e-3, weight_decay=1e-3),
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["label"],
        batch_size=16,
        epochs=args.epochs,
        num_proc=args.num_proc,
        validation=0.2,
        random_seed=42,
        store=Store.create(args.store),
        use_gpu=False,
        # the fitted model holds the weights of the epoch with the lowest validation loss
        callbacks=[BestModel(monitor="validation.loss", mode="min")],
    )
    model = estimator.fit(train_rows)

    print(f"\n{'epoch':>5} {'train loss':>11} {'val loss':>9}")
    for record in model.getHistory():
        print(
            f"{record['epoch']:>5} {record['train']['loss']:>11.4f} "
            f"{record['validation']['loss']:>9.4f}"
        )
    print(f"model weights from epoch {model.getTrainingSummary()['selected_epoch']}")

    # Score the held-out rows in the target's own units.
    scored = model.transform(prep.transform(test)).withColumn(
        "predicted", F.col("prediction") * std + mean
    )
    evaluator = RegressionEvaluator(labelCol="target", predictionCol="predicted")
    rmse = evaluator.setMetricName("rmse").evaluate(scored)
    r2 = evaluator.setMetricName("r2").evaluate(scored)
    baseline = evaluator.setMetricName("rmse").evaluate(test.withColumn("predicted", F.lit(mean)))
    print(f"\nheld-out RMSE: {rmse:.2f}  R^2: {r2:.3f} on {test.count()} rows")
    print(f"(always predicting the training mean {mean:.1f}: RMSE {baseline:.2f})")

    path = os.path.join(args.store, "models", "diabetes")
    model.write().overwrite().save(path)
    loaded = TorchModel.load(path)
    again = loaded.transform(prep.transform(test)).withColumn(
        "predicted", F.col("prediction") * std + mean
    )
    same = abs(rmse - evaluator.setMetricName("rmse").evaluate(again)) < 1e-6
    print(f"saved to {path} and loaded back; same held-out RMSE: {same}")
    spark.stop()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
