"""The model registry: one ModelSpec per family, looked up by `model.name` (torchtitan's train spec, smaller).

A family (a package under models/) registers its ModelSpec when imported; `get_model_spec(name)` imports
`titan_dmuon.models.<name>` on first use. Everything the framework needs to know about a family goes through the spec:
how to build a flavor, how each parameter is initialized, where its transformer blocks are (activation
checkpointing, compile, FSDP2 and DMuon's hook boundaries all use them), which matrices are Muon targets by
default, its TP plan, its loss and an activation-memory estimate for the dry-run planner.
titan_dmuon/models/README.md shows how to add a family.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_dmuon.components.initialization import ParamInit
from titan_dmuon.config import ConfigError, JobConfig


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of `logits [B, T, V]` against `labels [B, T]`, in fp32.

    Under loss parallel (TP, see the trainer's `_loss`) `logits` is a DTensor sharded on V: `flatten(0, 1)` keeps
    it sharded on V (now dim 1), and inside `loss_parallel()` the log-softmax and NLL reduce over the TP group.
    Each TP rank then holds [B*T, V/tp] of the logits, of their fp32 copy and of the log-softmax (and of their
    grads) instead of the whole [B*T, V] of each: the largest activations of a small model with a big vocabulary.
    """
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


@dataclass(frozen=True)
class ModelSpec:
    """What the framework needs to know about a model family.

    The model `build` returns must take `tokens [B, T]` (int64) and return what `loss_fn` takes with the
    labels. The trainer builds it on meta, parallelizes it there, and then each rank allocates only its share
    and fills it from `param_inits` (titan_dmuon/components/initialization.py: values are a function of (seed, FQN),
    whatever the cluster shape) and `init_buffers`.
    """

    name: str
    """The `model.name` that selects the family."""
    flavors: Mapping[str, Any]
    """Flavor name -> the family's own arguments for it (`model.flavor` picks one)."""
    build: Callable[..., nn.Module]
    """`build(flavor, vocab_size=..., max_seq_len=...)` -> the model on the meta device."""
    nparams_and_flops: Callable[[nn.Module, int], tuple[int, int]]
    """`(model, seq_len)` -> (parameter count, training FLOPs per token), for the log and MFU."""
    blocks: Callable[[nn.Module], list[tuple[str, nn.Module]]]
    """`model` -> its repeated blocks as (FQN, module), in forward order: the units of activation checkpointing,
    compile, FSDP2 sharding and DMuon's broadcast/reduce hooks."""
    muon_params: str
    """Regex over parameter FQNs: the matrices Muon takes when `optimizer.muon_params` is empty (2-D weights, and
    3-D expert stacks, each of whose slices is one matrix)."""
    param_inits: Callable[[nn.Module], Mapping[str, ParamInit]]
    """`model` -> every parameter's initial distribution by FQN; read from the (meta) model's shapes, never its
    values."""
    init_buffers: Callable[[nn.Module, torch.device], None]
    """`(model, device)` -> computes the model's buffers (e.g. RoPE tables) on `device`, after materialization."""
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_loss
    """`(model output, labels)` -> the scalar training loss (a mean, so DP ranks average to the global mean).
    Under loss parallel the output is a DTensor sharded on its last dim and the trainer calls this inside
    `torch.distributed.tensor.parallel.loss_parallel()`: it must use `F.cross_entropy` (the op loss parallel
    implements) on it."""
    apply_tp: Callable[..., Any] | None = None
    """The tensor-parallel plan, `(model, tp_mesh, *, loss_parallel)`, applied in place; None = the family has
    none. With `loss_parallel` (the default unless `parallelism.disable_loss_parallel`) the model returns its
    logits as a DTensor sharded on the last (vocab) dim, else a plain replicated tensor. It raises ValueError
    when the degree does not fit the flavor."""
    activation_estimate: Callable[..., Any] | None = None
    """`(model, *, batch, seq_len, dtype_bytes, tp, ac_mode, ac_option, loss_parallel)` -> an estimate of one rank's
    activation memory for a micro-batch: an object with `.total` (bytes at the peak of backward) and its terms as
    float fields (the dry-run planner prints them and checks that the plan fits the device); None = the planner
    says it has no estimate."""
    head_blocks: Callable[[nn.Module], Mapping[str, tuple[int, int]]] | None = None
    """`model` (built, on meta or not) -> FQN -> (dim, size): the attention heads of its projections, for per-head
    Muon (`optimizer.muon.per_head`): `(0, head_dim)` for wq/wk/wv (row blocks), `(1, head_dim)` for wo (column
    blocks, used with `per_head_wo`); None = the family has none (per_head is then a config error)."""
    state_dict_adapter: Callable[[nn.Module], Any] | None = None
    """`model` (built, on meta or not) -> its Hugging Face state-dict adapter: our FQNs <-> HF names and layouts and
    the HF config.json (titan_dmuon/components/checkpoint/hf_io.py's `StateDictAdapter`: export_hf, load_hf_weights and
    scripts/convert_checkpoint.py use it); None = the family has no HF counterpart."""


