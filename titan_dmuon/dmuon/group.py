"""DedicatedParamGroup: the params behind one hook boundary, their packed buffer and their hooks.

Lifecycle per step (docs/dmuon.md, "Hook boundaries and the per-step lifecycle"): pre-forward → unshard
(one broadcast per owner of a contiguous slice of the packed buffer, next group prefetched) → forward →
post-forward: Z3 frees the buffer, Z2 keeps it → pre-backward (a multi-grad hook on the outputs) → unshard
again under Z3 → each param's grad lands (post-accumulate-grad hook) → when the group's last grad lands:
pack, reduce (average) to the owners, free the buffer → end of backward (engine callback): finish the
reduces, owners keep `_reduced_grad`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from . import replicate_axis as _replicate
from .comm import CommLedger, Work, broadcast_coalesced, reduce_coalesced
from .param import DedicatedParam


def _in_backward() -> bool:
    """True while the autograd engine runs (e.g. an activation-checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


def _free_storage(t: torch.Tensor) -> None:
    if t.untyped_storage().size() != 0:
        t.untyped_storage().resize_(0)


def _alloc_storage(t: torch.Tensor) -> None:
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().size() != nbytes:
        t.untyped_storage().resize_(nbytes)


class DedicatedParamGroup:
    """Params sharing one hook module; packed buffer laid out by (owner_shard, owner_replicate, fqn)."""

    def __init__(
        self,
        state: DMuonState,
        index: int,
        module_fqn: str,
        module: nn.Module,
        dparams: list[DedicatedParam],
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.state = state
        self.index = index
        self.module_fqn = module_fqn
        self.module = module
        self.params = sorted(dparams, key=lambda d: (d.owner_shard, d.owner_replicate, d.fqn))
        self.dtype = dtype
        self.device = device
        offset = 0
        for dp in self.params:
            dp.group, dp.offset = self, offset
            offset += dp.numel
        self.numel = offset
        # Contiguous (owner_shard -> (start, end)) and (owner_shard, owner_replicate) -> (start, end).
        self.shard_segments = self._segments(lambda d: d.owner_shard)
        self.owner_segments = self._segments(lambda d: (d.owner_shard, d.owner_replicate))
        self.live = state.mode == "ddp"  # DDP: every rank keeps the full live param, no packed buffer
        self.buffer = torch.empty(0 if self.live else self.numel, dtype=dtype, device=device)
        if not self.live:
            for dp in self.params:
                dp.local.data = self.buffer[dp.offset : dp.offset + dp.numel].view(dp._orig_size)
            _free_storage(self.buffer)
        self.unsharded = self.live
        self._unshard_work: Work | None = None
        self.publish_work: Work | None = None  # HSDP post-step publish, consumed by the next unshard
        self.deferred_step: Any = None  # async TP: scatter wait + update + publish, run at the next unshard
        self._grads_ready = 0
        self._reduced = False
        self._handles: list[Any] = []

    def _segments(self, key) -> dict:
        segs: dict = {}
        for dp in self.params:
            k = key(dp)
            start, _ = segs.get(k, (dp.offset, dp.offset))
            segs[k] = (start, dp.offset + dp.numel)
        return segs

    # ---- forward: broadcast from owners -------------------------------------------------------------
    def unshard(self) -> None:
        """Allocate the packed buffer and dispatch one broadcast per owner (async)."""
        if self.live:
            self.wait_publish()
            return
        if self.unsharded:
            return
        self.wait_publish()
        _alloc_storage(self.buffer)
        st = self.state
        for dp in self.params:
            if dp.in_owner_column:  # this row's sender for that owner
                self.buffer[dp.offset : dp.offset + dp.numel].copy_(dp._owned_data.view(-1))
        ops = [(self.buffer[s:e], st.shard_global_rank(shard)) for shard, (s, e) in self.shard_segments.items()]
        self._unshard_work = broadcast_coalesced(ops, st.shard_group, st.ledger, "broadcast")
        self.unsharded = True

    def wait_for_unshard(self) -> None:
        if self._unshard_work is not None:
            self._unshard_work.wait()
            self._unshard_work = None

    def reshard(self) -> None:
        """Free the packed buffer (the params become placeholders again)."""
        if not self.unsharded or self.live:
            return
        self.wait_for_unshard()
        _free_storage(self.buffer)
        self.unsharded = False

    def wait_publish(self) -> None:
        """Consume the post-step publish: after it, the owner column agrees (I4)."""
        if self.deferred_step is not None:
            finish, self.deferred_step = self.deferred_step, None
            finish()
        if self.publish_work is not None:
            self.publish_work.wait()
            self.publish_work = None
            if self.live:  # DDP with a low-precision param: refresh it from the fp32 master
                for dp in self.params:
                    if dp._owned_data.data_ptr() != dp.local.data_ptr():
                        dp.local.data.copy_(dp._owned_data)

    # ---- backward: reduce to owners -----------------------------------------------------------------
    def _on_grad_ready(self, _param: torch.Tensor) -> None:
        self._grads_ready += 1
        if self._grads_ready == len(self.params):
            self.reduce_grads()

    def reduce_grads(self) -> None:
        """Pack this rank's grads and average them onto the owners (stage 1 over the shard group)."""
        if self._reduced:
            return
        self._reduced = True
        st = self.state
        if st.sync_grads:
            gbuf = torch.empty(self.numel, dtype=self.dtype, device=self.device)
            for dp in self.params:
                dst = gbuf[dp.offset : dp.offset + dp.numel]
                grad = dp.local_grad
                if grad is None:
                    dst.zero_()
                else:
                    dst.copy_(grad.reshape(-1))
                    dp.param.grad = None
            ops = [(gbuf[s:e], st.shard_global_rank(shard)) for shard, (s, e) in self.shard_segments.items()]
            work = reduce_coalesced(ops, st.shard_group, st.ledger, "reduce")
            st.enqueue_reduce(self, gbuf, work)
        if st.mode == "fsdp":
            self.reshard()

    def finish_reduce(self, gbuf: torch.Tensor) -> None:
        """After both stages: the global owner accumulates its slice into `_reduced_grad` (fp32)."""
        for dp in self.params:
            if dp.is_owner:
                g = gbuf[dp.offset : dp.offset + dp.numel].view(dp._orig_size)
                if dp._reduced_grad is None:
                    dp._reduced_grad = g.to(torch.float32, copy=True)
                else:
                    dp._reduced_grad.add_(g)

    def reset_backward(self) -> None:
        self._grads_ready = 0
        self._reduced = False

    # ---- hooks ----------------------------------------------------------------------------------------
    def register_hooks(self) -> None:
        self._handles.append(self.module.register_forward_pre_hook(self._pre_forward, prepend=False))
        self._handles.append(self.module.register_forward_hook(self._post_forward, prepend=False))
        for dp in self.params:
            self._handles.append(dp.param.register_post_accumulate_grad_hook(self._on_grad_ready))

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        self.unshard()
        if not _in_backward():
            nxt = self.state.next_group(self)
            if nxt is not None:
                nxt.unshard()  # prefetch: its broadcast flies while this group computes
        self.wait_for_unshard()

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if _in_backward():  # activation-checkpoint recompute: keep the buffer for the backward
            return output
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled:
            output = _register_pre_backward(self, output)
        if self.state.reshard_after_forward or not grad_enabled:
            self.reshard()
        return output

    def pre_backward(self) -> None:
        st = self.state
        st.queue_final_callback()
        self.unshard()
        prev = st.prev_group(self)
        if prev is not None and not prev._reduced:
            prev.unshard()  # prefetch the group whose backward comes next
        self.wait_for_unshard()


def _register_pre_backward(group: DedicatedParamGroup, output: Any) -> Any:
    """Unshard the group when the first grad w.r.t. any of its outputs is computed (FSDP2's mechanism)."""
    flat, _ = tree_flatten(output)
    tensors = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
    if tensors:
        torch.autograd.graph.register_multi_grad_hook(tensors, lambda _grads: group.pre_backward(), mode="any")
    return output


class DMuonState:
    """Per-model DMuon state: meshes, groups in forward order, the reduce pipeline, the ledger."""

    def __init__(
        self,
        *,
        shard_mesh,
        replicate_mesh,
        reshard_after_forward: bool,
        mode: str = "fsdp",
        tp_rank: int = 0,
        tp_buffer_reuse=False,
    ):
        self.shard_mesh = shard_mesh
        self.replicate_mesh = replicate_mesh
        # A missing mesh is an axis of size 1 (DDP has no shard axis, 1D FSDP no replicate axis).
        self.shard_group = shard_mesh.get_group() if shard_mesh is not None else None
        self.replicate_group = replicate_mesh.get_group() if replicate_mesh is not None else None
        self.shard_size = dist.get_world_size(self.shard_group) if self.shard_group is not None else 1
        self.replicate_size = dist.get_world_size(self.replicate_group) if self.replicate_group is not None else 1
        self.shard_rank = dist.get_rank(self.shard_group) if self.shard_group is not None else 0
        self.replicate_rank = dist.get_rank(self.replicate_group) if self.replicate_group is not None else 0
        self.reshard_after_forward = reshard_after_forward
        self.mode = mode
        self.tp_rank = tp_rank  # this rank's TP coordinate (0 without TP): one DP slice per TP rank
        kinds = {
            False: (),
            True: ("gather", "scatter"),
            "all": ("gather", "scatter"),
            "gather": ("gather",),
            "scatter": ("scatter",),
        }[tp_buffer_reuse]
        self.tp_buffers = {"kinds": kinds, "store": {}} if kinds else None
        self.groups: list[DedicatedParamGroup] = []
        self.dparams: list[DedicatedParam] = []
        self.by_param: dict[nn.Parameter, DedicatedParam] = {}
        self.ledger = CommLedger()
        self.sync_grads = True
        self._pending: list[tuple[DedicatedParamGroup, torch.Tensor, Work]] = []  # stage 1 in flight
        self._stage2: list[tuple[DedicatedParamGroup, torch.Tensor, Work]] = []  # stage 2 in flight
        self._callback_queued = False
        # (shard, replicate) coordinates of every global rank, gathered once: owner lookups need no guessing.
        coords: list = [None] * dist.get_world_size()
        dist.all_gather_object(coords, (self.shard_rank, self.replicate_rank, self.tp_rank))
        self.coords = coords
        self.coord_to_global = {c: r for r, c in enumerate(coords)}

    def owner_global_rank(self, dp: DedicatedParam, tp_rank: int | None = None) -> int:
        """Global rank of a param's DP owner in the DP slice of TP rank `tp_rank` (default: this rank's)."""
        tp = self.tp_rank if tp_rank is None else tp_rank
        return self.coord_to_global[(dp.owner_shard, dp.owner_replicate, tp)]

    def shard_global_rank(self, shard: int) -> int:
        return dist.get_global_rank(self.shard_group, shard) if self.shard_group is not None else dist.get_rank()

    def replicate_global_rank(self, rep: int) -> int:
        return dist.get_global_rank(self.replicate_group, rep)

    def next_group(self, g: DedicatedParamGroup) -> DedicatedParamGroup | None:
        return self.groups[g.index + 1] if g.index + 1 < len(self.groups) else None

    def prev_group(self, g: DedicatedParamGroup) -> DedicatedParamGroup | None:
        return self.groups[g.index - 1] if g.index > 0 else None

    # ---- reduce pipeline ------------------------------------------------------------------------------
    def enqueue_reduce(self, group: DedicatedParamGroup, gbuf: torch.Tensor, work: Work) -> None:
        self._pending.append((group, gbuf, work))
        # Keep one stage-1 reduce in flight; start stage 2 (replicate axis) of the older ones meanwhile.
        while len(self._pending) > 1:
            self._start_stage2(*self._pending.pop(0))

    def _start_stage2(self, group: DedicatedParamGroup, gbuf: torch.Tensor, work: Work) -> None:
        work.wait()
        self._stage2.append((group, gbuf, _replicate.reduce_replicate(group, gbuf)))

    def queue_final_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def finish_backward(self) -> None:
        """End of backward: reduce groups whose grads only partly arrived, drain both stages, reshard."""
        self._callback_queued = False
        for g in self.groups:
            if g._grads_ready > 0 and not g._reduced:
                g.reduce_grads()
        while self._pending:
            self._start_stage2(*self._pending.pop(0))
        for group, gbuf, work in self._stage2:
            work.wait()
            group.finish_reduce(gbuf)
        self._stage2.clear()
        for g in self.groups:
            g.reset_backward()
            if self.mode == "fsdp":
                g.reshard()

    def drain_publish(self) -> None:
        for g in self.groups:
            g.wait_publish()

    def reshard_all(self) -> None:
        for g in self.groups:
            g.reshard()

    @contextlib.contextmanager
    def no_sync(self):
        prev, self.sync_grads = self.sync_grads, False
        try:
            yield
        finally:
            self.sync_grads = prev
