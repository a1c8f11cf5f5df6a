"""Tensor parallelism inside DMuon (docs/dmuon.md, "Tensor parallelism"): TP-axis detection, TP owners,
gather -> NS -> scatter.

A dedicated param that is a DTensor sharded on a mesh dim whose name is not among the DP mesh's names is
TP-sharded. Its DP ownership works on the local shards exactly as without TP. On the "gather" path the DP-owner
ranks of its TP group gather the matrix onto the param's TP owner, which runs the same full-matrix Newton-Schulz
as every other path and scatters the orthogonalized shards back. What is gathered depends on where the momentum
lives (`Muon(tp_gather=...)`): "backward" (default) gathers the reduced gradient from the backward that
completes it, on the replicate-axis stream that accumulated it, and keeps the matrix's momentum whole on the TP owner
(`DedicatedParam.tp_full_momentum`); "step" keeps the momentum on the shards and gathers the momentum-applied
update inside `step()`. Weight decay and the update stay elementwise on the shards (lr scaled by the full shape).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from . import costs, trace
from .comm import STREAM_OF, CommLedger, Work
from .newton_schulz import gram_restarts, resolve_coefficients
from .options import MuonOptions


@dataclass(frozen=True)
class TPLayout:
    group: dist.ProcessGroup
    size: int
    rank: int
    shard_dim: int


def dp_mesh_names(shard_mesh: DeviceMesh | None, replicate_mesh: DeviceMesh | None) -> set[str]:
    names: set[str] = set()
    for m in (shard_mesh, replicate_mesh):
        if m is not None and m.mesh_dim_names:
            names.update(m.mesh_dim_names)
    return names


def tp_coordinate(shard_mesh: DeviceMesh | None, replicate_mesh: DeviceMesh | None, dp_names: set[str]) -> int | None:
    """This rank's slice coordinate, from the mesh the DP slices were cut from: its coordinates on the root mesh's
    non-DP dims (TP, and any outer dim such as a pipeline stage's), flattened; None when the DP meshes are the
    whole world or are flattened from root dims (nothing to tell apart). Taken from the mesh, not the params: with
    no TP-sharded dedicated param every rank would otherwise say 0 and the DP slices would collapse, and ranks of
    two pipeline stages have the same TP rank."""
    ref = shard_mesh if shard_mesh is not None else replicate_mesh
    root = ref._get_root_mesh() if ref is not None else None
    if root is None or root is ref or not root.mesh_dim_names or not dp_names <= set(root.mesh_dim_names):
        return None
    coord = root.get_coordinate()
    tp = 0
    for dim, name in enumerate(root.mesh_dim_names):
        if name not in dp_names:
            tp = tp * root.size(dim) + coord[dim]
    return tp


def tp_layout(name: str, p: torch.Tensor, dp_names: set[str]) -> TPLayout | None:
    """The TP layout of a dedicated param, or None when it is not TP-sharded (TP size 1 included)."""
    if not isinstance(p, DTensor):
        return None
    mesh = p.device_mesh
    found = []
    for dim, pl in enumerate(p.placements):
        if mesh.mesh_dim_names is None:
            raise ValueError(
                f"'{name}' is a DTensor on an unnamed mesh: DMuon tells TP dims from DP dims by name, so build "
                "meshes with mesh_dim_names (e.g. init_device_mesh(dev, (dp, tp), mesh_dim_names=('dp', 'tp')))"
            )
        if mesh.mesh_dim_names[dim] in dp_names:
            continue
        if isinstance(pl, Shard) and mesh.size(dim) > 1:
            found.append((dim, pl.dim))
    if not found:
        return None
    if len(found) > 1:
        raise ValueError(f"'{name}' is sharded on {len(found)} TP mesh dims: DMuon supports one TP axis")
    mesh_dim, shard_dim = found[0]
    size = mesh.size(mesh_dim)
    if p.shape[shard_dim] % size:
        raise ValueError(
            f"'{name}' has {p.shape[shard_dim]} entries on its TP-sharded dim {shard_dim}, not "
            f"divisible by the TP size {size}: DMuon needs even TP shards"
        )
    return TPLayout(mesh.get_group(mesh_dim), size, mesh.get_local_rank(mesh_dim), shard_dim)


class TPUpdate:
    """One TP param's gather -> NS on the TP owner -> scatter, on the DP-owner ranks of its TP group: both issued
    async from a side stream (`comm.STREAM_OF`: the gather's is `stream`; their buffers allocated by the compute
    stream, held for the side stream), waited by the compute stream where it reads the gathered matrix / the
    scattered shard.

    `src` is this rank's shard of what is gathered: the momentum-applied update (gathered in `step()`), or the
    reduced gradient `dp._reduced_grad` itself (gathered from the backward, `gather_reduced_grad`). A gradient
    gathered before the step may still be scaled by the clip (`rescale`): the factor is kept, not applied to a
    shard the gather may still be reading, and applied once the gather is done (`settle`), to the shard and to
    the gathered matrix."""

    def __init__(self, dp, src: torch.Tensor, ledger: CommLedger, buffers: dict | None, stream: str | None = None):
        self.dp = dp
        self.buffers = buffers  # reused scratch when tp_buffer_reuse asks for it
        size = dp.tp_group.size()
        self.owner_global = dist.get_global_rank(dp.tp_group, dp.tp_owner)
        self.full_numel = src.numel() * size
        self.src = src if src.is_contiguous() else src.contiguous()
        self.gathered = [self._scratch("gather", i, self.src) for i in range(size)] if dp.is_tp_owner else None
        self.scale: torch.Tensor | None = None  # the clip factors since the gather was issued (the gathered matrix's)
        self.shard_scale: torch.Tensor | None = None  # those not applied to the shard yet (the gather reads it)
        self._settled = False
        ledger.record("tp_gather", self.full_numel, size, self.src.element_size())
        streams = dp.group.state.streams
        with trace.phase(trace.TP_GATHER), streams.use(stream or STREAM_OF["tp_gather"]):
            streams.hold(self.src, *(self.gathered or ()))
            self._work = Work(
                [
                    dist.gather(
                        self.src, gather_list=self.gathered, dst=self.owner_global, group=dp.tp_group, async_op=True
                    )
                ]
            )
        self._ledger = ledger
        self.out_local: torch.Tensor | None = None

    def rescale(self, coef: torch.Tensor) -> None:
        """The clip scaled the gradient this gather moves by `coef` (a device scalar; no host sync): the gathered
        matrix takes it at the step; the shard at once if the gather is done, else once it is (`settle`)."""
        self.scale = coef if self.scale is None else self.scale * coef
        if self._settled:
            self.src.mul_(coef.to(self.src.device))
        else:
            self.shard_scale = coef if self.shard_scale is None else self.shard_scale * coef

    def settle(self) -> None:
        """Wait for the gather; apply the clip factor kept for the shard meanwhile (the owner's reduced grad then
        holds what the user's clip made of it)."""
        if self._settled:
            return
        self._settled = True
        with trace.phase(trace.TP_GATHER_WAIT):
            self._work.wait()
        if self.shard_scale is not None:
            self.src.mul_(self.shard_scale.to(self.src.device))
            self.shard_scale = None

    def _scratch(self, kind: str, i: int, like: torch.Tensor) -> torch.Tensor:
        if self.buffers is None or kind not in self.buffers["kinds"]:
            return torch.empty_like(like)
        key = (self.dp.fqn, kind, i)
        buf = self.buffers["store"].get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = self.buffers["store"][key] = torch.empty_like(like)
        return buf

    def full_update(self) -> torch.Tensor | None:
        """Wait for the gather; on the TP owner return the full (m, n) matrix gathered (times the pending clip
        factor)."""
        self.settle()
        if not self.dp.is_tp_owner:
            return None
        full = torch.cat(self.gathered, dim=self.dp.shard_dim)
        self.gathered = None  # the shards are in `full` now (a reused scratch stays in the state's store)
        if self.scale is not None:
            full.mul_(self.scale.to(full.device))
        return full

    def scatter(self, ortho_full: torch.Tensor | None, like: torch.Tensor) -> None:
        """Send each TP rank its shard of the orthogonalized update (async)."""
        dp = self.dp
        self.out_local = self._scratch("scatter", -1, like)
        chunks = None
        if dp.is_tp_owner:
            chunks = [c.contiguous() for c in ortho_full.to(like.dtype).chunk(dp.tp_group.size(), dim=dp.shard_dim)]
        self._ledger.record("tp_scatter", self.full_numel, dp.tp_group.size(), like.element_size())
        streams = dp.group.state.streams
        with trace.phase(trace.TP_SCATTER), streams.use(STREAM_OF["tp_scatter"]):
            streams.hold(self.out_local, *(chunks or ()))
            self._work = Work(
                [
                    dist.scatter(
                        self.out_local, scatter_list=chunks, src=self.owner_global, group=dp.tp_group, async_op=True
                    )
                ]
            )

    def wait(self) -> torch.Tensor:
        with trace.phase(trace.TP_SCATTER):
            self._work.wait()
        return self.out_local


def gather_reduced_grads(dps: list, ledger: CommLedger, buffers: dict | None) -> None:
    """From the backward, once the reduce has completed these TP matrices' reduced grads: gather each onto its TP
    owner, issued now, so the gathers run beside the rest of the backward (`DedicatedParam.tp_full_momentum`).
    They are issued from the replicate-axis stream, which accumulated the grads they read: no other stream waits
    for that axis (the reduce stream's next packs and stage-1 reduces go on). A gather an earlier backward of the
    same step issued is replaced (it moved a partial sum: accumulation without `no_sync`); the caller waited for
    it before the reduce wrote into the grad it reads."""
    for dp in dps:
        dp._tp_gather = TPUpdate(dp, dp._reduced_grad, ledger, buffers, stream=STREAM_OF["tp_grad_gather"])


def momentum_shard(dp, buf: torch.Tensor | None) -> torch.Tensor | None:
    """This DP owner's TP shard of a matrix's momentum `buf` (its optimizer state here, or None): the buffer
    itself, or for a matrix whose momentum is kept whole on its TP owner, the owner's chunk of it (a scatter
    over the TP group: every DP owner of the matrix calls this, in the same matrix order)."""
    if not dp.tp_full_momentum:
        return buf
    out = torch.empty(dp._orig_size, dtype=torch.float32, device=dp._owned_data.device)
    chunks = [c.contiguous() for c in buf.chunk(dp.tp_group.size(), dim=dp.shard_dim)] if dp.is_tp_owner else None
    owner = dist.get_global_rank(dp.tp_group, dp.tp_owner)
    dist.scatter(out, scatter_list=chunks, src=owner, group=dp.tp_group, async_op=True).wait()
    return out


def momentum_home(dp, shard: torch.Tensor) -> torch.Tensor | None:
    """`momentum_shard`'s inverse: what this DP owner keeps of a matrix's momentum given its TP `shard` (the shard
    itself, or for a matrix whose momentum is kept whole on its TP owner, the whole matrix there and None on the
    other TP ranks: a gather over the TP group)."""
    if not dp.tp_full_momentum:
        return shard
    parts = [torch.empty_like(shard) for _ in range(dp.tp_group.size())] if dp.is_tp_owner else None
    owner = dist.get_global_rank(dp.tp_group, dp.tp_owner)
    dist.gather(shard.contiguous(), gather_list=parts, dst=owner, group=dp.tp_group, async_op=True).wait()
    return torch.cat(parts, dim=dp.shard_dim) if parts is not None else None


def _shard_dim(dp) -> int | None:
    """The TP-sharded dim of a dedicated param, None when it is not TP-sharded."""
    return dp.shard_dim if dp.tp_group is not None else None


def heads_are_local(dp, head_blocks: tuple[int, int]) -> bool:
    """`costs.heads_are_local` of a dedicated param: every head block lies whole in one TP shard (otherwise the
    matrix takes gather -> per-head NS on the full matrix -> scatter)."""
    return costs.heads_are_local(dp._orig_size, _shard_dim(dp), head_blocks)


def check_gram_policy(policy: object) -> str:
    """`costs.check_tp_gram_policy`: `policy` when it is a `tp_distributed_gram_policy` value, else ValueError."""
    return costs.check_tp_gram_policy(policy)


def gram_restarts_of(options) -> tuple[int, ...]:
    """The Gram NS restarts of a `MuonOptions`' ns_coefficients and ns_steps (how many all-reduces the Gram path
    issues: one more than these)."""
    return gram_restarts(resolve_coefficients(options.ns_coefficients, options.ns_steps))


def update_decision(
    dp, head_blocks: tuple[int, int] | None, distributed_gram: bool, policy: str = "beneficial", options=None
) -> costs.TPDecision:
    """`costs.tp_decision` of a dedicated param under `tp_distributed_gram_policy` `policy`, its Gram restarts
    those of `options` (a `MuonOptions`, the optimizer's: default `MuonOptions()`)."""
    options = MuonOptions() if options is None else options
    return costs.tp_decision(
        dp.full_shape,
        dp._orig_size,
        _shard_dim(dp),
        head_blocks,
        distributed_gram=distributed_gram,
        policy=policy,
        restarts=gram_restarts_of(options),
    )


def update_path(
    dp, head_blocks: tuple[int, int] | None, distributed_gram: bool, policy: str = "beneficial", options=None
) -> costs.TPPath:
    """`update_decision`'s path of a dedicated param: "local", "gram" or "gather"."""
    return update_decision(dp, head_blocks, distributed_gram, policy, options).path


def all_reduce_gram(dp, ledger: CommLedger, gram: torch.Tensor) -> torch.Tensor:
    """Sum the TP blocks' partial Gram matrices (one s×s all-reduce over the param's TP group)."""
    ledger.record("tp_gram", gram.numel(), dp.tp_group.size(), gram.element_size(), factor=2)
    dist.all_reduce(gram, group=dp.tp_group, async_op=True).wait()  # consumed at once, by the next NS product
    return gram


def full_from_shards(local: torch.Tensor, dp) -> torch.Tensor:
    """All-gather a param's TP shards into the full logical matrix (identity when not TP-sharded)."""
    if dp.tp_group is None:
        return local
    parts = [torch.empty_like(local) for _ in range(dp.tp_group.size())]
    dist.all_gather(parts, local.contiguous(), group=dp.tp_group, async_op=True).wait()
    return torch.cat(parts, dim=dp.shard_dim)


def shard_of_full(full: torch.Tensor, dp) -> torch.Tensor:
    """This TP rank's shard of a full logical matrix."""
    if dp.tp_group is None:
        return full
    return full.chunk(dp.tp_group.size(), dim=dp.shard_dim)[dp.tp_rank]
