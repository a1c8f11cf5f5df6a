"""Hugging Face weights: export a state dict as safetensors + config.json, and load a published folder into a
(sharded) model state dict.

A model family's `ModelSpec.state_dict_adapter` maps its FQNs and layouts to HF's (titan_dmuon/models/llama3/
state_dict_adapter.py). `load_hf_weights` fills the template `OptimizerComponent.model_state_dict()` returns,
on every rank, reading only that rank's share from the memory-mapped safetensors files: a plain slice where
the conversion is a rename, the HF rows its rows come from where it moves rows (the RoPE q/k permutation: a
contiguous range of our rows is at most two contiguous HF row ranges per head), and one full matrix only where
the shard itself interleaves rows (FSDP2 over TP, _StridedShard). A tensor of ours that stacks several HF
tensors (MoE experts: `StateDictAdapter.stacked_hf_names`) is written as its pieces and read back from them, each
rank reading only the pieces of its slice.
A tensor the adapter marks `zero_when_absent` (an MoE router's selection bias) is left out of an export when it
is zero and read as zeros from a folder without it.
`export_hf` writes the weights, config.json and, given the run's tokenizer, its Hugging Face files, the BOS/EOS/PAD ids
in config.json and a generation_config.json: a folder that `transformers` loads and turns into text.
convert.py streams a DCP checkpoint into it (scripts/convert_checkpoint.py, `checkpoint.last_save_in_hf`).

safetensors (and transformers, for the tests) are dev dependencies, imported only when these functions run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30  # Hugging Face's default shard size for save_pretrained


class StateDictAdapter(Protocol):
    """What `export_hf` and `load_hf_weights` need from a family's adapter; all tensors are full tensors."""

    def to_hf_name(self, fqn: str) -> str: ...

    def from_hf_name(self, hf_name: str) -> str | None: ...

    def tied_hf_name(self, fqn: str) -> str | None:
        """Where a checkpoint with `tie_word_embeddings: true` stores `fqn` when `to_hf_name(fqn)` is absent."""
        ...

    def needs_full_tensor(self, fqn: str) -> bool:
        """True when `from_hf` moves elements: then it must permute whole rows (dim 0) only, so that a shard's
        rows can be read from the HF rows they come from (`_hf_rows` finds the map by converting row indices)."""
        ...

    def stacked_hf_names(self, fqn: str) -> list[str] | None:
        """Optional (an adapter without it has none): the HF tensors whose stack on a new dim 0 is `fqn` (MoE
        experts: one HF matrix per expert, e.g. `model.layers.N.mlp.experts.{e}.gate_proj.weight`), None for a
        tensor that is one HF tensor. A stacked tensor converts by name only (`to_hf`/`from_hf` leave it as it
        is); a rank holding a block of it reads only the HF tensors of its slice of dim 0."""
        ...

    def zero_when_absent(self, fqn: str) -> bool:
        """Optional (default False): True for a tensor that HF checkpoints may lack, meaning zeros (an MoE router's
        selection bias, which the published models do not have): `export_hf` leaves it out when it is all zeros,
        `load_hf_weights` fills zeros when the folder lacks it."""
        ...

    def to_hf(self, fqn: str, tensor: torch.Tensor) -> torch.Tensor: ...

    def from_hf(self, fqn: str, tensor: torch.Tensor) -> torch.Tensor: ...

    def hf_config(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]: ...

    def check_hf_config(self, config: dict[str, Any]) -> None:
        """ValueError when a folder's config.json describes a model the conversion would get wrong."""
        ...


def _stacked(adapter: StateDictAdapter, fqn: str) -> list[str] | None:
    """`adapter.stacked_hf_names(fqn)`, None for an adapter without the method."""
    names = getattr(adapter, "stacked_hf_names", None)
    return names(fqn) if names is not None else None


def _zero_when_absent(adapter: StateDictAdapter, fqn: str) -> bool:
    """`adapter.zero_when_absent(fqn)`, False for an adapter without the method."""
    optional = getattr(adapter, "zero_when_absent", None)
    return bool(optional(fqn)) if optional is not None else False


def _safetensors():
    try:
        import safetensors
        import safetensors.torch
    except ImportError:
        raise ImportError(
            "Hugging Face weights need the safetensors package: pip install safetensors "
            '(it comes with the dev extra: pip install -e ".[dev]")'
        ) from None
    return safetensors


def is_hf_folder(path: str | os.PathLike) -> bool:
    """True when `path` is a folder holding `*.safetensors` files (a Hugging Face model folder)."""
    path = Path(path)
    return path.is_dir() and any(path.glob("*.safetensors"))


# ---------------------------------------------------------------------------------------------------
# Export


