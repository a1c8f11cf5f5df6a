"""Tokenize a corpus once into token shards that training memory-maps (``training.dataset = "tokens"``).

    python scripts/prepare_data.py --dataset jsonl --dataset-path 'data/c4/*.jsonl' --tokenizer tok/ \\
        --output data/c4_tokens --workers 16
    python train.py --config train_configs/llama3_8b.toml --training.dataset tokens \\
        --training.dataset_path data/c4_tokens --model.tokenizer tok/

Reads text (.txt/.md: a document per paragraph, or per file with --text-documents file), JSONL
(--dataset-field of each line), parquet (column --dataset-field), the stdlib corpus, or any local dataset
the Hugging Face `datasets` library reads (--dataset hf, if it is installed). The corpus is cut into units
(byte ranges, files, row groups, row ranges) that worker processes tokenize in parallel (``BOS text EOS``
per document); the main process writes them in order, so the output does not depend on --workers.
Each document goes to the "val" split when the CRC32 of its text falls below --val-fraction (the rule the
raw loader uses), else to "train". The output folder holds ``<split>-NNNNN.bin`` (tokens, uint16 or uint32
by vocabulary size), ``<split>-NNNNN.idx`` (int64 document offsets) and ``manifest.json`` (tokenizer
fingerprint, dtype, documents and tokens per shard); see titan_dmuon/data/shards.py. Exit status 2 on bad
input, with a message naming the file (and line).
"""

from __future__ import annotations

import argparse
import glob
import logging
import multiprocessing
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from titan_dmuon.data import (  # noqa: E402
    MANIFEST,
    DataError,
    HFDatasetSource,
    ShardWriter,
    build_raw_source,
    build_tokenizer,
    in_val_split,
    token_dtype,
    write_manifest,
)
from titan_dmuon.data.shards import SPLITS, check_vocab_fits  # noqa: E402

logger = logging.getLogger("prepare_data")
PREPARE_DATASETS = ("stdlib", "text", "jsonl", "parquet", "hf")

_WORK: dict[str, Any] = {}  # each worker process's source, tokenizer, dtype and val fraction


def _init_worker(source, tokenizer_spec: str, dtype: str, val_fraction: float) -> None:
    _WORK.update(source=source, tokenizer=build_tokenizer(tokenizer_spec), dtype=dtype, val_fraction=val_fraction)


