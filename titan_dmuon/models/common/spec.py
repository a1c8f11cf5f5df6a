"""The plumbing a decoder family's ModelSpec needs, written once: flavor lookup, the builder, the block accessors
and the spec itself (the family gives its name, flavors, Transformer class, Muon regex and HF adapter)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from titan_dmuon.components.initialization import ParamInit
from titan_dmuon.components.model import ModelSpec

from .decoder import Decoder, get_nparams_and_flops
from .memory import activation_estimate
from .tensor_parallel import apply_tp


def blocks(model: Decoder) -> list[tuple[str, nn.Module]]:
    """The transformer blocks, `layers.N`, in forward order."""
    return [(f"layers.{name}", block) for name, block in model.layers.items()]


def head_blocks(model: Decoder) -> dict[str, tuple[int, int]]:
    """Per-head Muon's blocks: each attention head of every block, as its attention module gives them
    (`head_blocks()`: GQA's `(0, head_dim)` rows of wq/wk/wv and `(1, head_dim)` columns of wo; MLA's per-head rows
    and columns of its up projections and wo)."""
    out: dict[str, tuple[int, int]] = {}
    for name, block in blocks(model):
        out.update({f"{name}.attention.{k}": v for k, v in block.attention.head_blocks().items()})
    return out


def param_inits(model: Decoder) -> Mapping[str, ParamInit]:
    return model.param_inits()


def init_buffers(model: Decoder, device: torch.device) -> None:
    model.init_buffers(device)


@dataclass(frozen=True)
class DecoderFamily:
    """A family's name, flavors (flavor -> its ModelArgs) and Transformer class (a `Decoder` built from one
    ModelArgs): what `get_model_args`, `build_model` and `spec` need."""

    name: str
    flavors: Mapping[str, Any]
    model_cls: Callable[[Any], Decoder]

    def get_model_args(self, flavor: str, vocab_size: int | None = None, **overrides) -> Any:
        """A fresh copy of a flavor's ModelArgs; ``vocab_size`` (if given) and ``overrides`` replace fields."""
        if flavor not in self.flavors:
            raise ValueError(f"unknown {self.name} flavor {flavor!r}; choose one of {sorted(self.flavors)}")
        if vocab_size is not None:
            overrides["vocab_size"] = vocab_size
        return dataclasses.replace(self.flavors[flavor], **overrides)

    def build_model(
        self, flavor: str, vocab_size: int | None = None, device: torch.device | str = "meta", **overrides
    ) -> Decoder:
        """Build a flavor on ``device``. On "meta" nothing is allocated or initialized (the trainer parallelizes it,
        then each rank materializes and initializes its share); on a real device it is materialized with
        ``to_empty`` and ``init_weights`` (the seed of ``torch.manual_seed``), the weights a run with that seed
        starts from on any cluster shape.

        ``vocab_size`` is required for the debug and tiny flavors (theirs comes from the tokenizer); ``overrides``
        (e.g. ``max_seq_len=...``) replace ModelArgs fields.
        """
        args = self.get_model_args(flavor, vocab_size, **overrides)
        with torch.device("meta"):
            model = self.model_cls(args)
        if torch.device(device).type != "meta":
            model.to_empty(device=device)
            model.init_weights()
        return model

    def spec(self, *, muon_params: str, state_dict_adapter: Callable[[nn.Module], Any], **optional) -> ModelSpec:
        """The family's ModelSpec: the shared builder, blocks, inits, TP plan, activation estimate and per-head
        blocks, with its Muon regex and HF adapter; ``optional`` sets the other ModelSpec fields (the MoE hooks)."""
        return ModelSpec(
            name=self.name,
            flavors=self.flavors,
            build=self.build_model,
            nparams_and_flops=get_nparams_and_flops,
            blocks=blocks,
            muon_params=muon_params,
            param_inits=param_inits,
            init_buffers=init_buffers,
            apply_tp=apply_tp,
            activation_estimate=activation_estimate,
            head_blocks=head_blocks,
            state_dict_adapter=state_dict_adapter,
            **optional,
        )


__all__ = ["DecoderFamily", "blocks", "head_blocks", "init_buffers", "param_inits"]