def new_file_mode() -> int:
    """The mode `open(path, "w")` gives a new file: 0o666 less the process umask (read from /proc without
    changing it where Linux has it: os.umask is process-wide and the trainer has threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _shard_name(index: int, total: int) -> str:
    return SINGLE_FILE_NAME if total == 1 else f"model-{index + 1:05d}-of-{total:05d}.safetensors"


def export_hf(
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    folder: str | os.PathLike,
    adapter: StateDictAdapter,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tokenizer: Any = None,
) -> list[Path]:
    """Write full tensors of ours (FQN -> tensor, a mapping or a stream of pairs) as an HF model folder:
    `model.safetensors`, or `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json` when they
    exceed `max_shard_bytes`, and `config.json`. `dtype` casts (None keeps each tensor's). A stream is written
    as it comes, holding at most one shard in memory. Returns the safetensors files written.

    With `tokenizer` (the run's, titan_dmuon/data/tokenizer.py: anything with `save_hf(folder)`, `vocab_size`,
    `bos_id`, `eos_id`, `pad_id`), its Hugging Face files go beside the weights, config.json gets
    `bos_token_id`/`eos_token_id`/`pad_token_id`, and `generation_config.json` holds the same ids; a tokenizer
    with more ids than the model's vocabulary is a ValueError (written before anything is). Every file gets the
    mode a new file gets under the process umask (644 under 022)."""
    st = _safetensors()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stale = sorted(p.name for p in folder.glob("*.safetensors")) + [INDEX_NAME] * (folder / INDEX_NAME).exists()
    if stale:
        raise FileExistsError(f"{folder} holds HF weights already ({', '.join(stale[:3])}): give an empty one")
    special: dict[str, int | None] = {}
    if tokenizer is not None:
        vocab = adapter.hf_config().get("vocab_size")
        if vocab is not None and tokenizer.vocab_size > vocab:
            raise ValueError(
                f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary is {vocab}: it is not the "
                "tokenizer the model was trained with (model.tokenizer)"
            )
        special = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
        tokenizer.save_hf(folder)
    mode = new_file_mode()
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    written: list[tuple[Path, list[str]]] = []
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = total_bytes = 0
    out_dtype = dtype

    def flush() -> None:
        nonlocal pending, pending_bytes
        tmp = folder / f".shard-{len(written):05d}.safetensors.tmp"
        st.torch.save_file(pending, str(tmp), metadata={"format": "pt"})
        written.append((tmp, list(pending)))
        pending, pending_bytes = {}, 0

    for fqn, tensor in items:
        if isinstance(tensor, DTensor):
            raise TypeError(
                f"export_hf takes full tensors, got a DTensor for {fqn!r}: gather it first "
                "(dmuon.get_model_state_dict) or convert a DCP checkpoint with scripts/convert_checkpoint.py"
            )
        if _zero_when_absent(adapter, fqn) and not tensor.any():
            continue  # zeros: what a folder without it means
        hf = adapter.to_hf(fqn, tensor.detach().cpu())
        hf = (hf.to(dtype) if dtype is not None else hf).contiguous()
        out_dtype = hf.dtype if out_dtype is None else out_dtype
        names = _stacked(adapter, fqn)
        if names is not None and len(names) != hf.shape[0]:
            raise ValueError(f"{fqn} stacks {hf.shape[0]} tensors but the adapter names {len(names)}")
        # a stacked tensor's pieces are copies: safetensors refuses tensors that share storage
        pieces = [(adapter.to_hf_name(fqn), hf)] if names is None else zip(names, (t.clone() for t in hf), strict=True)
        for name, piece in pieces:
            nbytes = piece.numel() * piece.element_size()
            if pending and pending_bytes + nbytes > max_shard_bytes:
                flush()
            pending[name] = piece
            pending_bytes += nbytes
            total_bytes += nbytes
    if pending or not written:
        flush()

    files, weight_map = [], {}
    for i, (tmp, names) in enumerate(written):
        path = folder / _shard_name(i, len(written))
        os.chmod(tmp, mode)  # safetensors creates its files 0600
        os.replace(tmp, path)
        files.append(path)
        weight_map.update(dict.fromkeys(names, path.name))
    if len(files) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        _write_json(folder / INDEX_NAME, index)
    config = adapter.hf_config(out_dtype or torch.float32)
    _write_json(folder / CONFIG_NAME, {**config, **special})
    if special:
        _write_json(folder / GENERATION_CONFIG_NAME, special)
    return files


# ---------------------------------------------------------------------------------------------------
# Load


def hf_weight_map(folder: str | os.PathLike) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it: from the index when there is one, else each file's
    header. ValueError when `folder` holds no safetensors."""
    folder = Path(folder)
    index = folder / INDEX_NAME
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} holds no *.safetensors file: not a Hugging Face model folder")
    st = _safetensors()
    out = {}
    for path in files:
        with st.safe_open(str(path), framework="pt") as f:
            out.update(dict.fromkeys(f.keys(), path))
    return out


