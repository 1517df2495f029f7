"""A tiny GPT-2 language model trained with FSDP on a text column: next-token prediction
on padded token sequences.

Run it with either of:
    PYSPARK_PYTHON=.venv/bin/python .venv/bin/spark-submit --master "local[2]" \
        examples/gpt_language_model.py
    .venv/bin/python examples/gpt_language_model.py

The model is transformers' GPT-2 architecture built from a GPT2Config (2 layers of 64
dimensions, random weights: nothing is downloaded), sharded over the --num-proc Spark
tasks with parallelism="fsdp", each GPT2Block a unit of its own. The text is the topic
sentences of text_classifier.py, with the WordPiece tokenizer trained there. The label
column is a copy of the text column: a decode_fn tokenizes each row once and returns the
tokens as the input (with an [EOS] token in front) and the same tokens shifted by one as
the label (ending with [EOS]). Input batches are padded with 0 and a mask; label batches
with -100, which the loss (cross entropy over every position) ignores. Prints the
training loss and tokens per second of each epoch, then the loss on held-out sentences and
a few sentences the model completes.
Needs transformers and tokenizers, which ./dev.sh demo does not install: from the
repository root, .venv/bin/pip install -e '.[text]' (./dev.sh test installs them too).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile

import torch
from pyspark.sql import SparkSession
from torch import nn
from torch.nn.utils.rnn import pad_sequence

try:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
except ImportError:
    sys.exit("gpt_language_model.py needs transformers: .venv/bin/pip install -e '.[text]'")

from text_classifier import make_sentences, train_tokenizer  # examples/text_classifier.py

from spark_estimator import Store, TorchEstimator

EOS = "[EOS]"  # marks a sentence's start (as the input's first token) and its end


class CausalLM(nn.Module):
    """GPT-2 with the estimator's calling convention: forward(ids, mask) -> logits
    [B, L, vocabulary]. (GPT2LMHeadModel's second positional argument is not the mask.)"""

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.gpt = GPT2LMHeadModel(config)

    def forward(self, ids, mask):
        return self.gpt(input_ids=ids, attention_mask=mask.long()).logits


def next_token_loss(logits, target):
    """Cross entropy of each position's prediction of the next token; the padding of the
    label batches, -100, counts for nothing."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--store",
        default=os.path.join(tempfile.gettempdir(), "spark-estimator-gpt"),
        help="store folder (default: %(default)s)",
    )
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--num-proc", type=int, default=2)
    args = parser.parse_args(argv)

    # Executors must run the same Python as this driver (torch, tokenizers, transformers).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName("spark-estimator tiny GPT-2")
    if "PYSPARK_GATEWAY_PORT" not in os.environ:  # plain Python, not spark-submit: pick a master
        builder = builder.master(os.environ.get("SPARK_MASTER", "local[2]"))
    spark = builder.config("spark.ui.showConsoleProgress", "false").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")

    texts = [text for text, _ in make_sentences(2200, seed=1)]
    train_texts, test_texts = texts[:2000], texts[2000:]
    tokenizer = train_tokenizer(train_texts)
    tokenizer.add_special_tokens([EOS])
    eos = tokenizer.token_to_id(EOS)
    # The label column holds the same text: decode_fn makes it the next tokens.
    df = spark.createDataFrame([(t, t) for t in train_texts], ["text", "next"])

    def tokens(text: str) -> torch.Tensor:
        return torch.tensor([eos, *tokenizer.encode(text).ids, eos], dtype=torch.int64)

    def decode(row: dict, augment) -> dict:
        """On the executors, for each row: the tokens as input, and shifted by one as label."""
        ids = tokens(row["text"])
        return {"text": ids[:-1], "next": ids[1:]}

    config = GPT2Config(
        vocab_size=tokenizer.get_vocab_size(),
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=eos,
        eos_token_id=eos,
    )

    def build() -> nn.Module:
        # Called on each process (with the same seed). Built whole: GPT-2's Conv1D layers
        # have no reset_parameters(), which a model built on torch.device("meta") needs.
        return CausalLM(config)

    estimator = TorchEstimator(
        model=build,
        parallelism="fsdp",
        fsdp_wrap=[GPT2Block],  # each block's parameters gathered only while it computes
        optimizer=torch.optim.AdamW,  # a class: built on the sharded parameters
        learning_rate=3e-3,
        loss=next_token_loss,
        feature_cols=["text"],  # padded: forward(ids, mask)
        label_cols=["next"],  # padded with -100
        decode_fn=decode,
        batch_size=32,
        epochs=args.epochs,
        num_proc=args.num_proc,
        random_seed=0,
        store=Store.create(args.store),
    )
    model = estimator.fit(df)

    # Tokens predicted per epoch: each sentence's tokens and its [EOS].
    predicted = sum(len(tokens(t)) - 1 for t in train_texts)
    print(f"\n{'epoch':>5} {'train loss':>11} {'tokens/s':>9}")
    for record in model.getHistory():
        seconds = max(record["seconds"]["train"])  # the slowest process's training pass
        print(f"{record['epoch']:>5} {record['train']['loss']:>11.4f} {predicted / seconds:>9.0f}")
    summary = model.getTrainingSummary()
    print(
        f"trained with {summary['parallelism']}; parameter elements held per process:",
        [r["parameter_elements"] for r in summary["rank_memory"]],
    )

    lm = model.getModel().eval()  # the gathered weights, an ordinary module on the driver
    with torch.no_grad():
        # The held-out sentences as one batch, padded as the training batches were.
        test = [tokens(t) for t in test_texts]
        inputs = pad_sequence([ids[:-1] for ids in test], batch_first=True, padding_value=0)
        target = pad_sequence([ids[1:] for ids in test], batch_first=True, padding_value=-100)
        held_out = next_token_loss(lm(inputs, target != -100), target).item()
        print(
            f"\nheld-out loss: {held_out:.4f} (perplexity {math.exp(held_out):.1f}; "
            f"guessing uniformly: {math.log(config.vocab_size):.4f})"
        )
        for prompt in ["the chef", "yesterday the", "did you hear that the"]:
            ids = tokens(prompt)[:-1]  # [EOS] and the prompt's tokens
            for _ in range(12):  # greedy: the likeliest next token, until [EOS]
                nxt = int(lm(ids[None], torch.ones(1, len(ids), dtype=torch.bool))[0, -1].argmax())
                if nxt == eos:
                    break
                ids = torch.cat([ids, torch.tensor([nxt])])
            print(f"  {prompt!r} -> {tokenizer.decode(ids[1:].tolist())!r}")
    spark.stop()
    return 0 if held_out < 0.6 * math.log(config.vocab_size) else 1


if __name__ == "__main__":
    sys.exit(main())
