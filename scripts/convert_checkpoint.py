"""Convert a checkpoint's model weights: DCP -> Hugging Face folder, DCP -> one torch file, HF -> DCP.

    python scripts/convert_checkpoint.py outputs/checkpoint/step-1000 outputs/hf-1000               # safetensors
    python scripts/convert_checkpoint.py outputs/checkpoint/step-1000 outputs/hf-1000 --export-dtype bfloat16
    python scripts/convert_checkpoint.py outputs/checkpoint/step-1000 model.pt --format torch
    python scripts/convert_checkpoint.py Llama-3.1-8B/ outputs/init-dcp --format dcp --model.flavor 8B

The source of a DCP conversion is one checkpoint folder (`step-<N>`, with DCP's `.metadata`) whose model weights
are the keys `model.<fqn>` (titan_dmuon/components/checkpoint.py saves them so). The model configuration is the job's:
the TOML saved with the checkpoint (`config.toml` in the step folder or its parent), else `--config PATH`, else the
defaults; any `--section.field value` of train.py overrides it (`--model.flavor 8B`). The vocabulary size is read
from the checkpoint's tensors. No process group is started: tensors are read from the checkpoint in groups of
at most `--max-shard-size` bytes and written as safetensors shards of at most that size, so memory stays within
a few times the larger of that size and the largest tensor, whatever the model's size (`--format torch` writes
one file and so holds the whole model; so does `--format dcp`).
Checkpoints are read as titan_dmuon/components/checkpoint.py loads them: no code is unpickled (a `.metadata` naming
other classes is refused). Errors (not a checkpoint, another model configuration) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "fp32": "float32", "bf16": "bfloat16"}
_VOCAB_PROBE = 999_983  # a prime no other dimension of a model equals: where it shows up, the vocabulary is
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


class ConversionError(Exception):
    """A source or configuration that cannot be converted; the message says what and the fix."""


def parse_size(text: str) -> int:
    """'5GB', '500MiB', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, flags=re.IGNORECASE)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


def find_saved_config(src: Path) -> Path | None:
    """The job config saved with a checkpoint: `config.toml` in the step folder or its parent, or the only
    *.toml in the step folder."""
    for path in (src / "config.toml", src.parent / "config.toml"):
        if path.is_file():
            return path
    tomls = sorted(src.glob("*.toml"))
    return tomls[0] if len(tomls) == 1 else None


def job_config(src: Path, config: str | None, overrides: list[str]):
    """The JobConfig of the checkpoint: `--config` or the saved TOML (else defaults), then the overrides."""
    from titan_dmuon.config import ConfigError, parse_args

    path = config or find_saved_config(src)
    try:
        return parse_args((["--config", str(path)] if path else []) + overrides)
    except ConfigError as e:
        raise ConversionError(f"config: {e}") from None


def build_meta(cfg, shape_of: Callable[[str], tuple[int, ...] | None]):
    """(model on meta, its spec) for `cfg`, with the vocabulary size the checkpoint's tensors have: a first
    build with a probe vocabulary finds which dimensions are the vocabulary, `shape_of(fqn)` gives their size."""
    from titan_dmuon.components.model import build_meta_model, check_flavor, get_model_spec

    try:
        spec = get_model_spec(cfg.model.name)
        check_flavor(spec, cfg.model.flavor)
    except ValueError as e:
        raise ConversionError(str(e)) from None
    probe = build_meta_model(spec, cfg, _VOCAB_PROBE)
    vocab = None
    for fqn, t in probe.state_dict().items():
        shape = shape_of(fqn)
        for dim, size in enumerate(t.shape):
            if size == _VOCAB_PROBE and shape is not None and dim < len(shape):
                vocab = shape[dim]
                break
        if vocab is not None:
            break
    model = probe if vocab is None else build_meta_model(spec, cfg, vocab)
    return model, spec


def check_shapes(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], src: Path, what: str):
    """ConversionError naming the keys the model and the checkpoint disagree on."""
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    wrong = [f"{k} {list(found[k])} (model: {list(s)})" for k, s in expected.items() if k in found and found[k] != s]
    problems = []
    for label, keys in (("missing", missing), ("not in the model", unexpected), ("other shape", wrong)):
        if keys:
            problems.append(f"{label}: {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''}")
    if problems:
        raise ConversionError(
            f"{src} does not hold this model's {what} ({'; '.join(problems)}): give the job's config "
            "(--config, --model.flavor, --training.seq_len ...) that wrote it"
        )


