"""Parameter initialization, in one place: what each parameter's values are and who allocates them.

Topology-invariant values: a parameter's initial values are a function of (seed, FQN) only.

Why: a run's initial weights must not depend on the cluster shape, and no rank may build the whole model to
initialize it. So each parameter's full (logical) tensor is cut into a fixed grid of tiles (`TILE` rows x
columns, a function of the shape alone), and tile (i, j) is drawn from its own generator seeded by a hash of
(seed, FQN, i, j). A rank that holds any part of the tensor (an FSDP2 row shard, a TP block, FSDP over TP's
strided rows, a DMuon owner's TP shard) draws only the tiles that part touches and copies the entries it holds:
the same numbers wherever they land, and at most one tile of scratch per draw.

The model family declares each parameter's distribution by FQN (`ParamInit`, through its ModelSpec); the
materialization step (`materialize` below) works out which global indices a local tensor holds and calls `fill_`.
Values depend on the RNG of the device they are drawn on (CPU and CUDA generators differ).

Materialization, the one step after `parallelize` (which runs on the meta device): each rank allocates only
what it holds and fills it with the values above.

What a rank holds: its FSDP2 shards (over TP: of its TP shard; `_StridedShard` rows included), the params the
optimizer component keeps itself (DMuon: the fp32 masters of this rank's owner column, through
`dmuon.init_dedicated_params`), and the buffers. The values of every entry are a function of (seed, FQN,
position), so a run starts from the same weights on any cluster shape. No rank allocates a tensor it does not
hold; the scratch is one init tile at a time.

    model = parallelize(build_meta_model(cfg, spec, vocab), dims, mesh, cfg, spec, optimizer)   # meta
    materialize(model, spec, optimizer, device, seed)
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

if TYPE_CHECKING:
    from titan_dmuon.components.model import ModelSpec
    from titan_dmuon.components.optimizer import OptimizerComponent

TILE = (512, 2048)
"""(rows, columns) of one independently seeded tile; 1D tensors use tiles of TILE[0] * TILE[1] entries."""


@dataclass(frozen=True)
class ParamInit:
    """How one parameter's initial values are drawn (torch.nn.init's conventions)."""

    kind: Literal["normal", "trunc_normal", "uniform", "constant"]
    mean: float = 0.0
    """normal, trunc_normal: the mean."""
    std: float = 1.0
    """normal, trunc_normal: the standard deviation."""
    a: float = -2.0
    """trunc_normal: lower cutoff (an absolute value, as in nn.init.trunc_normal_); uniform: lower bound."""
    b: float = 2.0
    """trunc_normal: upper cutoff; uniform: upper bound."""
    value: float = 0.0
    """constant: the value."""


def normal(std: float = 1.0, mean: float = 0.0) -> ParamInit:
    return ParamInit("normal", mean=mean, std=std)


def trunc_normal(std: float, mean: float = 0.0, a: float = -2.0, b: float = 2.0) -> ParamInit:
    return ParamInit("trunc_normal", mean=mean, std=std, a=a, b=b)


def uniform(a: float, b: float) -> ParamInit:
    return ParamInit("uniform", a=a, b=b)


def constant(value: float) -> ParamInit:
    return ParamInit("constant", value=value)


def tile_seed(seed: int, fqn: str, i: int, j: int) -> int:
    """The seed of tile (i, j) of parameter `fqn`: a hash, the same in every process (not Python's `hash`)."""
    digest = hashlib.blake2b(f"{seed}\0{fqn}\0{i}\0{j}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _draw(init: ParamInit, shape: tuple[int, int], generator: torch.Generator, device: torch.device) -> torch.Tensor:
    t = torch.empty(shape, dtype=torch.float32, device=device)
    if init.kind == "normal":
        return t.normal_(init.mean, init.std, generator=generator)
    if init.kind == "trunc_normal":
        return nn.init.trunc_normal_(t, init.mean, init.std, init.a, init.b, generator=generator)
    if init.kind == "uniform":
        return t.uniform_(init.a, init.b, generator=generator)
    raise ValueError(f"unknown init kind {init.kind!r}")


def _as_2d(full_shape: Sequence[int], index: Sequence[torch.Tensor]) -> tuple[tuple[int, int], list[torch.Tensor]]:
    """A tensor of any rank as (rows, cols) with its index per dim: 2D as it is, 1D as one row of tiles, 3D and up
    as the 2D matrix of its leading dims flattened into rows (a stack of matrices, e.g. MoE experts [E, out, in]:
    the row index of entry (e, r) is e * out + r, so a shard of whole matrices or of rows draws the same values)."""
    if len(full_shape) == 2:
        return (int(full_shape[0]), int(full_shape[1])), list(index)
    if len(full_shape) == 1:
        return (1, int(full_shape[0])), [torch.zeros(1, dtype=torch.long, device=index[0].device), index[0]]
    if len(full_shape) == 0:
        return (1, 1), [torch.zeros(1, dtype=torch.long)] * 2
    rows = index[0]
    for size, ix in zip(full_shape[1:-1], index[1:-1], strict=True):
        rows = (rows.unsqueeze(1) * int(size) + ix.unsqueeze(0)).flatten()
    return (math.prod(int(n) for n in full_shape[:-1]), int(full_shape[-1])), [rows, index[-1]]


@torch.no_grad()
def fill_(
    out: torch.Tensor, init: ParamInit, seed: int, fqn: str, full_shape: Sequence[int], index: Sequence[torch.Tensor]
) -> torch.Tensor:
    """Fill `out` with the entries of `fqn`'s full tensor (shape `full_shape`) at the global indices `index`
    (one ascending 1D index tensor per dim: `out[i, j] = full[index[0][i], index[1][j]]`), drawing only the
    tiles those entries fall in. Returns `out`."""
    if init.kind == "constant":
        return out.fill_(init.value)
    if out.numel() == 0:
        return out
    (rows, cols), (ri, ci) = _as_2d(full_shape, index)
    tr, tc = (TILE[0], TILE[1]) if len(full_shape) >= 2 else (1, TILE[0] * TILE[1])
    out2 = out.view(len(ri), len(ci))
    device = out.device
    ri, ci = ri.to("cpu"), ci.to("cpu")
    generator = torch.Generator(device=device)
    for i in torch.unique(ri // tr).tolist():
        rpos = torch.nonzero(ri // tr == i).flatten()
        r0 = i * tr
        for j in torch.unique(ci // tc).tolist():
            cpos = torch.nonzero(ci // tc == j).flatten()
            c0 = j * tc
            generator.manual_seed(tile_seed(seed, fqn, i, j))
            tile = _draw(init, (min(tr, rows - r0), min(tc, cols - c0)), generator, device)
            rows_in = (ri[rpos] - r0).to(device)
            cols_in = (ci[cpos] - c0).to(device)
            block = tile.index_select(0, rows_in).index_select(1, cols_in)
            _put(out2, rpos.to(device), cpos.to(device), block)
    return out


def _put(out2: torch.Tensor, rpos: torch.Tensor, cpos: torch.Tensor, block: torch.Tensor) -> None:
    """out2[rpos][:, cpos] = block, as a slice copy when the positions are contiguous (they usually are)."""
    r_contig = rpos.numel() == int(rpos[-1] - rpos[0]) + 1
    c_contig = cpos.numel() == int(cpos[-1] - cpos[0]) + 1
    if r_contig and c_contig:
        r0, c0 = int(rpos[0]), int(cpos[0])
        out2[r0 : r0 + rpos.numel(), c0 : c0 + cpos.numel()].copy_(block)
    else:
        out2[rpos[:, None], cpos[None, :]] = block.to(out2.dtype)


def full_index(shape: Sequence[int], device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """The index of a whole tensor: every position of every dim."""
    return [torch.arange(int(n), device=device) for n in shape]


@torch.no_grad()
def init_params(model: nn.Module, inits: Mapping[str, ParamInit], seed: int) -> None:
    """Initialize an unsharded, materialized model in place: every parameter's whole tensor, by FQN."""
    for fqn, p in model.named_parameters():
        if fqn not in inits:
            raise KeyError(f"no ParamInit for parameter '{fqn}': the model family's param_inits must cover it")
        fill_(p.data, inits[fqn], seed, fqn, p.shape, full_index(p.shape, p.device))


def global_index(p: torch.Tensor) -> list[torch.Tensor]:
    """Per dim, the global positions this rank's local tensor of `p` holds (ascending).

    A DTensor's sharding of one tensor dim does not depend on the other dims, so each dim's positions are
    those a 1D DTensor of `arange(size)` with the same placements (this dim's shards, Replicate elsewhere)
    keeps locally: torch's own splitting, `_StridedShard` (FSDP2 over TP) included, with no communication.
    """
    if not isinstance(p, DTensor):
        return full_index(p.shape, p.device)
    index = []
    for dim, size in enumerate(p.shape):
        placements = [_on_dim(pl, dim) for pl in p.placements]
        positions = torch.arange(size, device=p.to_local().device)
        if all(isinstance(pl, Replicate) for pl in placements):
            index.append(positions)
            continue
        index.append(distribute_tensor(positions, p.device_mesh, placements, src_data_rank=None).to_local())
    return index


def _on_dim(placement, dim: int):
    """`placement` as it acts on a 1D tensor of tensor dim `dim`'s positions."""
    if isinstance(placement, _StridedShard):
        return _StridedShard(0, split_factor=placement.split_factor) if placement.dim == dim else Replicate()
    if isinstance(placement, Shard):
        return Shard(0) if placement.dim == dim else Replicate()
    return Replicate()  # Replicate, or Partial (a param is never partial)


@contextlib.contextmanager
def _without(model: nn.Module, params: set[nn.Parameter]) -> Iterator[None]:
    """Take `params` out of their modules for the block (so `to_empty` neither allocates nor replaces them),
    then put them back in their original order."""
    saved = []
    for module in model.modules():
        if any(p in params for p in module._parameters.values() if p is not None):
            saved.append((module, list(module._parameters.items())))
            for key in [k for k, p in module._parameters.items() if p is not None and p in params]:
                del module._parameters[key]
    try:
        yield
    finally:
        for module, items in saved:
            module._parameters.clear()
            module._parameters.update(items)


@torch.no_grad()
def materialize(
    model: nn.Module, spec: ModelSpec, optimizer: OptimizerComponent, device: torch.device, seed: int
) -> None:
    """Allocate this rank's share of the parallelized meta `model` on `device` and initialize it from
    `spec.param_inits` with `seed`; then `spec.init_buffers`."""
    inits = spec.param_inits(model)
    shapes = {fqn: tuple(p.shape) for fqn, p in model.named_parameters()}  # global shapes (DTensor: logical)
    missing = sorted(set(shapes) - set(inits))
    if missing:
        raise KeyError(f"{spec.name}'s param_inits has no entry for {missing[:5]}: every parameter needs one")
    own = optimizer.own_params
    with _without(model, own):
        model.to_empty(device=device)  # FSDP2 shards, plain params and buffers; not the optimizer's own

    def init_fn(fqn: str, out: torch.Tensor, region: tuple[slice, ...]) -> None:
        index = [torch.arange(s.start, s.stop, device=out.device) for s in region]
        fill_(out, inits[fqn], seed, fqn, shapes[fqn], index)

    optimizer.init_own_params(init_fn, device)
    for fqn, p in model.named_parameters():
        if p in own:
            continue
        local = p.to_local() if isinstance(p, DTensor) else p
        fill_(local, inits[fqn], seed, fqn, shapes[fqn], global_index(p))
    spec.init_buffers(model, device)


__all__ = [
    "ParamInit",
    "TILE",
    "constant",
    "fill_",
    "full_index",
    "global_index",
    "init_params",
    "materialize",
    "normal",
    "tile_seed",
    "trunc_normal",
    "uniform",
]