def hf_tensor_shapes(folder: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, from the safetensors headers (no tensor is read)."""
    st = _safetensors()
    by_file: dict[Path, list[str]] = {}
    for name, path in hf_weight_map(folder).items():
        by_file.setdefault(path, []).append(name)
    out = {}
    for path, names in by_file.items():
        with st.safe_open(str(path), framework="pt") as f:
            out.update({name: tuple(f.get_slice(name).get_shape()) for name in names})
    return out


def _is_block(placements) -> bool:
    """Whether a DTensor's local shard is one rectangular block of the global tensor (only plain Shard and
    Replicate placements; a _StridedShard, FSDP2's dim-0 shard over a TP-sharded dim 0, interleaves)."""
    return all(
        isinstance(p, Replicate) or (isinstance(p, Shard) and not isinstance(p, _StridedShard)) for p in placements
    )


@torch.no_grad()
def load_hf_weights(model_sd: dict[str, torch.Tensor], folder: str | os.PathLike, adapter: StateDictAdapter) -> None:
    """Fill the template `model_sd` (our FQNs; plain tensors or DTensors, this rank's share) in place from the
    HF folder `folder`, converting each tensor with `adapter` and casting to the template's dtype.

    Each rank reads only its share: a slice of the memory-mapped file where the conversion is a rename, the
    runs of HF rows its rows come from where it moves rows, and the full matrix (one at a time) only for a
    template that is not a DTensor block (a plain tensor, a _StridedShard). HF tensors that the template does not
    name are ignored (e.g. `rotary_emb.inv_freq`); a template key with no HF tensor, or a shape that differs,
    is a ValueError naming the folder, the tensor and the fix.
    """
    st = _safetensors()
    folder = Path(folder)
    weight_map = hf_weight_map(folder)
    config_path = folder / CONFIG_NAME
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    try:
        adapter.check_hf_config(config)
    except ValueError as e:
        raise ValueError(f"{folder}: {e}: the model config (flavor) does not match {config_path}") from None
    tied = bool(config.get("tie_word_embeddings", False))

    sources: dict[str, str | list[str] | None] = {}
    missing = []
    for fqn in model_sd:
        if _zero_when_absent(adapter, fqn) and adapter.to_hf_name(fqn) not in weight_map:
            sources[fqn] = None  # zeros
            continue
        stacked = _stacked(adapter, fqn)
        if stacked is not None:
            absent = [n for n in stacked if n not in weight_map]
            if absent:
                missing.append(f"{fqn} ({absent[0]}{' ...' if len(absent) > 1 else ''})")
            sources[fqn] = stacked
            continue
        name = adapter.to_hf_name(fqn)
        if name not in weight_map and tied:
            name = adapter.tied_hf_name(fqn) or name
        if name not in weight_map:
            missing.append(f"{fqn} ({name})")
        sources[fqn] = name
    if missing:
        raise ValueError(
            f"{folder} has no tensor for {len(missing)} of the model's weights: {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}; is it a checkpoint of this model family?"
        )

    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def handle(name: str):
            path = weight_map[name]
            if path not in handles:
                handles[path] = stack.enter_context(st.safe_open(str(path), framework="pt"))
            return handles[path]

        for fqn, template in model_sd.items():
            name = sources[fqn]
            if name is None:
                (template.to_local() if isinstance(template, DTensor) else template).zero_()
            elif isinstance(name, list):
                _fill_stacked(template, {n: handle(n) for n in name}, name, fqn, folder)
            else:
                _fill(template, handle(name), name, fqn, adapter, folder)


def _fill(template: torch.Tensor, f, name: str, fqn: str, adapter: StateDictAdapter, folder: Path) -> None:
    """Copy this rank's share of HF tensor `name` (file handle `f`) into `template` (our `fqn`)."""
    hf_shape = tuple(f.get_slice(name).get_shape())
    if hf_shape != tuple(template.shape):
        raise ValueError(
            f"{folder}: {name} (our {fqn}) has shape {list(hf_shape)} but the model's is {list(template.shape)}: "
            f"the model config (flavor, vocab size) does not match {folder / CONFIG_NAME}"
        )

    def full() -> torch.Tensor:
        return adapter.from_hf(fqn, f.get_tensor(name))

    if not isinstance(template, DTensor):
        template.copy_(full() if adapter.needs_full_tensor(fqn) else f.get_tensor(name))
        return
    local = template.to_local()
    if not _is_block(template.placements):
        # one full matrix, sharded locally (src_data_rank=None: no communication)
        shard = distribute_tensor(full(), template.device_mesh, template.placements, src_data_rank=None)
        local.copy_(shard.to_local())
        return
    shape, offset = compute_local_shape_and_global_offset(template.shape, template.device_mesh, template.placements)
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(f"{fqn}: local shard shape {tuple(local.shape)} != computed {shape}")
    if local.numel() == 0:
        return
    region = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
    if adapter.needs_full_tensor(fqn):
        rows = _hf_rows(adapter, fqn, template.shape[0])[region[0]]
        local.copy_(_read_rows(f.get_slice(name), rows, region[1:]))
    else:
        local.copy_(f.get_slice(name)[region])


def _dim0_rows(template: DTensor) -> list[int] | None:
    """The global dim-0 indices of this rank's local rows, in order, when every placement shards dim 0 (or
    replicates): placing an index vector the way the template is placed (a local chunk on each rank, no
    communication). None for other placements."""
    if not all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0) for p in template.placements):
        return None
    idx = torch.arange(template.shape[0], device=template.to_local().device)
    return distribute_tensor(idx, template.device_mesh, template.placements, src_data_rank=None).to_local().tolist()


