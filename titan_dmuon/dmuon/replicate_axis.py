"""The HSDP replicate axis: stage-2 grad reduce and the post-step publish (docs/dmuon.md, "HSDP: two-stage
reduce and the publish").

Stage 2 averages, over the replicate group (a shard column), the row averages that stage 1 left on this
row's column member, onto the global owner: net divisor G·R. The publish broadcasts the global owner's
updated `_owned_data` to its column peers (I4) so every row's next shard broadcast sends the same weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from . import trace
from .comm import Work, broadcast_coalesced, reduce_coalesced

if TYPE_CHECKING:
    from .group import DedicatedParamGroup
    from .param import DedicatedParam


def reduce_replicate(group: DedicatedParamGroup, gbuf: torch.Tensor) -> Work:
    """Average this column's slice of `gbuf` over the replicate group onto each param's global owner, from the
    replicate-axis stream (the cross-node link's, at default priority: nothing in the backward waits for it)."""
    st, ax = group.state, group.axes
    if ax.replicate_group is None:
        return Work()
    ops = [
        (gbuf[s:e], ax.replicate_global_rank(rep))
        for (shard, rep), (s, e) in group.grad_owner_segments.items()
        if shard == ax.shard_rank
    ]
    with trace.phase(trace.REDUCE), st.streams.use("replicate_broadcast"):  # stage 2 of the reduce
        return reduce_coalesced(ops, ax.replicate_group, st.ledger, "replicate_reduce")


def publish(group: DedicatedParamGroup, params: Sequence[DedicatedParam] | None = None) -> Work:
    """Broadcast the updated `_owned_data` of this column's params (default: all of the group's) from
    their global owners (async, on the default-priority replicate_broadcast stream: it has the whole next
    forward to hide in, behind the shard axis's broadcasts)."""
    st, ax = group.state, group.axes
    if ax.replicate_group is None:
        return Work()
    ops = [
        (dp._owned_data, ax.replicate_global_rank(dp.owner_replicate))
        for dp in (group.params if params is None else params)
        if dp.in_owner_column
    ]
    with trace.phase(trace.PUBLISH), st.streams.use("replicate_broadcast"):
        st.streams.hold(*(t for t, _ in ops))
        return broadcast_coalesced(ops, ax.replicate_group, st.ledger, "replicate_broadcast")
