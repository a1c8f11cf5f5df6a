"""DedicatedParamGroup: the params behind one hook boundary, their packed buffer and their hooks.

Lifecycle per step (docs/dmuon.md, "Hook boundaries and the per-step lifecycle"): pre-forward → unshard
(one broadcast per owner of a contiguous slice of the packed buffer, next group prefetched), the boundary's
forward inputs routed through a post-backward node → forward → post-forward: Z3 frees the buffer, Z2 keeps
it → pre-backward (a multi-grad hook on the outputs) → unshard again under Z3 → the grads land → post-backward
(the node on the inputs, once every forward of this backward has been through it): pack every matrix's grad
(zeros where this rank has none) with a has-grad flag each, reduce (average) to the owners, free the buffer →
end of backward (engine callback): reduce the groups whose post-backward did not run, finish the reduces,
owners keep `_reduced_grad`.

What triggers a reduce never depends on which grads exist on this rank: every rank that runs a boundary's
forward and backward issues the same collectives in the same order, whatever branches its batch took.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import trace
from .comm import Streams, Work, broadcast_coalesced, reduce_coalesced, streams_for
from .param import DedicatedParam

if TYPE_CHECKING:
    from .state import DMuonState

InitFn = Callable[[str, torch.Tensor, tuple[slice, ...]], None]
"""`init_fn(fqn, out, region)`: fill the fp32 tensor `out` with the values at `region` (one slice per dim) of
the full logical matrix `fqn` (see `dmuon.init_dedicated_params`)."""


def _graph_task() -> int:
    """The id of the backward the autograd engine is running on this thread, -1 outside backward."""
    return torch._C._current_graph_task_id()


def _in_backward() -> bool:
    """True while the autograd engine runs (e.g. an activation-checkpoint recompute)."""
    return _graph_task() != -1


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
        self.axes = dparams[0].axes  # every param of a group is owned over the same axes (api.py)
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
        self._layout_grad_buffer()
        self.live = state.mode == "ddp"  # DDP: every rank keeps the full live param, no packed buffer
        self.buffer = torch.empty(0 if self.live else self.numel, dtype=dtype, device=device)
        if not self.live:
            for dp in self.params:
                dp.set_local(self.buffer[dp.offset : dp.offset + dp.numel].view(dp._orig_size))
            if device.type != "meta":
                _free_storage(self.buffer)
        self.unsharded = self.live
        self._unshard_work: Work | None = None
        self._publish: Work | None = None  # post-step publish (HSDP/DDP), consumed by the next unshard
        self._deferred: Callable[[], Work] | None = None  # async TP: scatter wait + update + its publish
        # Backward bookkeeping (docs/dmuon.md, "Hook boundaries and the per-step lifecycle"):
        self._pending_nodes: weakref.WeakSet = weakref.WeakSet()  # post-backward nodes of live graphs not yet run
        # Train-mode forwards run without grad since the last backward ended (a reentrant checkpoint's first
        # forward; each is recomputed inside the backward that follows, and only the last recompute completes
        # the group's grads):
        self._nograd_forwards = 0
        self._task: int | None = None  # the backward this group entered (pre-backward, a grad, a recompute)
        self._reduced = False  # reduced (or skipped under no_sync) in that backward
        self._sent = False  # and its reduce issued
        self._handles: list[Any] = []

    def _segments(self, key) -> dict:
        segs: dict = {}
        for dp in self.params:
            k = key(dp)
            start, _ = segs.get(k, (dp.offset, dp.offset))
            segs[k] = (start, dp.offset + dp.numel)
        return segs

    def _layout_grad_buffer(self) -> None:
        """The packed grad buffer: per owner segment, its matrices' grads then one has-grad flag per matrix
        (1 where this rank has a grad, else 0: after the average the owner sees the fraction of ranks that
        had one, and skips a matrix no rank had a grad for, as torch.optim.Muon skips a None grad). The
        flags ride in the owner's own segment, so they cost no extra collective."""
        offset = 0
        self.grad_owner_segments: dict = {}
        self.grad_shard_segments: dict = {}
        for key in self.owner_segments:
            dps = [dp for dp in self.params if (dp.owner_shard, dp.owner_replicate) == key]
            start = offset
            for dp in dps:
                dp.grad_offset, offset = offset, offset + dp.numel
            for dp in dps:
                dp.flag_index, offset = offset, offset + 1
            self.grad_owner_segments[key] = (start, offset)
            s, _ = self.grad_shard_segments.get(key[0], (start, start))
            self.grad_shard_segments[key[0]] = (s, offset)
        self.grad_numel = offset

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
            with trace.phase(trace.PACK):
                for dp in self.params:
                    if dp.in_owner_column:  # this row's sender for that owner
                        self.buffer[dp.offset : dp.offset + dp.numel].copy_(dp._owned_data.view(-1))
                ax = self.axes
                ops = [(self.buffer[s:e], ax.shard_global_rank(sh)) for sh, (s, e) in self.shard_segments.items()]
                copied = Work([st.streams.event()])  # compute waits for the copy too (a 1-rank group sends nothing)
                self._unshard_work = broadcast_coalesced(ops, ax.shard_group, st.ledger, "broadcast")
        self._unshard_work = (self._unshard_work or Work()).merge(copied)
        self.unsharded = True

    def wait_for_unshard(self) -> None:
        if self._unshard_work is not None:
            with trace.phase(trace.BROADCAST_WAIT):
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
    def enter_backward(self) -> None:
        """This group takes part in the backward now running (its pre-backward, a grad landing, its
        post-backward or a recompute of its forward): that backward's end-of-backward callback reduces it if
        its post-backward does not (no input that requires grad, a forward whose graph is still held)."""
        if self._task is None:
            self._task = _graph_task()
            self.state.queue_final_callback(self._task)

    def post_backward(self, node: Any) -> None:
        """The backward reached this group's forward inputs. Once every live forward of the group has been
        through here (two forwards before one backward: the second; the grads of both are then accumulated),
        its grads are complete: reduce them."""
        self._pending_nodes.discard(node)
        self.enter_backward()
        if not self._pending_nodes and self._nograd_forwards == 0:
            self.reduce_grads()

    def _grad_arriving(self, dp: DedicatedParam) -> Callable[[torch.Tensor], None]:
        """A hook run before autograd accumulates a grad into `dp.param`: the user's clears since the last
        reduce take effect, and the placeholder grad a reduce leaves is taken away so accumulation starts
        fresh."""

        def hook(_grad: torch.Tensor) -> None:
            if self._sent:
                raise RuntimeError(
                    f"DMuon: a grad of '{dp.fqn}' arrived after its hook boundary '{self.module_fqn or '<root>'}' "
                    "had reduced its grads in this backward: the param is used outside that module's forward "
                    "(shared or tied with another module?): choose a hook_boundary_predicate whose module "
                    "contains every use of it"
                )
            self.enter_backward()
            dp.take_grad_placeholder()

        return hook

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Pack every matrix's grad (zeros where this rank has none) and its has-grad flag, cast to the reduce
        dtype, and average them onto the owners (stage 1 over the shard group), on the reduce stream: compute
        goes on with the backward; the grads and the packed buffer (allocated by the compute stream) are held
        for the reduce stream until it is done with them. Each param is then left with the grad placeholder."""
        if self._reduced:
            return
        self._reduced = True
        st = self.state
        if st.sync_grads:
            self._sent = True
            gbuf = torch.empty(self.grad_numel, dtype=self.reduce_dtype, device=self.device)
            with trace.phase(trace.REDUCE), st.streams.use("reduce"):
                st.streams.hold(gbuf)
                for dp in self.params:
                    dst = gbuf[dp.grad_offset : dp.grad_offset + dp.numel]
                    grad = dp.local_grad
                    has_grad = grad is not None
                    if has_grad:
                        dst.copy_(grad.reshape(-1))
                        st.streams.hold(grad)  # freed below by the compute stream, read by the reduce stream
                    else:
                        dst.zero_()
                    gbuf[dp.flag_index : dp.flag_index + 1].fill_(float(has_grad))
                ax = self.axes
                ops = [(gbuf[s:e], ax.shard_global_rank(sh)) for sh, (s, e) in self.grad_shard_segments.items()]
                work = reduce_coalesced(ops, ax.shard_group, st.ledger, "reduce")
                # what the next stream waits for includes the pack (a 1-rank shard group reduces nothing)
                work = work.merge(Work([st.streams.event()]))
            for dp in self.params:  # on compute: the user's clears, then the placeholder
                dp.leave_grad_placeholder()
            st.enqueue_reduce(self, gbuf, work)
        if st.mode == "fsdp" and (st.reshard_after_backward or st.sync_grads):
            self.reshard()

    def prepare_reduced_grads(self) -> None:
        """Compute stream: allocate the global owners' fp32 `_reduced_grad` (zeros) that `finish_reduce` adds
        into on a side stream, with `_grad_seen`, which counts the fraction of ranks that had a grad (read once
        per step by `Muon.step`, which skips a matrix no rank had a grad for)."""
        for dp in self.params:
            if dp.is_owner and dp._reduced_grad is None:
                dp._reduced_grad = torch.zeros(dp._orig_size, dtype=torch.float32, device=self.device)
                dp._grad_seen = torch.zeros((), dtype=torch.float32, device=self.device)
            elif dp.is_owner and dp._has_grad is not None and dp._grad_seen is None:
                # a grad kept (not set to None) whose step settled its has-grad flag: count on from that flag, so a
                # matrix no rank had a grad for takes its first one now (torch's None grad becomes a grad)
                dp._grad_seen = dp._has_grad.float()

    @torch.no_grad()
    def finish_reduce(self, gbuf: torch.Tensor) -> None:
        """After both stages: the global owner adds its slice into `_reduced_grad` (fp32, whatever the reduce
        dtype), and a fresh one's has-grad flag into `_grad_seen`."""
        st = self.state
        for dp in self.params:
            if dp.is_owner:
                st.streams.hold(dp._reduced_grad, dp._grad_seen)
                grad = gbuf[dp.grad_offset : dp.grad_offset + dp.numel].view(dp._orig_size)
                dp._reduced_grad.add_(grad, alpha=self.axes.grad_scale)
                if dp._grad_seen is not None:
                    dp._grad_seen.add_(gbuf[dp.flag_index])

    def tp_gathers(self) -> list[DedicatedParam]:
        """The matrices of this group whose reduced grad this rank gathers onto their TP owner once a reduce
        completes it (`DedicatedParam.tp_full_momentum`, on their DP owner), in group order: the same order on
        every rank of each TP group."""
        return [dp for dp in self.params if dp.tp_full_momentum and dp.is_owner]

    def end_backward(self) -> None:
        """End of the backward this group entered: forget it (the next backward starts afresh)."""
        self._task = None
        self._reduced = False
        self._sent = False
        self._nograd_forwards = 0

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
        self._handles.append(self.module.register_forward_pre_hook(self._pre_forward, prepend=False, with_kwargs=True))
        self._handles.append(self.module.register_forward_hook(self._post_forward, prepend=False))
        if not self.on_meta:
            self._register_param_hooks()

    def _register_param_hooks(self) -> None:
        for dp in self.params:
            self._handles.append(dp.param.register_hook(self._grad_arriving(dp)))

    @torch._dynamo.disable  # collectives and storage resizes: run eagerly, also inside a compiled model
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        in_backward = _in_backward()
        grad = torch.is_grad_enabled()
        if not in_backward:
            if self._task is not None:  # a backward that ended in an error left this group mid-backward
                self.end_backward()
            self.state.new_forward()
            if not grad and module.training:
                self._nograd_forwards += 1
        else:
            self.enter_backward()  # a recompute (activation checkpointing) inside a backward
        self.unshard()
        if not in_backward and self.state.prefetch:
            nxt = self.state.next_group(self)
            if nxt is not None:
                nxt.unshard()  # prefetch: its broadcast flies while this group computes
        self.wait_for_unshard()
        # The post-backward node on the inputs. A recompute registers one only when no forward's node is
        # pending: a reentrant checkpoint's first forward ran without grad, so the recompute's graph is the one
        # backward goes through; a non-reentrant one's is not (the first forward's node fires). That recompute
        # stands for one of the no-grad forwards; the node reduces once none is left to recompute.
        if grad and not (in_backward and self._pending_nodes):
            if in_backward and self._nograd_forwards > 0:
                self._nograd_forwards -= 1
            return _register_post_backward(self, args, kwargs)
        return None

    @torch._dynamo.disable
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
        self.enter_backward()
        self.unshard()
        prev = st.prev_group(self) if st.prefetch else None
        if prev is not None and not prev._reduced:
            prev.unshard()  # prefetch the group whose backward comes next
        self.wait_for_unshard()


