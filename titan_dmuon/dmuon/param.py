"""DedicatedParam: one Muon-target matrix and everything DMuon knows about it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from .group import DedicatedParamGroup
    from .state import DPAxes


def _swap_into(p: nn.Parameter, data: torch.Tensor) -> None:
    """Make the Parameter object `p` hold `data` (a new tensor of its shape), keeping its Python attributes (DMuon's
    tags): `swap_tensors` moves them along with the contents, so the ones the new tensor lacks are put back."""
    attrs = dict(p.__dict__)
    torch.utils.swap_tensors(p, nn.Parameter(data, requires_grad=p.requires_grad))
    for key, value in attrs.items():
        if key not in p.__dict__:
            setattr(p, key, value)


def local_of(t: torch.Tensor | None) -> torch.Tensor | None:
    """The plain tensor behind `t`: a DTensor's local (TP) shard, anything else as it is."""
    return t._local_tensor if isinstance(t, DTensor) else t


@dataclass(eq=False, repr=False)
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
    axes: DPAxes | None = None  # the DP axes it is owned over (the state's, or the expert stacks')
    offset: int = 0  # into the group's packed buffer
    _owned_data: torch.Tensor | None = None
    _reduced_grad: torch.Tensor | None = None
    # Tensor parallelism (None / 0 when the param is not TP-sharded).
    shard_dim: int | None = None
    tp_group: dist.ProcessGroup | None = None
    tp_rank: int = 0
    tp_owner: int = 0  # TP rank that runs this matrix's full NS
    _orig_size: torch.Size = field(default_factory=lambda: torch.Size())  # local (TP shard) shape
    # Set by dmuon.Muon (tp_gather="backward", the matrix on the "gather" path): the momentum is kept whole on the
    # TP owner, and the reduced grad is gathered there from the backward that completes it (`_tp_gather`, the
    # gather in flight or done, consumed by the step; dropped, after waiting for it, when the grad is cleared).
    tp_full_momentum: bool = False
    _tp_gather: Any = None
    # The packed grad buffer (group.py): where this matrix's grad and its has-grad flag go.
    grad_offset: int = 0
    flag_index: int = 0
    # On the owner, with a fresh `_reduced_grad`: the fraction of ranks that had a grad (device scalar; 0 means
    # none had one, and the step skips the matrix). None once the grad is known to exist.
    _grad_seen: torch.Tensor | None = None
    # Set from it by the step (a device bool, no host read): false where no rank had a grad, which skips the
    # matrix's update as torch.optim.Muon skips a None grad. None: the grad exists.
    _has_grad: torch.Tensor | None = None
    _took_placeholder: bool = False  # DMuon itself removed the placeholder for an arriving grad
    _placeholder: torch.Tensor | None = None  # the grad a reduce leaves on the param (see `leave_grad_placeholder`)

    def __repr__(self) -> str:  # never the param's values: a sharded one has no storage to read
        return (
            f"DedicatedParam({self.fqn!r}, owner=({self.owner_shard}, {self.owner_replicate}), "
            f"shape={tuple(self.full_shape)})"
        )

    @property
    def param_name(self) -> str:
        return self.fqn

    @property
    def local(self) -> torch.Tensor:
        """The plain tensor behind the param: its DTensor's local shard, or the param itself."""
        return local_of(self.param)

    @property
    def local_grad(self) -> torch.Tensor | None:
        """This rank's own (TP-local) grad, accumulated since the last reduce; None without one (the placeholder
        a reduce leaves is none)."""
        g = local_of(self.param.grad)
        return g if g is not None and g.layout == torch.strided else None

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
        if self.axes is not None and self.axes.replicate_size > 1:
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
            _swap_into(p, stub)
        self.set_local(local)

    def set_local(self, local: torch.Tensor) -> None:
        """Make the param's tensor `local` (a view of the packed buffer, or the DDP live tensor).

        A plain param takes it through `.data`: the Parameter keeps its own version counter, so the in-place
        writes into the buffer (broadcasts) do not invalidate what autograd saved of it. A TP param (a DTensor)
        gets a new DTensor around it: autograd saves and versions the DTensor wrapper, never its local
        tensor, and torch.compile's fake tensors must see a DTensor built around the buffer's view (a local tensor
        given another storage through `.data`, or swapped in as `_local_tensor`, cannot be faked: dynamo fails
        on it, tests/distributed/test_loop_compile.py)."""
        p = self.param
        if not isinstance(p, DTensor):
            p.data = local
            return
        # A new DTensor around `local`, swapped into the same Parameter object (mutating `_local_tensor` of the
        # existing one leaves a wrapper that fake tensors cannot rebuild either).
        with torch.no_grad():
            new = DTensor.from_local(
                local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
        _swap_into(p, new)

    # ---- the grad the user sees ----------------------------------------------------------------------
    # After a reduce the param's grad lives on the owner as `_reduced_grad`; the param itself holds a
    # placeholder: a sparse all-zero tensor of the param's (local) shape, one explicit zero and no dense memory
    # (a DTensor of it for a TP param). A user clear reaches it like any grad: `p.grad = None`
    # (`model.zero_grad()`, `optimizer.zero_grad()`) removes it, `zero_grad(set_to_none=False)` zeroes it, which
    # drops its one entry. Before the next reduce and at the step the owner reads what happened
    # (`sync_cleared`), so a grad the user cleared is cleared, as torch's would be.
    def leave_grad_placeholder(self) -> None:
        """After this rank's grad was packed for the reduce: apply the user's clears since the last reduce
        (owner), then leave the placeholder."""
        self.sync_cleared()
        self._took_placeholder = False
        if self._placeholder is None or local_of(self._placeholder)._nnz() != 1:
            local = self.local
            sparse = torch.sparse_coo_tensor(
                torch.zeros(local.dim(), 1, dtype=torch.long, device=local.device),
                torch.zeros(1, dtype=local.dtype, device=local.device),
                local.shape,
                check_invariants=False,
            )
            p = self.param
            self._placeholder = DTensor(sparse, p._spec, requires_grad=False) if isinstance(p, DTensor) else sparse
        self.param.grad = self._placeholder

    def take_grad_placeholder(self) -> None:
        """A grad is about to be accumulated: apply the user's clears, and remove the placeholder so that
        autograd accumulates into nothing."""
        self.sync_cleared()
        if self._placeholder is not None and self.param.grad is self._placeholder:
            self.param.grad = None
            self._took_placeholder = True  # a None grad now is no user clear (torch.autograd.grad accumulates none)

    def sync_cleared(self) -> None:
        """Owner: if the user cleared this param's grad since the last reduce, clear `_reduced_grad` alike."""
        if self._reduced_grad is None:
            return
        g = self.param.grad
        if g is None and not self._took_placeholder:
            self.clear_grad(set_to_none=True)
        elif g is self._placeholder and local_of(g)._nnz() == 0:
            self.clear_grad(set_to_none=False)

    def clear_grad(self, set_to_none: bool) -> None:
        """What `zero_grad(set_to_none)` does to a grad, done to the owner's `_reduced_grad` (and to the gather of it
        in flight: waited for, then dropped)."""
        self.drop_tp_gather()
        if set_to_none:
            self._reduced_grad = self._grad_seen = self._has_grad = None
        elif self._reduced_grad is not None:
            self._reduced_grad.zero_()

    def reduced_grad(self) -> torch.Tensor | None:
        """The owner's reduced grad as the user's clears and the clip left it (None elsewhere)."""
        self.sync_cleared()
        if self._tp_gather is not None:
            self._tp_gather.settle()  # the clip factor kept for a gather in flight, applied once it is done
        return self._reduced_grad

    def drop_tp_gather(self) -> None:
        """Forget the gather of the reduced grad issued from the backward (after waiting for it, and applying the
        clip factor it kept): the grad is cleared, or written again by a later reduce, which gathers anew."""
        if self._tp_gather is not None:
            gather, self._tp_gather = self._tp_gather, None
            gather.settle()

    @property
    def in_owner_column(self) -> bool:
        """True on every rank whose shard coordinate is the owner's (the ranks that keep `_owned_data`)."""
        return self.shard_rank == self.owner_shard

    @property
    def is_owner(self) -> bool:
        """I1: the single global owner, the only rank that runs NS and the update."""
        return self.shard_rank == self.owner_shard and self.replicate_rank == self.owner_replicate
