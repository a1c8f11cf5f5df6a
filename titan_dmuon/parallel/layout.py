"""Where the ranks run: each rank's host and node, the mesh's groups on them, checked and described at start-up.

torchrun numbers the ranks of one node (one agent) contiguously, and the mesh is row-major over (replicate, shard,
tp), so with shard x tp = ranks per node every shard and TP group lies inside one node and every replicate group
spans the nodes: FSDP2's and DMuon's per-layer traffic stays on the node's fast links, only the replicate-axis
reduce and publish cross nodes. `parallelism.data_parallel_replicate_degree = "nodes"` asks for exactly that, and
`check_node_layout` verifies it on the hosts the ranks really run on (another launcher may number ranks otherwise).

    places = gather_places()                        # once, collective: every rank gets every rank's place
    check_node_layout(dims, places)                 # "nodes" only: ConfigError naming a group that crosses a node
    print(describe_layout(dims, node_names(places)))  # also what the dry run prints, for planned hosts
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from titan_dmuon.config import ConfigError

from .parallel_dims import ParallelDims


@dataclass(frozen=True)
class RankPlace:
    """Where one rank runs."""

    host: str
    """The node's name: SLURMD_NODENAME under SLURM (the name scontrol and sinfo use), else the hostname."""
    node: int
    """torchrun's GROUP_RANK (its agent, one per node); -1 when not launched by torchrun."""
    local_rank: int
    """The rank's index on its node (LOCAL_RANK)."""


def this_place() -> RankPlace:
    env = os.environ
    host = env.get("SLURMD_NODENAME") or socket.gethostname()
    return RankPlace(host=host, node=int(env.get("GROUP_RANK", "-1")), local_rank=int(env.get("LOCAL_RANK", "0")))


def gather_places() -> list[RankPlace]:
    """Every rank's place, indexed by global rank (one all_gather_object of the default group, at start-up)."""
    places: list[RankPlace | None] = [None] * dist.get_world_size()
    dist.all_gather_object(places, this_place())
    return places  # type: ignore[return-value]


def node_names(places: Sequence[RankPlace]) -> list[str]:
    """A name per rank for its node: the host, or host#node when one host runs several torchrun agents (a test
    that fakes nodes on one machine), so distinct nodes never share a name."""
    agents_per_host: dict[str, set[int]] = {}
    for p in places:
        agents_per_host.setdefault(p.host, set()).add(p.node)
    return [p.host if len(agents_per_host[p.host]) == 1 else f"{p.host}#{p.node}" for p in places]


def check_node_layout(dims: ParallelDims, places: Sequence[RankPlace]) -> None:
    """Raise ConfigError unless each shard and TP group lies inside one node and each replicate group has one rank
    on each of distinct nodes (what replicate = "nodes" promises)."""
    names = node_names(places)
    key = 'parallelism.data_parallel_replicate_degree = "nodes"'
    for axis in ("shard", "tp"):
        for group in dims.groups(axis):
            hosts = sorted({names[r] for r in group})
            if len(hosts) > 1:
                raise ConfigError(
                    f"{key}: {axis} group of ranks {_ranks(group)} spans nodes {', '.join(hosts)}; the launcher must "
                    "number each node's ranks contiguously (torchrun does: one agent per node)"
                )
    for group in dims.groups("replicate"):
        hosts = [names[r] for r in group]
        if len(set(hosts)) < len(hosts):
            raise ConfigError(f"{key}: replicate group of ranks {_ranks(group)} has two ranks on one node ({hosts})")


def describe_layout(dims: ParallelDims, hosts: Sequence[str], max_items: int = 3) -> str:
    """A short multi-line text: the nodes and their ranks, then the shard, replicate (and TP) groups with the nodes
    they sit on; the first `max_items` of each and a count, so it stays short for big jobs."""
    nodes: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        nodes.setdefault(host, []).append(rank)
    per_node = "/".join(str(n) for n in sorted({len(r) for r in nodes.values()}))
    ep = f", shard = (efsdp {dims.efsdp} x ep {dims.ep})" if dims.ep_enabled else ""
    pp_name, pp = ("pp, ", f"{dims.pp}, ") if dims.pp_enabled else ("", "")
    lines = [
        f"Layout: {dims.world_size} ranks on {len(nodes)} node(s) of {per_node} ranks; mesh ({pp_name}replicate, "
        f"shard, tp) = ({pp}{dims.dp_replicate}, {dims.dp_shard}, {dims.tp}){ep}, row-major",
        "  nodes: " + _first([f"{h} = ranks {_ranks(r)}" for h, r in nodes.items()], max_items),
    ]
    for axis in ("shard", "replicate", "tp", *(("ep", "efsdp") if dims.ep_enabled else ()), "pp"):
        groups = dims.groups(axis)
        if len(groups[0]) == 1:
            continue
        spans = sorted({len({hosts[r] for r in g}) for g in groups})
        if spans == [1]:
            where = "each inside one node"
        elif spans == [len(groups[0])]:
            where = f"each across {spans[0]} nodes, one rank on each"
        else:
            where = f"each across {'-'.join(map(str, (spans[0], spans[-1])))} nodes"
        items = [f"[{_ranks(g)}] on {_hosts(g, hosts)}" for g in groups[:max_items]]
        lines.append(
            f"  {axis} groups: {len(groups)} x {len(groups[0])} ranks, {where}: {_first(items, max_items, len(groups))}"
        )
    return "\n".join(lines)


def _first(items: list[str], n: int, count: int | None = None) -> str:
    """The first n items and how many more of count there are."""
    count = len(items) if count is None else count
    return "; ".join(items[:n]) + (f"; ... ({count - n} more)" if count > n else "")


def _hosts(group: Sequence[int], hosts: Sequence[str]) -> str:
    seen = list(dict.fromkeys(hosts[r] for r in group))
    return ", ".join(seen) if len(seen) <= 3 else f"{seen[0]}, {seen[1]}, ..., {seen[-1]} ({len(seen)} nodes)"


def _ranks(ranks: Sequence[int]) -> str:
    """0-7 for a run, 0, 8, ..., 56 for a long stride, else the list (cut after a few)."""
    if len(ranks) == 1:
        return str(ranks[0])
    step = ranks[1] - ranks[0]
    arithmetic = all(b - a == step for a, b in zip(ranks, ranks[1:], strict=False))
    if arithmetic and step == 1:
        return f"{ranks[0]}-{ranks[-1]}"
    if len(ranks) <= 4:
        return ", ".join(map(str, ranks))
    if arithmetic:
        return f"{ranks[0]}, {ranks[1]}, ..., {ranks[-1]} (stride {step})"
    return ", ".join(map(str, ranks[:3])) + f", ..., {ranks[-1]} ({len(ranks)} ranks)"
