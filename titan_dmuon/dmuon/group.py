"""DedicatedParamGroup: the params behind one hook boundary, their packed buffer and their hooks.

Lifecycle per step (docs/dmuon.md, "Hook boundaries and the per-step lifecycle"): pre-forward → unshard
(one broadcast per owner of a contiguous slice of the packed buffer, next group prefetched) → forward →
post-forward: Z3 frees the buffer, Z2 keeps it → pre-backward (a multi-grad hook on the outputs) → unshard
again under Z3 → each param's grad lands (post-accumulate-grad hook) → when the group's last grad lands:
pack, reduce (average) to the owners, free the buffer → end of backward (engine callback): finish the
reduces, owners keep `_reduced_grad`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from .comm import Streams, Work, broadcast_coalesced, reduce_coalesced, streams_for
from .param import DedicatedParam

if TYPE_CHECKING:
    from .state import DMuonState

InitFn = Callable[[str, torch.Tensor, tuple[slice, ...]], None]
"""`init_fn(fqn, out, region)`: fill the fp32 tensor `out` with the values at `region` (one slice per dim) of
the full logical matrix `fqn` (see `dmuon.init_dedicated_params`)."""


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
        reduce_dtype: torch.dtype | None = None,
    ):
        self.state = state
        self.index = index
        self.module_fqn = module_fqn
        self.module = module
        self.params = sorted(dparams, key=lambda d: (d.owner_shard, d.owner_replicate, d.fqn))
        self.dtype = dtype
        self.reduce_dtype = reduce_dtype or dtype  # the packed grad buffer's dtype: what the reduces move
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
            if device.type != "meta":
                _free_storage(self.buffer)
        self.unsharded = self.live
        self._unshard_work: Work | None = None
        self._publish: Work | None = None  # post-step publish (HSDP/DDP), consumed by the next unshard
        self._deferred: Callable[[], Work] | None = None  # async TP: scatter wait + update + its publish
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
        """Allocate the packed buffer and dispatch one broadcast per owner (async, on the broadcast stream: the
        buffer is allocated by the compute stream, which consumes it after `wait_for_unshard`). The broadcast
        stream, not compute, waits for the previous step's publish: only its copy reads the masters (a
        prefetch must not stall the current group's compute on the next group's publish)."""
        if self.live:
            self.wait_publish(timed=True)  # DDP: compute reads the live param itself
            return
        if self.unsharded:
            return
        self._finish_deferred()  # the TP tail applies its update on the compute stream
        _alloc_storage(self.buffer)
        st = self.state
        with st.streams.use("broadcast"):
            self.wait_publish(timed=True)
            st.streams.hold(self.buffer)
            for dp in self.params:
                if dp.in_owner_column:  # this row's sender for that owner
                    self.buffer[dp.offset : dp.offset + dp.numel].copy_(dp._owned_data.view(-1))
            ops = [(self.buffer[s:e], st.shard_global_rank(shard)) for shard, (s, e) in self.shard_segments.items()]
            copied = Work([st.streams.event()])  # compute waits for the copy too (a 1-rank group broadcasts nothing)
            self._unshard_work = broadcast_coalesced(ops, st.shard_group, st.ledger, "broadcast")
        self._unshard_work = (self._unshard_work or Work()).merge(copied)
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

    # ---- step: the optimizer's handoff ---------------------------------------------------------------
    def after_step(self, publish: Work, finish: Callable[[], Work] | None = None) -> None:
        """What `Muon.step()` leaves in flight for this group: the publish of its updated params and, for TP
        params, the tail of the update (wait for the scatter, apply, publish), which returns its own publish.
        Both are consumed by the next `wait_publish` (next pre-forward, next step, a state dict, drain), so
        the tail runs at the same point on every rank of the owner's column."""
        if self._publish is not None or self._deferred is not None:
            raise RuntimeError(f"group '{self.module_fqn}': the previous step's publish was not consumed")
        self._publish, self._deferred = publish, finish

    def _finish_deferred(self) -> None:
        """Run the deferred TP tail (scatter wait, update, publish); its publish joins the pending one."""
        if self._deferred is not None:
            finish, self._deferred = self._deferred, None
            work = finish()
            self._publish = work if self._publish is None else self._publish.merge(work)

    def wait_publish(self, timed: bool = False) -> None:
        """Consume the post-step publish: after it, the owner column agrees (I4). `timed`: the next forward
        waits here (not a drain), so how long it waited goes to the state's publish-wait meter."""
        self._finish_deferred()
        if self._publish is not None:
            if timed and self._publish.is_pending():
                st = self.state
                st.publish_wait.add(st.streams.timed_wait(self._publish))
            self._publish.wait()
            self._publish = None
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
        """Pack this rank's grads, cast to the reduce dtype, and average them onto the owners (stage 1 over the
        shard group), on the reduce stream: compute goes on with the backward; the grads and the packed buffer
        (allocated by the compute stream) are held for the reduce stream until it is done with them."""
        if self._reduced:
            return
        self._reduced = True
        st = self.state
        if st.sync_grads:
            gbuf = torch.empty(self.numel, dtype=self.reduce_dtype, device=self.device)
            with st.streams.use("reduce"):
                st.streams.hold(gbuf)
                for dp in self.params:
                    dst = gbuf[dp.offset : dp.offset + dp.numel]
                    grad = dp.local_grad
                    if grad is None:
                        dst.zero_()
                    else:
                        dst.copy_(grad.reshape(-1))
                        st.streams.hold(grad)  # freed below by the compute stream, read by the reduce stream
                        dp.param.grad = None
                ops = [(gbuf[s:e], st.shard_global_rank(shard)) for shard, (s, e) in self.shard_segments.items()]
                work = reduce_coalesced(ops, st.shard_group, st.ledger, "reduce")
            st.enqueue_reduce(self, gbuf, work)
        if st.mode == "fsdp":
            self.reshard()

    def finish_reduce(self, gbuf: torch.Tensor) -> None:
        """After both stages (the compute stream waited for them): the global owner accumulates its slice into
        `_reduced_grad` (fp32, whatever the reduce dtype)."""
        for dp in self.params:
            if dp.is_owner:
                g = gbuf[dp.offset : dp.offset + dp.numel].view(dp._orig_size)
                if dp._reduced_grad is None:
                    dp._reduced_grad = g.to(torch.float32, copy=True)
                else:
                    dp._reduced_grad.add_(g)

    def reduce_if_partial(self) -> None:
        """End of backward: reduce a group whose grads only partly arrived (the missing ones as zeros)."""
        if self._grads_ready > 0 and not self._reduced:
            self.reduce_grads()

    def reset_backward(self) -> None:
        self._grads_ready = 0
        self._reduced = False

    # ---- materialization (params dedicated on the meta device) -------------------------------------------
    @property
    def on_meta(self) -> bool:
        return self.device.type == "meta"

    def materialize(self, device: torch.device, init_fn: InitFn) -> None:
        """Meta -> `device`: allocate only what this rank holds and have `init_fn` fill its fp32 masters.

        The packed buffer gets its (freed) storage and the params view it again; under DDP each rank allocates
        the live params. Every rank of an owner's column fills the same master from the same function, so the
        column agrees without a publish. Scratch beyond that is whatever `init_fn` uses.
        """
        self.device = device
        if device.type == "cuda" and type(self.state.streams) is Streams:
            self.state.streams = streams_for(device)
        if not self.live:
            self.buffer = torch.empty(self.numel, dtype=self.dtype, device=device)
        for dp in self.params:
            if self.live:
                local = torch.empty(dp._orig_size, dtype=dp.local.dtype, device=device)
            else:
                local = self.buffer[dp.offset : dp.offset + dp.numel].view(dp._orig_size)
            dp.bind_local(local)
            if not dp.in_owner_column:
                continue
            live_master = self.live and local.dtype == torch.float32  # DDP: the fp32 live param is the master
            master = local if live_master else torch.empty(dp._orig_size, dtype=torch.float32, device=device)
            with torch.no_grad():
                init_fn(dp.fqn, master, dp.region())
                if self.live and not live_master:
                    local.copy_(master)
            dp._owned_data = master
        if not self.live:
            _free_storage(self.buffer)
        self._register_param_hooks()

    # ---- hooks ----------------------------------------------------------------------------------------
    def register_hooks(self) -> None:
        """The boundary module's forward hooks now; the params' grad hooks once they exist on a device (a meta
        param is replaced in place by `materialize`, which drops hooks registered on it)."""
        self._handles.append(self.module.register_forward_pre_hook(self._pre_forward, prepend=False))
        self._handles.append(self.module.register_forward_hook(self._post_forward, prepend=False))
        if not self.on_meta:
            self._register_param_hooks()

    def _register_param_hooks(self) -> None:
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