def _fill_stacked(template: torch.Tensor, files: dict[str, Any], names: list[str], fqn: str, folder: Path) -> None:
    """Copy this rank's share of the stack (dim 0) of HF tensors `names` (file handle of each in `files`) into
    `template` (our `fqn`): a DTensor block reads only the HF tensors of its dim-0 slice, and of each only its
    block of the other dims."""
    if len(names) != template.shape[0]:
        raise ValueError(f"{fqn} stacks {template.shape[0]} tensors but the adapter names {len(names)}")
    block = isinstance(template, DTensor) and _is_block(template.placements)
    if block:
        shape, offset = compute_local_shape_and_global_offset(template.shape, template.device_mesh, template.placements)
        names = names[offset[0] : offset[0] + shape[0]]
    for name in names:
        hf_shape = tuple(files[name].get_slice(name).get_shape())
        if hf_shape != tuple(template.shape[1:]):
            raise ValueError(
                f"{folder}: {name} (a slice of our {fqn}) has shape {list(hf_shape)} but the model's slices are "
                f"{list(template.shape[1:])}: the model config (flavor) does not match {folder / CONFIG_NAME}"
            )
    if not isinstance(template, DTensor):
        for i, name in enumerate(names):
            template[i].copy_(files[name].get_tensor(name))
        return
    local = template.to_local()
    if not block:
        rows = _dim0_rows(template)
        if rows is not None:  # e.g. FSDP2 over expert parallelism (_StridedShard then Shard, both on dim 0)
            for i, r in enumerate(rows):
                local[i].copy_(files[names[r]].get_tensor(names[r]))
            return
        full = torch.stack([files[n].get_tensor(n) for n in names])
        local.copy_(distribute_tensor(full, template.device_mesh, template.placements, src_data_rank=None).to_local())
        return
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(f"{fqn}: local shard shape {tuple(local.shape)} != computed {shape}")
    if local.numel() == 0:
        return
    rest = tuple(slice(o, o + s) for o, s in zip(offset[1:], shape[1:], strict=True))
    for i, name in enumerate(names):
        local[i].copy_(files[name].get_slice(name)[rest])


def _hf_rows(adapter: StateDictAdapter, fqn: str, n_rows: int) -> torch.Tensor:
    """HF row index of each of our rows of `fqn`: `from_hf` applied to a column of row indices (it permutes rows
    only, StateDictAdapter.needs_full_tensor)."""
    rows = adapter.from_hf(fqn, torch.arange(n_rows).unsqueeze(1)).squeeze(1)
    if rows.shape != (n_rows,) or not torch.equal(rows.sort().values, torch.arange(n_rows)):
        raise ValueError(f"{type(adapter).__name__}.from_hf({fqn!r}) is not a permutation of rows")
    return rows


def _read_rows(hf_slice, rows: torch.Tensor, rest: tuple[slice, ...]) -> torch.Tensor:
    """HF rows `rows` (in that order) of a safetensors slice, columns etc. `rest`, reading each contiguous run of
    HF rows once: only the elements returned are read."""
    sorted_rows, order = rows.sort()
    breaks = (torch.nonzero(sorted_rows.diff() != 1).flatten() + 1).tolist()
    bounds = zip([0, *breaks], [*breaks, len(rows)], strict=True)
    runs = [hf_slice[(slice(int(sorted_rows[a]), int(sorted_rows[b - 1]) + 1), *rest)] for a, b in bounds]
    return torch.cat(runs)[order.argsort()]


__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "StateDictAdapter",
    "export_hf",
    "hf_tensor_shapes",
    "hf_weight_map",
    "is_hf_folder",
    "load_hf_weights",
    "new_file_mode",
]