class _PostBackward(torch.autograd.Function):
    """Identity on a boundary's forward inputs; its backward runs once the grads w.r.t. those inputs are
    computed, i.e. after the module's own backward (FSDP2's post-backward mechanism). The autograd engine runs
    a param's grad accumulation before any other ready node, so the group's grads have landed by then."""

    @staticmethod
    def forward(ctx, group: DedicatedParamGroup, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        ctx.set_materialize_grads(False)  # an input without grad stays without one
        return tensors

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        ctx.group.post_backward(ctx)
        return (None, *grads)


def _register_post_backward(group: DedicatedParamGroup, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Route the forward inputs that require grad through one `_PostBackward` node, recorded (weakly: a graph
    dropped without backward drops its node) as pending on the group."""
    flat, spec = tree_flatten((args, kwargs))
    idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not idx:
        return None  # nothing to hook: the end-of-backward callback reduces this group
    outs = _PostBackward.apply(group, *(flat[i] for i in idx))
    group._pending_nodes.add(outs[0].grad_fn)
    for i, t in zip(idx, outs, strict=True):
        flat[i] = t
    return tree_unflatten(flat, spec)


def _register_pre_backward(group: DedicatedParamGroup, output: Any) -> Any:
    """Unshard the group when the first grad w.r.t. any of its outputs is computed (FSDP2's mechanism)."""
    flat, _ = tree_flatten(output)
    tensors = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
    if tensors:
        torch.autograd.graph.register_multi_grad_hook(tensors, lambda _grads: group.pre_backward(), mode="any")
    return output
