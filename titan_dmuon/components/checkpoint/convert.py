"""Checkpoint conversion without a process group: a DCP checkpoint folder (`step-<N>`) into a Hugging Face folder
(weights, config.json, the run's tokenizer, generation_config.json) or one torch file, and an HF folder into DCP.

    export_dcp_to_hf(step_folder, out_folder, cfg, dtype=torch.bfloat16)   # cfg: the job's JobConfig

scripts/convert_checkpoint.py is the command line over these functions; `checkpoint.last_save_in_hf`
(manager.py) calls `export_dcp_to_hf` on rank 0 after the last save. Tensors are read
from the checkpoint in groups of at most `max_shard_bytes` (one tensor alone when it is larger) and written as
safetensors shards of at most that size, so memory stays within a few times the larger of that size and the
largest tensor, whatever the model's size; no rank ever holds the whole model (`dcp_to_torch` and `hf_to_dcp`
do: they write or read one file/state dict). Checkpoints are read as a resume reads them (dcp_io.py): no code is
unpickled (a `.metadata` naming other classes is refused); the Hugging Face side is hf_io.py's. Problems a user can
fix raise `ExportError` with a message naming what and the fix.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titan_dmuon.components.model import build_meta_model, check_flavor, get_model_spec
from titan_dmuon.config import ConfigError, parse_args
from titan_dmuon.data.errors import DataError
from titan_dmuon.data.tokenizer import build_tokenizer

from .dcp_io import METADATA_ERRORS, SafeLoadPlanner, SafeReader, read_metadata
from .hf_io import DEFAULT_MAX_SHARD_BYTES, export_hf, hf_tensor_shapes, load_hf_weights

_VOCAB_PROBE = 999_983  # a prime no other dimension of a model equals: where it shows up, the vocabulary is


class ExportError(Exception):
    """A source or configuration that cannot be converted; the message says what and the fix."""


def find_saved_config(src: Path) -> Path | None:
    """The job config saved with a checkpoint: `config.toml` in the step folder or its parent, or the only
    *.toml in the step folder."""
    for path in (src / "config.toml", src.parent / "config.toml"):
        if path.is_file():
            return path
    tomls = sorted(src.glob("*.toml"))
    return tomls[0] if len(tomls) == 1 else None


def job_config(src: Path | None, config: str | None, overrides: list[str]):
    """The JobConfig of checkpoint `src`: `config` (a TOML path) or the one saved with it (else, or without a `src`,
    the defaults), then the `--section.field value` overrides; ExportError naming a bad one."""
    path = config or (find_saved_config(src) if src is not None else None)
    try:
        return parse_args((["--config", str(path)] if path else []) + overrides)
    except ConfigError as e:
        raise ExportError(f"config: {e}") from None


def build_meta(cfg, shape_of: Callable[[str], tuple[int, ...] | None]):
    """(model on meta, its spec) for `cfg`, with the vocabulary size the checkpoint's tensors have: a first
    build with a probe vocabulary finds which dimensions are the vocabulary, `shape_of(fqn)` gives their size."""
    try:
        spec = get_model_spec(cfg.model.name)
        check_flavor(spec, cfg.model.flavor)
    except ValueError as e:
        raise ExportError(str(e)) from None
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
    """ExportError naming the keys the model and the checkpoint disagree on."""
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    wrong = [f"{k} {list(found[k])} (model: {list(s)})" for k, s in expected.items() if k in found and found[k] != s]
    problems = []
    for label, keys in (("missing", missing), ("not in the model", unexpected), ("other shape", wrong)):
        if keys:
            problems.append(f"{label}: {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''}")
    if problems:
        raise ExportError(
            f"{src} does not hold this model's {what} ({'; '.join(problems)}): give the job's config "
            "(--config, --model.flavor, --training.seq_len ...) that wrote it"
        )


def read_dcp_metadata(src: Path) -> dict[str, Any]:
    """{fqn: TensorStorageMetadata} of the model weights (`model.<fqn>` keys) of DCP checkpoint `src`, read
    with dcp_io.py's `read_metadata`: a `.metadata` naming anything but DCP's metadata classes is refused, never
    unpickled into running code."""
    if not (src / ".metadata").is_file():
        raise ExportError(f"{src} is not a DCP checkpoint folder (no .metadata): give a step-<N> folder")
    try:
        metadata = read_metadata(src)
    except METADATA_ERRORS as e:
        raise ExportError(
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
        raise ExportError(f"{src} holds no model weights (no 'model.*' keys; it has {keys} ...)")
    return entries


def stream_dcp(src: Path, entries: dict, order: list[str], max_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(fqn, full tensor) of the DCP checkpoint's model weights in `order`, read in groups of at most
    `max_bytes` (one tensor alone when it is larger); no process group (none is used where one exists)."""

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


