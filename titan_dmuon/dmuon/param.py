"""DedicatedParam: one Muon-target matrix and everything DMuon knows about it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from .group import DedicatedParamGroup


def local_of(t: torch.Tensor | None) -> torch.Tensor | None:
    """The plain tensor behind `t`: a DTensor's local (TP) shard, anything else as it is."""
    return t._local_tensor if isinstance(t, DTensor) else t


@dataclass(eq=False)
class DedicatedParam:
    """A dedicated matrix: its owner coordinates, the owner's fp32 master copy and its reduced grad.

    The module's `param` stays registered in the module but is a view into its group's packed buffer,
    whose storage exists only while the group is unsharded (placeholder otherwise). `_owned_data`
    exists on every rank of the owner's shard column (I2); `_reduced_grad` only on the global owner (I3).
    """

    fqn: str
    param: nn.Parameter
    owner_shard: int
    owner_replicate: int
    shard_rank: int
    replicate_rank: int
    full_shape: torch.Size
    group: DedicatedParamGroup | None = None
    offset: int = 0  # into the group's packed buffer
    _owned_data: torch.Tensor | None = None
    _reduced_grad: torch.Tensor | None = None
    # Tensor parallelism (None / 0 when the param is not TP-sharded).
    shard_dim: int | None = None
    tp_group: dist.ProcessGroup | None = None
    tp_rank: int = 0
    tp_owner: int = 0  # TP rank that runs this matrix's full NS
    _orig_size: torch.Size = field(default_factory=lambda: torch.Size())  # local (TP shard) shape

    @property
    def param_name(self) -> str:
        return self.fqn

    @property
    def local(self) -> torch.Tensor:
        """The plain tensor behind the param: its DTensor's local shard, or the param itself."""
        return local_of(self.param)

    @property
    def local_grad(self) -> torch.Tensor | None:
        return local_of(self.param.grad)

    @property
    def is_tp_owner(self) -> bool:
        """True on the one TP rank that runs NS for this matrix (always True without TP)."""
        return self.tp_group is None or self.tp_rank == self.tp_owner

    @property
    def numel(self) -> int:
        return self._orig_size.numel()

    @property
    def owner_rank(self) -> int | tuple[int, int]:
        """`int` shard rank in 1D, `(shard, replicate)` under HSDP."""
        if self.group is not None and self.group.state.replicate_size > 1:
            return (self.owner_shard, self.owner_replicate)
        return self.owner_shard

    def region(self) -> tuple[slice, ...]:
        """Which part of the full logical matrix (`full_shape`) this rank's local tensor holds: all of it, or
        its TP shard (DMuon's TP shards are even chunks along `shard_dim`)."""
        out = [slice(0, int(n)) for n in self.full_shape]
        if self.shard_dim is not None:
            size = int(self._orig_size[self.shard_dim])
            out[self.shard_dim] = slice(self.tp_rank * size, (self.tp_rank + 1) * size)
        return tuple(out)

    def bind_local(self, local: torch.Tensor) -> None:
        """Make the registered param hold `local` (a DTensor: as its local TP shard) through `.data`, so it keeps
        its own version counter (`local` is a view of the packed buffer, which is written in place), and keep
        the same Parameter object, which FSDP2's ignored set, DMuon's maps and the optimizer hold.

        A meta tensor cannot move to a device through `.data`: the param is first swapped in place with a
        placeholder on the device (zero strides: one element of storage); `swap_tensors` moves Python attributes
        along with the contents, so the ones the placeholder lacks (DMuon's tags) are put back."""
        p = self.param
        if p.device.type == "meta":
            stub = torch.empty_strided(local.shape, (0,) * local.dim(), dtype=local.dtype, device=local.device)
            if isinstance(p, DTensor):
                stub = DTensor.from_local(
                    stub, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )
            attrs = dict(p.__dict__)
            torch.utils.swap_tensors(p, nn.Parameter(stub, requires_grad=p.requires_grad))
            for key, value in attrs.items():
                if key not in p.__dict__:
                    setattr(p, key, value)
        local_of(p).data = local

    @property
    def in_owner_column(self) -> bool:
        """True on every rank whose shard coordinate is the owner's (the ranks that keep `_owned_data`)."""
        return self.shard_rank == self.owner_shard

    @property
    def is_owner(self) -> bool:
        """I1: the single global owner, the only rank that runs NS and the update."""
        return self.shard_rank == self.owner_shard and self.replicate_rank == self.owner_replicate