def read_dcp_metadata(src: Path):
    """{fqn: TensorStorageMetadata} of the model weights (`model.<fqn>` keys) of DCP checkpoint `src`, read
    with titan_dmuon/components/checkpoint.py's `read_metadata`: a `.metadata` naming anything but DCP's metadata
    classes is refused, never unpickled into running code."""
    import pickle

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from titan_dmuon.components.checkpoint import read_metadata

    if not (src / ".metadata").is_file():
        raise ConversionError(f"{src} is not a DCP checkpoint folder (no .metadata): give a step-<N> folder")
    try:
        metadata = read_metadata(src)
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
        raise ConversionError(
            f"{src / '.metadata'} is not DCP checkpoint metadata ({type(e).__name__}: {e}); nothing was loaded: "
            "give a checkpoint folder written by train.py (torch.distributed.checkpoint)"
        ) from None
    entries = {
        key.removeprefix("model."): md
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    if not entries:
        keys = ", ".join(sorted(metadata.state_dict_metadata)[:5])
        raise ConversionError(f"{src} holds no model weights (no 'model.*' keys; it has {keys} ...)")
    return entries


def stream_dcp(src: Path, entries: dict, order: list[str], max_bytes: int) -> Iterator[tuple[str, object]]:
    """(fqn, full tensor) of the DCP checkpoint's model weights in `order`, read in groups of at most
    `max_bytes` (one tensor alone when it is larger); no process group."""
    import torch
    import torch.distributed.checkpoint as dcp

    from titan_dmuon.components.checkpoint import SafeLoadPlanner, SafeReader

    def load(group: list[str]):
        sd = {f"model.{k}": torch.empty(tuple(entries[k].size), dtype=entries[k].properties.dtype) for k in group}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(sd, storage_reader=SafeReader(src), planner=SafeLoadPlanner(), no_dist=True)
        for k in group:
            yield k, sd.pop(f"model.{k}")

    group, size = [], 0
    for k in order:
        md = entries[k]
        nbytes = md.size.numel() * md.properties.dtype.itemsize
        if group and size + nbytes > max_bytes:
            yield from load(group)
            group, size = [], 0
        group.append(k)
        size += nbytes
    if group:
        yield from load(group)


def convert_from_dcp(src: Path, dst: Path, fmt: str, cfg, dtype, max_shard_bytes: int) -> None:
    import torch

    from titan_dmuon.components.hf import export_hf

    entries = read_dcp_metadata(src)
    model, spec = build_meta(cfg, lambda fqn: tuple(entries[fqn].size) if fqn in entries else None)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    check_shapes(expected, {k: tuple(md.size) for k, md in entries.items()}, src, "weights")
    tensors = stream_dcp(src, entries, list(expected), max_shard_bytes)
    if fmt == "torch":
        dst.parent.mkdir(parents=True, exist_ok=True)
        torch.save({k: (t if dtype is None else t.to(dtype)) for k, t in tensors}, dst)
        print(f"wrote {dst} ({len(expected)} tensors, {spec.name} {cfg.model.flavor})")
        return
    if spec.state_dict_adapter is None:
        raise ConversionError(f"model family {spec.name!r} has no Hugging Face adapter (ModelSpec.state_dict_adapter)")
    try:
        files = export_hf(tensors, dst, spec.state_dict_adapter(model), dtype=dtype, max_shard_bytes=max_shard_bytes)
    except FileExistsError as e:
        raise ConversionError(str(e)) from None
    print(f"wrote {dst}: {len(files)} safetensors file(s) + config.json ({spec.name} {cfg.model.flavor})")


def convert_from_hf(src: Path, dst: Path, cfg, dtype) -> None:
    """HF folder -> a DCP folder holding `{"model": full state dict}` (what `initial_load_path` and this script
    read); holds the whole model in memory."""
    import torch
    import torch.distributed.checkpoint as dcp

    from titan_dmuon.components.hf import hf_tensor_shapes, load_hf_weights

    try:
        shapes = hf_tensor_shapes(src)
    except ValueError as e:
        raise ConversionError(str(e)) from None
    if (dst / ".metadata").exists():
        raise ConversionError(f"{dst} holds a DCP checkpoint already: give an empty folder")
    probe, spec = build_meta(cfg, lambda fqn: None)
    if spec.state_dict_adapter is None:
        raise ConversionError(f"model family {spec.name!r} has no Hugging Face adapter (ModelSpec.state_dict_adapter)")
    names = spec.state_dict_adapter(probe)  # the names do not depend on the vocabulary
    model, _ = build_meta(cfg, lambda fqn: shapes.get(names.to_hf_name(fqn)))
    sd = {k: torch.empty(v.shape, dtype=dtype or torch.float32) for k, v in model.state_dict().items()}
    try:
        load_hf_weights(sd, src, spec.state_dict_adapter(model))
    except ValueError as e:
        raise ConversionError(str(e)) from None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": sd}, checkpoint_id=str(dst), no_dist=True)
    print(f"wrote {dst} (DCP, {len(sd)} tensors under model.*, {spec.name} {cfg.model.flavor})")


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
    args, overrides = parser.parse_known_args(argv)

    import torch

    dtype = None if args.export_dtype is None else getattr(torch, _DTYPES[args.export_dtype])
    try:
        cfg = job_config(args.src, args.config, overrides)
        if args.format == "dcp":
            convert_from_hf(args.src, args.dst, cfg, dtype)
        else:
            convert_from_dcp(args.src, args.dst, args.format, cfg, dtype, args.max_shard_size)
    except ConversionError as e:
        print(f"convert_checkpoint: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