def _model_of(src: Path, cfg):
    """(entries, model on meta, spec, the state dict's FQNs in order) of DCP checkpoint `src` under `cfg`."""
    entries = read_dcp_metadata(src)
    model, spec = build_meta(cfg, lambda fqn: tuple(entries[fqn].size) if fqn in entries else None)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    check_shapes(expected, {k: tuple(md.size) for k, md in entries.items()}, src, "weights")
    return entries, model, spec, list(expected)


def export_dcp_to_hf(
    src: str | Path,
    dst: str | Path,
    cfg,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tokenizer: bool = True,
) -> list[Path]:
    """Write the model weights of DCP checkpoint folder `src` as the Hugging Face folder `dst` (which must hold
    no weights yet), for the job config `cfg` (model name/flavor, training.seq_len; the vocabulary size is the
    checkpoint's), streaming (module docstring). With `tokenizer`, `cfg.model.tokenizer` is read and written
    beside the weights, with its ids in config.json and generation_config.json (hf_io.py's `export_hf`). Returns
    the safetensors files written."""
    src, dst = Path(src), Path(dst)
    entries, model, spec, order = _model_of(src, cfg)
    if spec.state_dict_adapter is None:
        raise ExportError(f"model family {spec.name!r} has no Hugging Face adapter (ModelSpec.state_dict_adapter)")
    tok = None
    if tokenizer:
        try:
            tok = build_tokenizer(cfg.model.tokenizer)
        except DataError as e:
            raise ExportError(
                f"the run's tokenizer (model.tokenizer = {cfg.model.tokenizer!r}): {e}; give its path with "
                "--model.tokenizer PATH, or export the weights alone with --no-tokenizer"
            ) from None
    adapter = spec.state_dict_adapter(model)
    vocab = adapter.hf_config().get("vocab_size")
    if tok is not None and vocab is not None and tok.vocab_size > vocab:
        raise ExportError(
            f"the tokenizer {cfg.model.tokenizer!r} (model.tokenizer) has {tok.vocab_size} ids but the model in {src} "
            f"has a vocabulary of {vocab}: it is not the run's tokenizer; give that with --model.tokenizer PATH, or "
            "export the weights alone with --no-tokenizer"
        )
    tensors = stream_dcp(src, entries, order, max_shard_bytes)
    try:
        return export_hf(tensors, dst, adapter, dtype=dtype, max_shard_bytes=max_shard_bytes, tokenizer=tok)
    except (FileExistsError, ValueError) as e:
        raise ExportError(str(e)) from None


def dcp_to_torch(
    src: str | Path,
    dst: str | Path,
    cfg,
    *,
    dtype: torch.dtype | None = None,
    max_read_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> int:
    """The model weights of DCP checkpoint `src` as one torch file `dst` ({fqn: tensor}, our FQNs; holds the whole
    model in memory, read in groups of at most `max_read_bytes`). Returns the number of tensors."""
    src, dst = Path(src), Path(dst)
    entries, _, _, order = _model_of(src, cfg)
    tensors = stream_dcp(src, entries, order, max_read_bytes)
    dst.parent.mkdir(parents=True, exist_ok=True)
    torch.save({k: (t if dtype is None else t.to(dtype)) for k, t in tensors}, dst)
    return len(order)


def hf_to_dcp(src: str | Path, dst: str | Path, cfg, *, dtype: torch.dtype | None = None) -> int:
    """HF folder -> a DCP folder holding `{"model": full state dict}` (what `initial_load_path` and
    `export_dcp_to_hf` read); holds the whole model in memory. Returns the number of tensors."""
    src, dst = Path(src), Path(dst)
    try:
        shapes = hf_tensor_shapes(src)
    except ValueError as e:
        raise ExportError(str(e)) from None
    if (dst / ".metadata").exists():
        raise ExportError(f"{dst} holds a DCP checkpoint already: give an empty folder")
    probe, spec = build_meta(cfg, lambda fqn: None)
    if spec.state_dict_adapter is None:
        raise ExportError(f"model family {spec.name!r} has no Hugging Face adapter (ModelSpec.state_dict_adapter)")
    names = spec.state_dict_adapter(probe)  # the names do not depend on the vocabulary
    model, _ = build_meta(cfg, lambda fqn: shapes.get(names.to_hf_name(fqn)))
    sd = {k: torch.empty(v.shape, dtype=dtype or torch.float32) for k, v in model.state_dict().items()}
    try:
        load_hf_weights(sd, src, spec.state_dict_adapter(model))
    except ValueError as e:
        raise ExportError(str(e)) from None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": sd}, checkpoint_id=str(dst), no_dist=True)
    return len(sd)


__all__ = [
    "ExportError",
    "build_meta",
    "check_shapes",
    "dcp_to_torch",
    "export_dcp_to_hf",
    "hf_to_dcp",
    "read_dcp_metadata",
    "stream_dcp",
]
