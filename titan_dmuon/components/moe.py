"""The mixture-of-experts protocol: the one way the framework finds and drives an MoE layer.

The trainer (the auxiliary loss's scale under accumulation, the load metrics, the auxiliary-loss-free bias step),
expert parallelism (which expert stacks to shard, whose dispatcher to swap), the optimizer components and FSDP2
(the expert stacks' own units), the planner (the all-to-all bytes) and the metrics all recognize a layer the same
way, `isinstance(module, MoELayer)`, and use only what this class declares. A model family's MoE layer
(titan_dmuon/models/common/moe.py) subclasses it; nothing is found by attribute names.

What a layer provides:
  * `experts`: a module whose 3-D parameters are the expert stacks, `[num_experts, out, in]` (expert e is slice
    e). Expert parallelism shards them on dim 0; Muon orthogonalizes each slice as one matrix.
  * `dispatcher`: a plain attribute with `dispatch(rows, counts) -> (rows, local_counts)` and
    `combine(out) -> out` (see titan_dmuon/models/common/moe.py); expert parallelism replaces it.
  * `num_experts`, `top_k`: the routing's sizes.
  * `aux_loss_scale`: multiplies the auxiliary loss's gradient; the trainer sets 1 / gradient accumulation steps,
    as it scales the cross-entropy loss.
  * `read_stats()` -> (tokens per expert int64 [E], the sum of the auxiliary losses fp32 scalar, the number of
    training forwards) since the last call, resetting them; `update_bias(counts)`: the auxiliary-loss-free
    balancing step from counts summed over every rank (the same on every rank).
"""

from __future__ import annotations

import torch
from torch import nn


class MoELayer(nn.Module):
    """Base class of every mixture-of-experts layer (see the module docstring for the contract)."""

    experts: nn.Module
    num_experts: int
    top_k: int
    aux_loss_scale: float = 1.0

    def expert_params(self) -> dict[str, nn.Parameter]:
        """The expert stacks: `experts`' own 3-D parameters by name, in registration order."""
        return {n: p for n, p in self.experts.named_parameters(recurse=False) if p.dim() == 3}

    def read_stats(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        raise NotImplementedError

    def update_bias(self, counts: torch.Tensor) -> None:
        raise NotImplementedError


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """The model's MoE layers, in registration (forward) order."""
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """Every MoE layer's auxiliary-loss gradient scale (1 / gradient accumulation steps in training)."""
    for layer in moe_layers(model):
        layer.aux_loss_scale = scale


def moe_stats(model: nn.Module) -> dict[str, torch.Tensor]:
    """{"tokens_per_expert": int64 [n_moe_layers, E] counted on this rank since the last call, "aux_loss": fp32
    scalar, the mean over layers and micro-batches since the last call}, resetting the counters. A model without
    MoE layers gives an empty [0, 0] count and a zero aux loss."""
    layers = moe_layers(model)
    if not layers:
        return {"tokens_per_expert": torch.zeros(0, 0, dtype=torch.int64), "aux_loss": torch.zeros(())}
    stats = [layer.read_stats() for layer in layers]
    aux = torch.stack([a for _, a, _ in stats]).sum() / max(sum(n for _, _, n in stats), 1)
    return {"tokens_per_expert": torch.stack([t for t, _, _ in stats]), "aux_loss": aux.float()}


def update_moe_bias(model: nn.Module, tokens_per_expert: torch.Tensor) -> None:
    """Each MoE layer's auxiliary-loss-free bias step from the global (all-reduced over every rank that routes
    tokens) `tokens_per_expert` [n_moe_layers, E]; a layer whose update rate is 0 does nothing."""
    layers = moe_layers(model)
    if len(layers) != tokens_per_expert.shape[0]:
        raise ValueError(f"{tokens_per_expert.shape[0]} rows of counts for {len(layers)} MoE layers")
    for layer, counts in zip(layers, tokens_per_expert, strict=True):
        layer.update_bias(counts)
