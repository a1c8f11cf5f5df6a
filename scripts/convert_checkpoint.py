"""Convert a checkpoint's model weights: DCP -> Hugging Face folder, DCP -> one torch file, HF -> DCP.

    python scripts/convert_checkpoint.py outputs/checkpoint/step-1000 outputs/hf-1000               # safetensors
    python scripts/convert_checkpoint.py outputs/checkpoint/step-1000 outputs/hf-1000 --export-dtype bfloat16
    python scripts/convert_checkpoint.py outputs/checkpoint/step-1000 model.pt --format torch
    python scripts/convert_checkpoint.py Llama-3.1-8B/ outputs/init-dcp --format dcp --model.flavor 8B

The source of a DCP conversion is one checkpoint folder (`step-<N>`, with DCP's `.metadata`) whose model weights are the
keys `model.<fqn>` (titan_dmuon/components/checkpoint/manager.py saves them so). The model configuration is the job's:
the TOML saved with the checkpoint (`config.toml` in the step folder or its parent), else `--config PATH`, else the
defaults; any `--section.field value` of train.py overrides it (`--model.flavor 8B`). The vocabulary size is read from
the checkpoint's tensors. An HF folder also gets the job's tokenizer (`model.tokenizer`: the byte tokenizer's Hugging
Face form, or a copy of the HF tokenizer's files; `--model.tokenizer PATH` where the saved path does not resolve here,
`--no-tokenizer` for the weights alone), its BOS/EOS/PAD ids in config.json and a generation_config.json. No process
group is started: tensors are read from the checkpoint in groups of at most `--max-shard-size` bytes and written as
safetensors shards of at most that size, so memory stays within a few times the larger of that size and the largest
tensor, whatever the model's size (`--format torch` writes one file and so holds the whole model; so does
`--format dcp`). The conversions are titan_dmuon/components/checkpoint/convert.py's (`checkpoint.last_save_in_hf` runs
the same one after training). Checkpoints are read as a resume reads them (titan_dmuon/components/checkpoint/dcp_io.py):
no code is unpickled (a `.metadata` naming other classes is refused). Errors (not a checkpoint, another model
configuration) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "fp32": "float32", "bf16": "bfloat16"}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB', '500MiB', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, flags=re.IGNORECASE)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Other --section.field flags (train.py's config) override the model configuration.",
    )
    parser.add_argument("src", type=Path, help="a DCP checkpoint folder (step-<N>), or an HF folder for --format dcp")
    parser.add_argument("dst", type=Path, help="the output folder (hf, dcp) or file (torch)")
    parser.add_argument("--format", choices=("hf", "torch", "dcp"), default="hf", help="what to write (default hf)")
    parser.add_argument("--export-dtype", choices=sorted(_DTYPES), default=None, help="cast (default: keep)")
    parser.add_argument("--max-shard-size", type=parse_size, default="5GB", help="bytes per safetensors file (5GB)")
    parser.add_argument("--config", default=None, help="the job's TOML (default: the one saved with the checkpoint)")
    parser.add_argument(
        "--no-tokenizer", action="store_true", help="hf: the weights and config.json alone, no tokenizer files"
    )
    args, overrides = parser.parse_known_args(argv)

    import torch

    from titan_dmuon.components.checkpoint.convert import (
        ExportError,
        dcp_to_torch,
        export_dcp_to_hf,
        hf_to_dcp,
        job_config,
    )

    dtype = None if args.export_dtype is None else getattr(torch, _DTYPES[args.export_dtype])
    try:
        cfg = job_config(args.src, args.config, overrides)
        what = f"{cfg.model.name} {cfg.model.flavor}"
        if args.format == "dcp":
            n = hf_to_dcp(args.src, args.dst, cfg, dtype=dtype)
            print(f"wrote {args.dst} (DCP, {n} tensors under model.*, {what})")
        elif args.format == "torch":
            n = dcp_to_torch(args.src, args.dst, cfg, dtype=dtype, max_read_bytes=args.max_shard_size)
            print(f"wrote {args.dst} ({n} tensors, {what})")
        else:
            files = export_dcp_to_hf(
                args.src,
                args.dst,
                cfg,
                dtype=dtype,
                max_shard_bytes=args.max_shard_size,
                tokenizer=not args.no_tokenizer,
            )
            extra = "" if args.no_tokenizer else f" + the tokenizer ({cfg.model.tokenizer}) + generation_config.json"
            print(f"wrote {args.dst}: {len(files)} safetensors file(s) + config.json{extra} ({what})")
    except ExportError as e:
        print(f"convert_checkpoint: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
