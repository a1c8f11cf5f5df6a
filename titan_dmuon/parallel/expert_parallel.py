"""Expert parallelism (EP): the experts of each MoE layer split over the ranks of a 1-D `ep_mesh`, the tokens
travel to the rank that holds their expert and back.

An MoE layer (a `MoELayer`, titan_dmuon/components/moe.py: a `dispatcher` and `experts` whose 3-D params are
[E, ...]) sorts its (token, slot) rows by global expert id and calls

    rows, local_counts = self.dispatcher.dispatch(rows, counts)   # counts: int64 [E]
    out = self.experts(rows, local_counts)                        # this rank's E/ep experts, local_counts [E/ep]
    out = self.dispatcher.combine(out)                            # back in dispatch's input order

`apply_ep` shards the expert params (DTensor Shard(0): EP rank r holds experts [r*E/ep, (r+1)*E/ep)) and puts an
`AllToAllDispatcher` in place of the default identity one. `all_to_all_bytes` is the traffic the planner counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from titan_dmuon.components.moe import MoELayer

__all__ = ["AllToAllDispatcher", "all_to_all_bytes", "apply_ep", "expert_modules"]


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Rows `x` split by `input_splits` (one part per rank of `group`) sent out, `output_splits` rows received."""
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """A differentiable all_to_all_single over dim 0: its backward sends each row's grad back where the row came
    from, i.e. the same all_to_all with the split sizes swapped. The splits live on the autograd node, so a
    backward never reads the dispatcher's (possibly since overwritten) state."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.input_splits, ctx.output_splits, ctx.group), None, None, None


def _expert_major_index(recv: torch.Tensor, total: int) -> torch.Tensor:
    """The index that reorders received rows from (source rank, local expert) order into (local expert, source
    rank) order: `received.index_select(0, index)`. `recv` [ep, L] holds each (source, expert) chunk's row count;
    computed on the rows' device (`output_size` spares repeat_interleave a device sync)."""
    ep, n_local = recv.shape
    flat = recv.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view(ep, n_local).t().reshape(-1)  # chunk starts, in expert-major order
    sizes = recv.t().reshape(-1)  # chunk sizes, in expert-major order
    out_starts = torch.cumsum(sizes, 0) - sizes
    # row i of chunk c sits at starts[c] + i on arrival and goes to out_starts[c] + i
    shift = torch.repeat_interleave(starts - out_starts, sizes, output_size=total)
    return shift + torch.arange(total, device=recv.device, dtype=recv.dtype)


@dataclass
class _Route:
    """What a dispatch decided and its combine undoes: the row splits per peer rank and the local re-sort."""

    input_splits: list[int]  # rows this rank sends to each EP rank (dispatch)
    output_splits: list[int]  # rows this rank receives from each EP rank (dispatch)
    order: torch.Tensor | None  # expert-major re-sort of the received rows; None when it is the identity


