"""Digits with a LightningModule: the module's own training_step, validation_step,
configure_optimizers (with a scheduler) and Lightning callbacks, trained on Spark.

Run it with either of:
    PYSPARK_PYTHON=.venv/bin/python .venv/bin/spark-submit --master "local[2]" \
        examples/lightning_digits.py
    .venv/bin/python examples/lightning_digits.py

scikit-learn's 8x8 digit images (no download) become a Spark DataFrame with one Vector
column; LightningEstimator trains the module on --num-proc barrier tasks with DDP, each
batch a dict {"features": images, "label": classes}. EarlyStopping watches the validation
loss and ModelCheckpoint keeps the epoch with the best validation accuracy, whose weights
the fitted model takes. Then accuracy on held-out images, save and load.
Needs Lightning, which ./dev.sh demo does not install: from the repository root,
.venv/bin/pip install -e '.[lightning]' (./dev.sh test installs it too).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
from pyspark.ml.linalg import Vectors
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from sklearn.datasets import load_digits

try:
    import lightning.pytorch as pl
except ImportError:
    sys.exit("lightning_digits.py needs Lightning: .venv/bin/pip install -e '.[lightning]'")

from spark_estimator import LightningEstimator, Store, TorchModel


class DigitsClassifier(pl.LightningModule):
    def __init__(self, lr: float = 3e-3):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Flatten(),
            torch.nn.Linear(16 * 4 * 4, 10),
        )

    def forward(self, images):  # what TorchModel.transform calls
        return self.net(images)

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.cross_entropy(self(batch["features"]), batch["label"])
        return loss  # its epoch mean is the history's train.loss

    def validation_step(self, batch, batch_idx):
        logits = self(batch["features"])
        self.log("val_loss", torch.nn.functional.cross_entropy(logits, batch["label"]))
        self.log("val_acc", (logits.argmax(1) == batch["label"]).float().mean())

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


def spark_session(app_name: str) -> SparkSession:
    builder = SparkSession.builder.appName(app_name).config("spark.ui.showConsoleProgress", "false")
    # Under spark-submit the master comes from its --master or properties file; run as a
    # plain Python script, this picks one.
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        builder = builder.master(os.environ.get("SPARK_MASTER", "local[2]"))
    return builder.getOrCreate()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--store",
        default=os.path.join(tempfile.gettempdir(), "spark-estimator-lightning"),
        help="store folder (default: %(default)s)",
    )
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--num-proc", type=int, default=2)
    args = parser.parse_args(argv)

    # Executors must run the same Python as this driver (and find torch in it).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = spark_session("spark-estimator lightning digits")
    spark.sparkContext.setLogLevel("ERROR")

    digits = load_digits()
    rows = [(Vectors.dense(x / 16.0), int(y)) for x, y in zip(digits.data, digits.target)]
    train, test = spark.createDataFrame(rows, ["features", "label"]).randomSplit([0.8, 0.2], 7)

    estimator = LightningEstimator(
        model=DigitsClassifier(),
        feature_cols=["features"],
        label_cols=["label"],
        input_shapes=[[-1, 1, 8, 8]],
        classification=True,  # transform adds prediction (class index) and probability
        callbacks=[
            pl.callbacks.EarlyStopping(monitor="val_loss", patience=3),
            pl.callbacks.ModelCheckpoint(monitor="val_acc", mode="max"),
        ],
        batch_size=32,
        epochs=args.epochs,
        num_proc=args.num_proc,
        validation=0.2,
        store=Store.create(args.store),
        use_gpu=torch.cuda.is_available(),
        verbose=False,
    )
    model = estimator.fit(train)
    for record in model.getHistory():
        print(
            f"epoch {record['epoch']:2d}  train loss {record['train']['loss']:.4f}  "
            f"val loss {record['validation']['val_loss']:.4f}  "
            f"val acc {record['validation']['val_acc']:.3f}"
        )
    print(f"weights of epoch {model.getTrainingSummary()['selected_epoch']}")

    path = os.path.join(args.store, "models", model.getRunId())
    model.write().overwrite().save(path)
    loaded = TorchModel.load(path)
    scored = loaded.transform(test)
    accuracy = scored.select(F.avg((F.col("prediction") == F.col("label")).cast("double")))
    value, count = accuracy.first()[0], test.count()
    print(f"held-out accuracy: {value:.3f} on {count} images")
    spark.stop()
    return 0 if value >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
