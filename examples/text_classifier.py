"""Text classifier: a small transformer encoder on a string column, tokenized a batch at a
time by a decode_batch_fn, with batches padded to their longest sentence and a mask.

Run it with either of:
    PYSPARK_PYTHON=.venv/bin/python .venv/bin/spark-submit --master "local[2]" \
        examples/text_classifier.py
    .venv/bin/python examples/text_classifier.py

It makes 2,000 sentences about four topics (sports, weather, food, technology) from
templates, with noise: words of another topic and typos. Nothing is downloaded: a WordPiece
tokenizer (the tokenizers package) is trained on the training sentences, and a
decode_batch_fn turns each batch's texts into token ids on the executors with the
tokenizer's encode_batch (its own threads, without the GIL), one 1-D int64 tensor per
row. The batches are padded to their longest row, so the model's forward(ids, mask) gets
the ids and a mask (True at each row's own tokens): the encoder ignores the padding
(src_key_padding_mask=~mask) and so does the mean over the tokens. Prints the per-epoch
history and the held-out accuracy of model.transform, scored by Spark ML's
MulticlassClassificationEvaluator.
Needs tokenizers, which ./dev.sh demo does not install: from the repository root,
.venv/bin/pip install -e '.[text]' (./dev.sh test installs it too).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile

import numpy as np
import torch
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.sql import SparkSession
from torch import nn

try:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
except ImportError:
    sys.exit("text_classifier.py needs tokenizers: .venv/bin/pip install -e '.[text]'")

from spark_estimator import Store, TorchEstimator

# Each topic's nouns, verbs and adjectives; a sentence's label is its topic's position.
TOPICS = {
    "sports": {
        "noun": "team coach match goal player season league referee stadium striker",
        "verb": "won lost scored defended trained cheered",
        "adj": "fast tired unbeaten injured",
    },
    "weather": {
        "noun": "rain storm wind sunshine cloud forecast snow fog thunder temperature",
        "verb": "fell rose cleared poured froze blew",
        "adj": "cold humid stormy sunny",
    },
    "food": {
        "noun": "soup bread recipe chef dinner cheese salad pasta oven spice",
        "verb": "baked tasted cooked served burnt seasoned",
        "adj": "delicious salty spicy fresh",
    },
    "technology": {
        "noun": "software laptop network server phone chip update code battery screen",
        "verb": "crashed booted compiled charged installed rebooted",
        "adj": "slow wireless encrypted digital",
    },
}
TEMPLATES = [
    "the {noun} {verb} {when}",
    "{when} the {adj} {noun} {verb} again",
    "did you hear that the {noun} {verb} {when} ?",
    "i think the {noun} was too {adj} and the {noun} {verb}",
    "nobody expected the {noun} to be so {adj}",
    "after the {noun} {verb} , everyone talked about the {adj} {noun} {when}",
    "my friend says the {noun} is {adj}",
]
WHEN = ["today", "yesterday", "last night", "this morning", "on sunday", "at last"]


def make_sentences(count: int, seed: int = 0, noise: float = 0.15) -> list[tuple[str, int]]:
    """``count`` (sentence, topic index) pairs from the templates: each slot filled with a
    word of the sentence's topic, or with probability ``noise`` of any topic, and a word
    in 20 (at ``noise=0.15``) misspelt, a letter dropped."""
    rng = np.random.default_rng(seed)
    names = list(TOPICS)

    def word(topic: str, kind: str) -> str:
        if kind == "when":
            return str(rng.choice(WHEN))
        if rng.random() < noise:
            topic = str(rng.choice(names))
        return str(rng.choice(TOPICS[topic][kind].split()))

    def misspelt(w: str) -> str:
        if len(w) > 3 and rng.random() < noise / 3:
            i = int(rng.integers(len(w)))
            return w[:i] + w[i + 1 :]
        return w

    out = []
    for _ in range(count):
        label = int(rng.integers(len(names)))
        template = str(rng.choice(TEMPLATES))
        text = re.sub(r"{(\w+)}", lambda slot, t=names[label]: word(t, slot[1]), template)
        out.append((" ".join(misspelt(w) for w in text.split()).capitalize(), label))
    return out


def train_tokenizer(texts: list[str], vocab_size: int = 400) -> Tokenizer:
    """A WordPiece tokenizer (lower-cased, split on spaces and punctuation) trained on
    ``texts``; "[PAD]" is id 0, the estimator's default padding_value, and a word it has
    not seen becomes known pieces (a typo: "stadum" -> "st", "##ad", "##um")."""
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()  # tokenizer.decode joins "##" pieces again
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=["[PAD]", "[UNK]"], show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


class TextClassifier(nn.Module):
    """Token and position embeddings, a TransformerEncoder, the mean over each row's own
    tokens, then class logits."""

    def __init__(self, vocab_size: int, classes: int, dim: int = 64, max_len: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim, padding_idx=0)
        self.position = nn.Embedding(max_len, dim)
        layer = nn.TransformerEncoderLayer(
            dim, nhead=4, dim_feedforward=2 * dim, dropout=0.1, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, ids, mask):  # [B, L] token ids, [B, L] True at each row's own tokens
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.encoder(self.embed(ids) + self.position(positions), src_key_padding_mask=~mask)
        weights = mask.unsqueeze(-1).to(x.dtype)  # the mean leaves the padding out too
        return self.head((x * weights).sum(1) / weights.sum(1).clamp(min=1))


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
        default=os.path.join(tempfile.gettempdir(), "spark-estimator-text"),
        help="store folder (default: %(default)s)",
    )
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--num-proc", type=int, default=2)
    args = parser.parse_args(argv)

    # Executors must run the same Python as this driver (and find torch and tokenizers).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = spark_session("spark-estimator text classifier")
    spark.sparkContext.setLogLevel("ERROR")

    sentences = make_sentences(2000)
    train, test = spark.createDataFrame(sentences, ["text", "label"]).randomSplit(
        [0.8, 0.2], seed=7
    )
    tokenizer = train_tokenizer([row.text for row in train.select("text").collect()])
    print("a sentence and its tokens:", sentences[0][0], tokenizer.encode(sentences[0][0]).tokens)

    def tokenize(rows: dict, augments) -> dict:
        """On the executors, once per batch: rows["text"] is the batch's texts, each
        turned into a 1-D tensor of token ids, which the batch pads (with padding_value 0,
        "[PAD]") and masks. augments (each row's random generator in training) is unused:
        the text is not augmented.

        The tokenizer, trained above on the driver, travels with this function: it is
        pickled with it, and each decode worker unpickles its copy once. A tokenizer to
        load on the executors instead (a file they all read, a model hub) would be loaded
        once per worker by a decode_init_fn that sets a global this function reads."""
        encodings = tokenizer.encode_batch(rows["text"])
        return {"text": [torch.tensor(e.ids, dtype=torch.int64) for e in encodings]}

    torch.manual_seed(0)
    net = TextClassifier(tokenizer.get_vocab_size(), classes=len(TOPICS))
    estimator = TorchEstimator(
        model=net,
        optimizer=torch.optim.AdamW(net.parameters(), lr=2e-3),
        loss=nn.CrossEntropyLoss(),
        feature_cols=["text"],  # one padded column: forward(ids, mask)
        label_cols=["label"],
        decode_batch_fn=tokenize,  # per row instead: decode_fn(row, augment)
        classification=True,  # transform adds prediction, probability and rawPrediction
        metrics={"accuracy": lambda logits, label: (logits.argmax(1) == label).float().mean()},
        batch_size=32,
        epochs=args.epochs,
        num_proc=args.num_proc,
        validation=0.1,
        random_seed=42,
        store=Store.create(args.store),
    )
    model = estimator.fit(train)

    print(f"\n{'epoch':>5} {'train loss':>11} {'val loss':>9} {'val accuracy':>13}")
    for record in model.getHistory():
        val = record["validation"]
        print(
            f"{record['epoch']:>5} {record['train']['loss']:>11.4f} {val['loss']:>9.4f} "
            f"{val['accuracy']:>13.3f}"
        )
    padding = model.getTrainingSummary()["padding"]  # of the batches, padded to their longest
    print(f"padding: {padding['share']:.0%} of the padded batches' values")

    evaluator = MulticlassClassificationEvaluator(metricName="accuracy")  # label, prediction
    held_out = evaluator.evaluate(model.transform(test))
    print(f"\nheld-out accuracy: {held_out:.3f} on {test.count()} sentences (chance: 0.25)")
    spark.stop()
    return 0 if held_out >= 0.8 else 1


if __name__ == "__main__":
    sys.exit(main())