class AllToAllDispatcher(nn.Module):
    """Sends each row to the EP rank that holds its expert (dispatch) and brings the experts' outputs back
    (combine). Dispatch makes two all_to_all_single calls (the [ep, E/ep] counts, then the rows), combine one (the
    rows back, with dispatch's split sizes swapped).

    An nn.Module (with no params) so that it can replace a default dispatcher that is a registered child. The
    state of the last dispatch (`_Route`) stays until the next dispatch overwrites it: an activation checkpoint's
    recompute runs dispatch then combine again on the same inputs and gets the same route, and a backward reads
    its splits from the autograd graph, never from here, so nothing depends on how often either was called.
    """

    def __init__(self, group: dist.ProcessGroup, num_experts: int):
        super().__init__()
        ep = dist.get_world_size(group)
        if num_experts % ep:
            raise ValueError(f"{num_experts} experts do not split evenly over expert-parallel degree {ep}")
        self.group, self.num_experts, self.ep_size = group, num_experts, ep
        self.num_local = num_experts // ep
        self._route: _Route | None = None

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, ep={self.ep_size}"

    @torch.compiler.disable  # collectives and a host sync: run eagerly, between the compiled parts of a block
    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [n, dim] sorted by global expert id with `counts` int64 [E] rows per expert -> (the rows of this
        rank's E/ep experts, from every rank, sorted by local expert id; int64 [E/ep] rows per local expert)."""
        if counts.shape != (self.num_experts,):
            raise ValueError(f"counts has shape {tuple(counts.shape)}, expected ({self.num_experts},)")
        ep, n_local = self.ep_size, self.num_local
        send = counts.to(device=rows.device, dtype=torch.int64).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # [ep, E/ep]: row s = what rank s sends to my experts
        # The one host sync of a dispatch (a device sync on CUDA, as in every EP implementation): the collective
        # needs its split sizes on the host. Combine reuses them.
        sent, received = torch.stack([send, recv]).view(2, ep, n_local).sum(2).tolist()
        if rows.shape[0] != sum(sent):
            raise ValueError(f"dispatch got {rows.shape[0]} rows but counts sum to {sum(sent)}")
        out = _AllToAll.apply(rows, received, sent, self.group)
        recv = recv.view(ep, n_local)
        order = None if ep == 1 or n_local == 1 else _expert_major_index(recv, sum(received))
        if order is not None:
            out = out.index_select(0, order)
        self._route = _Route(input_splits=sent, output_splits=received, order=order)
        return out, recv.sum(0)

    @torch.compiler.disable
    def combine(self, out: torch.Tensor) -> torch.Tensor:
        """The experts' output rows (dispatch's output order) -> [n, dim] in the order dispatch received them."""
        route = self._route
        if route is None:
            raise RuntimeError("AllToAllDispatcher.combine() called before any dispatch()")
        if out.shape[0] != sum(route.output_splits):
            raise ValueError(f"combine got {out.shape[0]} rows, the last dispatch delivered {sum(route.output_splits)}")
        if route.order is not None:  # undo the expert-major re-sort: back to (source rank, local expert) order
            inverse = torch.empty_like(route.order)
            inverse[route.order] = torch.arange(route.order.numel(), device=inverse.device, dtype=inverse.dtype)
            out = out.index_select(0, inverse)
        return _AllToAll.apply(out, route.input_splits, route.output_splits, self.group)


def _moe_modules(model: nn.Module) -> list[tuple[str, MoELayer, dict[str, nn.Parameter]]]:
    """(name, layer, its expert stacks) of every MoE layer (titan_dmuon/components/moe.py), in module order."""
    return [(name, m, m.expert_params()) for name, m in model.named_modules() if isinstance(m, MoELayer)]


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The `experts` of every MoE layer, in module order: what parallelize.py makes FSDP2 units of their own."""
    return [module.experts for _, module, _ in _moe_modules(model)]


def _num_experts(name: str, params: dict[str, nn.Parameter], ep: int) -> int:
    """E, the common dim 0 of a module's expert params, checked against the EP degree."""
    where = name or "the model"
    if not params:
        raise ValueError(f"{where}: an MoE layer whose experts hold no 3-D expert stack")
    sizes = {n: p.shape[0] for n, p in params.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"{where}: the expert params disagree on the number of experts (dim 0): {sizes}")
    if any(isinstance(p, DTensor) for p in params.values()):
        raise ValueError(f"{where}: the expert params are DTensors already (apply_ep twice?)")
    num_experts = next(iter(sizes.values()))
    if num_experts % ep:
        raise ValueError(
            f"{where}: {num_experts} experts do not split evenly over expert-parallel degree {ep} "
            f"(the number of experts must be divisible by the EP degree)"
        )
    return num_experts


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> int:
    """Expert parallelism over the 1-D `ep_mesh`: every MoE module's 3-D expert params become DTensors Shard(0)
    (EP rank r keeps experts [r*E/ep, (r+1)*E/ep)) and its dispatcher an `AllToAllDispatcher`. Works on the meta
    device (nothing moves then; off meta, rank 0's full weights are scattered, as distribute_tensor does). Every
    module is checked before any is changed. Returns the number of MoE modules changed."""
    if ep_mesh.ndim != 1:
        raise ValueError(f"apply_ep needs a 1-D mesh, got {ep_mesh.ndim} dims")
    ep = ep_mesh.size()
    targets = [(name, module, params, _num_experts(name, params, ep)) for name, module, params in _moe_modules(model)]
    for _, module, params, num_experts in targets:
        experts = module.experts
        for pname, p in params.items():
            sharded = distribute_tensor(p.detach(), ep_mesh, [Shard(0)])
            experts.register_parameter(pname, nn.Parameter(sharded, requires_grad=p.requires_grad))
        module.dispatcher = AllToAllDispatcher(ep_mesh.get_group(), num_experts)
    return len(targets)


def all_to_all_bytes(tokens: int, top_k: int, dim: int, ep: int, elem_bytes: int, n_moe_layers: int) -> float:
    """Expected bytes one rank sends over the EP all-to-alls in a step, under uniform routing.

        bytes = 4 * n_moe_layers * tokens * top_k * dim * elem_bytes * (ep - 1) / ep

    `tokens` is this rank's tokens in the step (all micro-batches); each MoE layer moves tokens*top_k rows of
    `dim` elements. Uniform routing sends 1/ep of them to each EP rank, and the 1/ep that stays home costs
    nothing, hence (ep - 1)/ep. Four all-to-alls per layer: forward dispatch and combine, and in backward the
    grads of both the reverse way. Not counted: the [E] int64 counts exchange of each dispatch (E * 8 bytes) and
    the forward's two again when activation checkpointing recomputes the layer (then 6 instead of 4).
    """
    if ep < 1:
        raise ValueError(f"ep must be >= 1, got {ep}")
    return 4.0 * n_moe_layers * tokens * top_k * dim * elem_bytes * (ep - 1) / ep