def _tokenize_unit(u: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Unit ``u``'s documents tokenized, per split: (tokens back to back, each document's length)."""
    tok, dtype = _WORK["tokenizer"], _WORK["dtype"]
    out: dict[str, tuple[list[np.ndarray], list[int]]] = {split: ([], []) for split in SPLITS}
    for text in _WORK["source"].texts(u):
        toks = tok.encode_array(text, bos=True, eos=True)
        pieces, lengths = out["val" if in_val_split(text, _WORK["val_fraction"]) else "train"]
        pieces.append(toks)
        lengths.append(len(toks))
    return {
        split: (
            np.concatenate(pieces).astype(dtype) if pieces else np.empty(0, dtype),
            np.asarray(lengths, dtype=np.int64),
        )
        for split, (pieces, lengths) in out.items()
    }


def _source(dataset: str, dataset_path: str, dataset_field: str, text_documents: str, hf_split: str, min_units: int):
    if dataset == "hf":
        return HFDatasetSource(dataset_path, dataset_field, hf_split)
    if dataset not in PREPARE_DATASETS:
        raise DataError(f"unknown dataset kind {dataset!r}; choose one of {PREPARE_DATASETS}")
    return build_raw_source(dataset, dataset_path, dataset_field, text_documents=text_documents, min_units=min_units)


def _clear(output: str, overwrite: bool) -> None:
    if os.path.exists(os.path.join(output, MANIFEST)) and not overwrite:
        raise DataError(f"{output} already holds prepared data ({MANIFEST}); pass --overwrite or another --output")
    os.makedirs(output, exist_ok=True)
    for path in glob.glob(os.path.join(output, MANIFEST)) + glob.glob(os.path.join(output, "*-[0-9]*.[bi][id]*")):
        os.remove(path)


def prepare(
    *,
    dataset: str,
    dataset_path: str = "",
    dataset_field: str = "text",
    tokenizer: str = "byte",
    output: str,
    workers: int = 1,
    val_fraction: float = 0.02,
    shard_tokens: int = 1 << 28,
    dtype: str = "auto",
    text_documents: str = "blank_line",
    hf_split: str = "train",
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenize ``dataset`` into ``output``; returns the manifest. Raises ``DataError`` on bad input."""
    tok = build_tokenizer(tokenizer)
    token_type = token_dtype(tok.vocab_size) if dtype == "auto" else np.dtype(dtype)
    check_vocab_fits(tok.vocab_size, token_type, f"--dtype {dtype}")
    source = _source(dataset, dataset_path, dataset_field, text_documents, hf_split, min_units=16 * max(1, workers))
    _clear(output, overwrite)
    writers = {split: ShardWriter(output, split, token_type, shard_tokens) for split in SPLITS}
    init = (source, tokenizer, token_type.name, val_fraction)
    start, docs, tokens = time.perf_counter(), 0, 0
    from tqdm import tqdm

    bar = tqdm(total=len(source), unit="unit", desc=f"tokenizing {source.description}", disable=not progress)
    if workers > 1:
        pool = multiprocessing.get_context("fork").Pool(workers, initializer=_init_worker, initargs=init)
        results = pool.imap(_tokenize_unit, range(len(source)), chunksize=1)
    else:
        pool = None
        _init_worker(*init)
        results = map(_tokenize_unit, range(len(source)))
    try:
        for result in results:
            for split, (toks, lengths) in result.items():
                writers[split].add(toks, lengths)
                docs, tokens = docs + len(lengths), tokens + len(toks)
            bar.update(1)
            bar.set_postfix(docs=docs, tokens=tokens, refresh=False)
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
    splits = {split: writer.close() for split, writer in writers.items()}
    if docs == 0:
        raise DataError(f"{source.description}: no documents (empty or blank); nothing to prepare")
    manifest = {
        "dtype": token_type.name,
        "tokenizer": {
            "spec": tokenizer,
            "fingerprint": tok.fingerprint,
            "vocab_size": tok.vocab_size,
            "bos_id": tok.bos_id,
            "eos_id": tok.eos_id,
        },
        "source": {"dataset": dataset, "path": dataset_path, "field": dataset_field, "description": source.description},
        "val_fraction": val_fraction,
        "documents": docs,
        "tokens": tokens,
        "splits": splits,
    }
    write_manifest(output, manifest)
    elapsed = time.perf_counter() - start
    logger.info(
        "wrote %s: %d documents, %d tokens (%s; train %d docs in %d shards, val %d docs) in %.1f s, %.3g tokens/s",
        output,
        docs,
        tokens,
        token_type.name,
        splits["train"]["documents"],
        len(splits["train"]["shards"]),
        splits["val"]["documents"],
        elapsed,
        tokens / max(elapsed, 1e-9),
    )
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="jsonl", choices=PREPARE_DATASETS)
    p.add_argument("--dataset-path", default="", help="file, folder or glob (quoted); for hf a local dataset")
    p.add_argument("--dataset-field", default="text", help="JSONL field / parquet or hf column holding the text")
    p.add_argument("--text-documents", default="blank_line", choices=("blank_line", "file"))
    p.add_argument("--hf-split", default="train", help="split of a Hugging Face dataset to read")
    p.add_argument("--tokenizer", default="byte", help="'byte' or a tokenizer.json (or its folder)")
    p.add_argument("--output", required=True, help="folder to write (training.dataset_path)")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    p.add_argument("--val-fraction", type=float, default=0.02, help="fraction of documents held out for validation")
    p.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per shard file (default 2^28)")
    p.add_argument("--dtype", default="auto", choices=("auto", "uint16", "uint32"))
    p.add_argument("--overwrite", action="store_true", help="replace prepared data already in --output")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        prepare(
            dataset=a.dataset,
            dataset_path=a.dataset_path,
            dataset_field=a.dataset_field,
            tokenizer=a.tokenizer,
            output=a.output,
            workers=a.workers,
            val_fraction=a.val_fraction,
            shard_tokens=a.shard_tokens,
            dtype=a.dtype,
            text_documents=a.text_documents,
            hf_split=a.hf_split,
            overwrite=a.overwrite,
            progress=not a.no_progress,
        )
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
