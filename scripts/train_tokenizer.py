"""Train a byte-level BPE tokenizer (HF ``tokenizers``) on one of the framework's datasets.

    python scripts/train_tokenizer.py --dataset stdlib --vocab-size 4096 --max-docs 500 --output tok/tokenizer.json

The result loads with ``titan_dmuon.data.build_tokenizer(path)``: a ``tokenizer.json`` and, beside it, the
``tokenizer_config.json`` that names BOS/EOS (``<|begin_of_text|>`` and ``<|end_of_text|>``). Only the train
split is used, so validation text stays unseen.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from titan_dmuon.data import build_source, iter_documents  # noqa: E402

logger = logging.getLogger("train_tokenizer")

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def train_tokenizer(
    *,
    dataset: str = "stdlib",
    dataset_path: str = "",
    dataset_field: str = "text",
    vocab_size: int = 4096,
    max_docs: int | None = None,
    output: str = "tokenizer.json",
    min_frequency: int = 2,
) -> str:
    """Train and write ``output`` (a ``tokenizer.json``; a directory gets one inside) and the
    ``tokenizer_config.json`` beside it. Returns the ``tokenizer.json`` path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    source = build_source(dataset, dataset_path, dataset_field, split="train")
    tok.train_from_iterator(iter_documents(source, max_docs=max_docs), trainer=trainer)
    # Training sees every document as [BOS] text EOS (titan_dmuon/data/tokenizer.py adds them itself); the
    # tokenizer's own template prepends BOS too, so that transformers' AutoTokenizer (on an export) encodes a
    # prompt as the model saw text begin.
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    if os.path.isdir(output) or output.endswith(os.sep):
        output = os.path.join(output, "tokenizer.json")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    tok.save(output)
    with open(os.path.join(os.path.dirname(os.path.abspath(output)), "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS}, f, indent=1)
    logger.info("wrote %s (vocab %d)", output, tok.get_vocab_size())
    return output


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="stdlib", help="stdlib | text | jsonl | parquet")
    p.add_argument("--dataset-path", default="", help="file or directory (not needed for stdlib)")
    p.add_argument("--dataset-field", default="text", help="JSONL field / parquet column")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--max-docs", type=int, default=None, help="train on at most this many documents")
    p.add_argument("--min-frequency", type=int, default=2)
    p.add_argument("--output", default="tokenizer.json")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = train_tokenizer(
        dataset=a.dataset,
        dataset_path=a.dataset_path,
        dataset_field=a.dataset_field,
        vocab_size=a.vocab_size,
        max_docs=a.max_docs,
        output=a.output,
        min_frequency=a.min_frequency,
    )
    print(path)


if __name__ == "__main__":
    main()