_REGISTRY: dict[str, ModelSpec] = {}


def register_model_spec(spec: ModelSpec) -> ModelSpec:
    """Register a family under `spec.name` (a family's package calls this when imported)."""
    existing = _REGISTRY.get(spec.name)
    if existing is not None and existing is not spec:
        raise ValueError(f"model family {spec.name!r} is registered already")
    _REGISTRY[spec.name] = spec
    return spec


_FAMILIES = "titan_dmuon.models"
"""The package whose subpackages are the model families."""


def _import_families() -> None:
    """Import every package/module under models/, so each registers its spec."""
    import titan_dmuon.models as models

    for info in pkgutil.iter_modules(models.__path__):
        importlib.import_module(f"{_FAMILIES}.{info.name}")


def available_models() -> list[str]:
    """The names of every registered family (importing all of models/ first)."""
    _import_families()
    return sorted(_REGISTRY)


def get_model_spec(name: str) -> ModelSpec:
    """The spec registered as `name`, importing `titan_dmuon.models.<name>` if needed; ValueError lists what exists."""
    if name not in _REGISTRY and name.isidentifier():
        try:
            importlib.import_module(f"{_FAMILIES}.{name}")
        except ModuleNotFoundError as e:
            if e.name not in (_FAMILIES, f"{_FAMILIES}.{name}"):  # the family exists but an import inside it failed
                raise
    if name not in _REGISTRY:
        raise ValueError(f"unknown model family {name!r}; registered families: {', '.join(available_models())}")
    return _REGISTRY[name]


def check_flavor(spec: ModelSpec, flavor: str) -> None:
    """ValueError listing the family's flavors when `flavor` is not one of them."""
    if flavor not in spec.flavors:
        raise ValueError(f"{spec.name} has no flavor {flavor!r}; its flavors: {', '.join(spec.flavors)}")


def model_vocab_size(cfg: JobConfig, tokenizer_vocab: int) -> int:
    """The embedding's rows: model.vocab_size when set, else the vocab_size in the config.json of a Hugging Face
    folder in checkpoint.initial_load_path (a published checkpoint's padded vocabulary), else the tokenizer's ids.
    Fewer rows than the tokenizer has ids is a ConfigError: some targets would have no logit."""
    size, source = cfg.model.vocab_size, "model.vocab_size"
    hf_config = Path(cfg.checkpoint.initial_load_path) / "config.json" if cfg.checkpoint.initial_load_path else None
    if not size and hf_config is not None and hf_config.is_file():
        try:
            size = int(json.loads(hf_config.read_text()).get("vocab_size") or 0)
        except (OSError, ValueError) as e:
            raise ConfigError(f"checkpoint.initial_load_path: unreadable {hf_config} ({e})") from None
        source = f"vocab_size in {hf_config}"
    if not size:
        return tokenizer_vocab
    if size < tokenizer_vocab:
        raise ConfigError(
            f"{source} is {size}, but the tokenizer {cfg.model.tokenizer!r} has {tokenizer_vocab} ids: use the "
            f"model's own tokenizer (model.tokenizer), or a model.vocab_size of at least {tokenizer_vocab}"
        )
    return size


def build_meta_model(spec: ModelSpec, cfg: JobConfig, vocab_size: int | None) -> nn.Module:
    """The configured flavor on the meta device (the trainer's and the dry-run planner's one builder);
    `vocab_size=None` keeps the flavor's own. A flavor that rejects its arguments is a ConfigError."""
    try:
        return spec.build(cfg.model.flavor, vocab_size=vocab_size, max_seq_len=cfg.training.seq_len)
    except ValueError as e:
        raise ConfigError(f"model.flavor = {cfg.model.flavor!r}: {e}") from None


__all__ = [
    "ModelSpec",
    "build_meta_model",
    "available_models",
    "check_flavor",
    "cross_entropy_loss",
    "get_model_spec",
    "model_vocab_size",
    "register_model_spec",
]
