"""dmuon.Muon: owner-gated Muon on the dedicated matrices, AdamW (foreach) on every other parameter.

Only the global owner of a matrix runs momentum, Newton-Schulz and the update, on its fp32 `_owned_data`;
the update follows `torch.optim.Muon` exactly (EMA momentum, Nesterov, decoupled weight decay, lr scaled
by the full matrix shape). The AdamW half is `torch.optim.AdamW`'s own functional kernel.
"""

from __future__ import annotations

import collections
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.optim.adamw import adamw as _adamw_functional

from . import replicate_axis as _replicate
from . import tp as _tp
from . import trace
from .comm import Work
from .costs import block_shape, num_blocks, update_blocks
from .newton_schulz import batch_plan, orthogonalize_stack, resolve_coefficients, zeropower_via_newtonschulz
from .options import MuonOptions, OptionError
from .qk_clip import QKClip
from .state import state_of, unwrap

_ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay")


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """torch.optim.Muon's lr scaling, on the full logical matrix shape."""
    a, b = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, a / b))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(a, b))
    raise ValueError(f"adjust_lr_fn must be 'original', 'match_rms_adamw' or None, got {adjust_lr_fn!r}")


class Muon(torch.optim.Optimizer):
    """Muon for the dedicated matrices of `model`, AdamW for the rest, in one optimizer.

    With the defaults it takes torch.optim.Muon's step (MuonOptions' defaults are torch's) and torch.optim.AdamW's.
    Param groups carry `kind` "muon" or "adamw" so an lr scheduler scales both halves. Newton-Schulz runs on each
    matrix's owner only; an owner orthogonalizes its same-shape matrices (with the same NS settings) as one batch.

    Args:
        model: the model after `dmuon.dedicate_params` (or `dedicate_params_ddp`), its dedicated params
            materialized (`dmuon.init_dedicated_params` after a meta start); it may be wrapped in torch's
            DistributedDataParallel.
        options: the Muon update's hyper-parameters as a `dmuon.MuonOptions` (default: `MuonOptions()`,
            torch.optim.Muon's defaults). Pass one to share a checked set between optimizers.
        adamw_lr: AdamW learning rate of every non-dedicated param (embeddings, norms, output). Default 1e-3
            (torch.optim.AdamW's).
        adamw_betas: AdamW (beta1, beta2). Default (0.9, 0.999) (torch's); LLM recipes often use (0.9, 0.95).
        adamw_eps: AdamW epsilon. Default 1e-8.
        adamw_weight_decay: AdamW decoupled weight decay. Default 0.01 (torch's); 0 for norms and biases is common
            (use `param_groups`).
        param_groups: optional `[{"params": [...], **overrides}, ...]`: each listed param takes the overrides of its
            own kind (a Muon matrix: any of `MuonOptions.PER_GROUP`, checked like the options; an AdamW param: `lr`,
            `betas`, `eps`, `weight_decay`; keys of the other kind are ignored), every other param the defaults.
            Default None.
        replicate_async: with a replicate axis (HSDP, DDP), publish the updated matrices to the other replicas
            asynchronously, overlapped with the next forward (default True); False finishes the publish inside
            `step()` (simpler timing, e.g. to measure it).
        tp_distributed_gram: with tensor parallelism, iterate NS on the s×s Gram matrix across the TP ranks instead
            of gathering each full matrix on its TP owner (default False); worth it for wide TP-sharded matrices
            whose gather dominates (docs/dmuon.md).
        tp_distributed_gram_policy: with `tp_distributed_gram`, which TP matrices that can take the Gram path (the
            whole matrix TP-split on its long side; a square one on dim 1) take it, decided per matrix once:
            "beneficial" (default) those whose Gram all-reduces move fewer bytes than gathering and scattering the
            full update, i.e. long side > (1 + Gram restarts of `ns_coefficients`/`ns_steps`) x short side;
            "always" every one (the others keep the gather); "never" none (`costs.tp_decision`). Another value
            raises ValueError.
        tp_gather: with tensor parallelism, what a TP matrix's gather onto its TP owner moves, and when.
            "backward" (default): the reduced gradient, issued from the backward that completes it (on the reduce
            stream, beside the rest of the backward), with the matrix's momentum kept whole on the TP owner;
            "step": the momentum-applied update, inside `step()`, with the momentum on the TP shards (the path
            before the gather moved into the backward; docs/dmuon.md, "The TP gather").
        **muon_options: any `MuonOptions` field by name, overriding `options` (the fields' docstrings are the full
            documentation): `lr` (1e-3), `momentum` (0.95), `nesterov` (True), `weight_decay` (0.1), `ns_steps`
            (5), `ns_coefficients` ("muon"), `eps` (1e-7), `adjust_lr_fn` ("original"), `ns_dtype` (None: bf16 on
            CUDA and native-bf16 CPUs, else fp32), `ns_formulation` ("direct"), `kernel` ("auto"),
            `ns_max_batch_elements` (2**26), `per_head` (False), `per_head_wo` (False), `qk_clip_tau` (0: off; the
            model's attention layers report their max logits, titan_dmuon/dmuon/qk_clip.py; with it on, building
            the optimizer is a collective of every rank, and so is each step). An invalid value raises
            `dmuon.OptionError` (a ValueError) naming it; `per_head` without head blocks recorded by
            `dedicate_params(..., head_blocks=...)` is one too.
    """

    def __init__(
        self,
        model: nn.Module,
        options: MuonOptions | None = None,
        *,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.01,
        param_groups: Sequence[dict[str, Any]] | None = None,
        replicate_async: bool = True,
        tp_distributed_gram: bool = False,
        tp_distributed_gram_policy: str = "beneficial",
        tp_gather: str = "backward",
        **muon_options: Any,
    ):
        self.options = MuonOptions.of(options, **muon_options)
        state = state_of(model, "dmuon.Muon")
        model = unwrap(model)
        if any(g.on_meta for g in state.groups):
            raise RuntimeError(
                "dmuon.Muon: the dedicated params are still on the meta device: call "
                "dmuon.init_dedicated_params(model, init_fn, device) first"
            )
        _check_registered(model, state)
        self.model = model
        self._state = state
        self.replicate_async = replicate_async
        self.tp_distributed_gram = tp_distributed_gram
        self.tp_distributed_gram_policy = _tp.check_gram_policy(tp_distributed_gram_policy)
        self._head_blocks = _active_head_blocks(state, self.options)
        if tp_gather not in ("backward", "step"):
            raise OptionError("tp_gather", f"must be 'backward' or 'step', got {tp_gather!r}")
        self.tp_gather = tp_gather
        # Each matrix's NS path, decided once: "local" (whole, or TP shards holding whole head blocks: no TP
        # communication), "gram" or "gather"; a gather-path matrix's momentum lives whole on its TP owner under
        # tp_gather="backward", which is what its gather moves.
        self._paths = {
            dp: _tp.update_path(
                dp, self._head_blocks.get(dp), tp_distributed_gram, self.tp_distributed_gram_policy, self.options
            )
            for dp in state.dparams
        }
        self._local_ns = {dp for dp, path in self._paths.items() if path == "local"}
        for dp, path in self._paths.items():
            dp.drop_tp_gather()
            dp.tp_full_momentum = tp_gather == "backward" and path == "gather"
        muon_defaults = self.options.group_defaults()
        adamw_defaults = dict(lr=adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps, weight_decay=adamw_weight_decay)
        groups = self._build_groups(model, param_groups or [], muon_defaults, adamw_defaults)
        super().__init__(groups, {})
        self.last_step_stats: dict[str, float] = {}
        tau = self.options.qk_clip_tau
        self.qk_clip: QKClip | None = QKClip(model, tau, state.device) if tau > 0 else None
        """QK-clip (`qk_clip_tau` > 0): the owners rescale their q/k rows after the update, before the publish."""

    # The optimizer-wide NS settings, as attributes (read-only: they are `options`').
    ns_dtype = property(lambda self: self.options.ns_dtype, doc="MuonOptions.ns_dtype (None: the device's default).")
    ns_formulation = property(lambda self: self.options.ns_formulation, doc="MuonOptions.ns_formulation.")
    kernel = property(lambda self: self.options.kernel, doc="MuonOptions.kernel.")
    ns_max_batch_elements = property(
        lambda self: self.options.ns_max_batch_elements, doc="MuonOptions.ns_max_batch_elements."
    )

    def _build_groups(self, model, user_groups, muon_defaults, adamw_defaults) -> list[dict]:
        dedicated = self._state.by_param
        override: dict[nn.Parameter, int] = {}
        for i, ug in enumerate(user_groups):
            for p in ug["params"]:
                override[p] = i
        buckets: dict[tuple[str, int], list[nn.Parameter]] = {}
        for p in model.parameters():
            if not p.requires_grad:
                continue
            kind = "muon" if p in dedicated else "adamw"
            buckets.setdefault((kind, override.get(p, -1)), []).append(p)
        groups = []
        for (kind, ui), params in buckets.items():
            opts = dict(muon_defaults if kind == "muon" else adamw_defaults)
            if ui >= 0:
                keys = MuonOptions.PER_GROUP if kind == "muon" else _ADAMW_KEYS
                opts.update({k: v for k, v in user_groups[ui].items() if k in keys})
                if kind == "muon":
                    self.options.check_group(opts)
            groups.append({"params": params, "kind": kind, **opts})
        return groups

    def publish_wait_stats(self) -> dict[str, float]:
        """How long the forwards since the last call waited for the post-step publish (HSDP/DDP, async):
        `publish_wait_p50_us`, `_p90_us`, `_p99_us` and the number of waits `publish_waits`; {} when none did
        (no replicate axis, or `replicate_async=False`, which drains the publish inside `step()`). Under 100 us
        at p90 the publish is hidden behind the step's tail and the next forward (docs/dmuon.md, "CUDA
        streams")."""
        st = self._state
        return st.publish_wait.summary(st.streams)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for dp in self._state.dparams:
            dp.clear_grad(set_to_none)

    def _settle_owned_grads(self) -> None:
        """Before the update: apply the user's grad clears to the owners' reduced grads, and turn each fresh one's
        has-grad fraction into `_has_grad`, a device flag that skips the matrix's momentum, weight decay and
        update where no rank had a grad (torch.optim.Muon skips a param whose grad is None): no host read."""
        for dp in self._state.dparams:
            if dp.is_owner:
                dp.sync_cleared()
                if dp._reduced_grad is not None and dp._grad_seen is not None:
                    dp._has_grad, dp._grad_seen = dp._grad_seen > 0, None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        st = self._state
        st.drain_publish()  # a publish still in flight reads `_owned_data`: never update under it
        st.reshard_all()  # any unsharded buffer is stale after this step
        self._settle_owned_grads()
        if self.qk_clip is not None:  # the step's max logits: the all-reduce runs under the updates below
            self.qk_clip.launch()
        ns_calls, ns_time = 0, 0.0
        for group in self.param_groups:
            if group["kind"] == "adamw":
                self._adamw_step(group)
        muon_groups = [g for g in self.param_groups if g["kind"] == "muon"]
        opts_of = {p: g for g in muon_groups for p in g["params"]}
        owned: list[tuple] = []  # (group index, dp, opts) of this rank's matrices that need no TP communication
        tp_jobs_of: list[list] = []  # per group: the TP gathers in flight
        for gi, pgroup in enumerate(st.groups):
            tp_jobs = []
            for dp in pgroup.params:
                if not dp.is_owner or dp._reduced_grad is None:
                    continue
                opts = opts_of[dp.param]
                if dp in self._local_ns:  # momentum + NS below, batched with the same-shape matrices of every group
                    owned.append((gi, dp, opts))
                    continue
                if dp.tp_full_momentum:  # the grad gathered from the backward (or now, if none was): momentum there
                    job = dp._tp_gather or _tp.TPUpdate(dp, dp._reduced_grad, st.ledger, st.tp_buffers)
                    dp._tp_gather = None
                    # the update may be applied after this step returns (async): snapshot this step's
                    # hyper-parameters and has-grad flag now, before an lr scheduler or zero_grad changes them
                    tp_jobs.append((job, dict(opts, has_grad=dp._has_grad)))
                    continue
                update = self._momentum(dp, opts)
                if self._paths[dp] == "gram":
                    t0 = time.perf_counter()  # every TP rank iterates on the s×s Gram: no gather/scatter
                    with trace.phase(trace.NEWTON_SCHULZ):
                        ortho = self._orthogonalize([update], opts, dp)[0]
                    _apply_update(dp, ortho, opts, None, dp._has_grad)
                    self._clip_owned(dp)
                    ns_time += time.perf_counter() - t0
                    ns_calls += int(dp.is_tp_owner)
                else:  # gather the update shards onto the TP owner (async, all of the step's at once)
                    job = _tp.TPUpdate(dp, update, st.ledger, st.tp_buffers)
                    tp_jobs.append((job, dict(opts, has_grad=dp._has_grad)))
            tp_jobs_of.append(tp_jobs)
        # each group's publish goes out, in group order, as soon as its matrices are updated
        publishes: list[Work] = []
        per_group = collections.Counter(gi for gi, _, _ in owned)
        publish_order = _InOrder(
            [per_group[gi] for gi in range(len(st.groups))],
            lambda g: publishes.append(
                _replicate.publish(st.groups[g], [dp for dp in st.groups[g].params if dp.tp_group is None])
            ),
        )
        calls, secs = self._update_owned(owned, lambda job: publish_order.done(job[0]))
        ns_calls, ns_time = ns_calls + calls, ns_time + secs
        calls, secs = self._orthogonalize_tp([job for jobs in tp_jobs_of for job in jobs])
        ns_calls, ns_time = ns_calls + calls, ns_time + secs
        for pgroup, tp_jobs, publish in zip(st.groups, tp_jobs_of, publishes, strict=True):
            # TP params wait for their scatter before the update, then publish: every rank of the owner's
            # column (owner or peer) runs this tail at the same point (the group's next wait_publish). The TP
            # shards updated locally (per-head, heads within the shard) were updated above and publish here too.
            tp_column = [dp for dp in pgroup.params if dp.tp_group is not None and dp.in_owner_column]
            finish = (
                functools.partial(_finish_tp, pgroup, tp_jobs, tp_column, self._head_blocks, self._clip_owned)
                if tp_jobs or tp_column
                else None
            )
            pgroup.after_step(publish, finish)
        if self.qk_clip is not None:  # every rank (owner or not) finishes the all-reduce, then the params nobody
            self.qk_clip.wait()  # owns (AdamW's under FSDP2, e.g. QK-norm gains)
            self.qk_clip.scale_params_(skip={id(dp.param) for dp in st.dparams})
        if not self.replicate_async:  # sync: consume every group's handoff before step() returns
            st.drain_publish()
        st.ledger.end_step()
        self.last_step_stats = {
            "ns_calls": float(ns_calls),
            "ns_time_s": ns_time,
            **{f"elements_{k}": v for k, v in st.ledger.last_step.items()},
            **{f"bytes_{k}": v for k, v in st.ledger.last_step_bytes.items()},
        }
        return loss

    def _clip_owned(self, dp) -> None:
        """QK-clip of a dedicated q/k matrix on the rank that just updated it (its rows of the whole matrix), before
        its publish: the replicas and the next forward's broadcast get the clipped weights, at no extra
        communication."""
        if self.qk_clip is not None and self.qk_clip.targets(dp.param):
            self.qk_clip.scale_(dp.param, dp._owned_data, dp.region()[0])

    def _momentum(self, dp, opts: dict) -> torch.Tensor:
        """EMA momentum (+ Nesterov) on this rank's (TP-local) grad: elementwise, so shards suffice."""
        return momentum_update(dp._reduced_grad, self.state[dp.param], opts, dp._has_grad)

    def _update_owned(self, owned: list[tuple], done: Callable[[tuple], None]) -> tuple[int, float]:
        """Momentum, NS and the update of this rank's matrices that need no TP communication (whole matrices, and
        TP shards holding whole head blocks): same-shape matrices (or head blocks) with the same NS settings in one
        batched call (memory-bounded chunks); `done(job)` after each update. Returns (NS calls, seconds): a
        matrix counts once (a TP one on its TP owner, so that the sum over ranks is the number of matrices)."""
        blocks = [self._head_blocks.get(dp) for _, dp, _ in owned]

        def finish(i: int, ortho: torch.Tensor) -> None:
            _, dp, opts = owned[i]
            _apply_update(dp, ortho, opts, blocks[i], dp._has_grad)
            self._clip_owned(dp)  # before `done` publishes it
            done(owned[i])

        secs = self._orthogonalize_blocks(
            [dp._reduced_grad.shape for _, dp, _ in owned],
            blocks,
            [opts for _, _, opts in owned],
            lambda i: self._momentum(owned[i][1], owned[i][2]),
            finish,
        )
        return sum(1 if dp.tp_group is None else int(dp.is_tp_owner) for _, dp, _ in owned), secs

    def _orthogonalize_tp(self, jobs: list[tuple]) -> tuple[int, float]:
        """Wait for the TP gathers; the TP owner applies the momentum to the gathered grads of the matrices whose
        momentum it keeps whole, orthogonalizes its full matrices (same-shape ones batched; per head block for a
        per-head matrix) and every rank scatters, in job order (the same on every rank of a TP group).
        Returns (NS calls, seconds)."""
        fulls = [job.full_update() for job, _ in jobs]
        orthos: list[torch.Tensor | None] = [None] * len(jobs)

        def scatter(i: int) -> None:
            job = jobs[i][0]
            job.scatter(orthos[i], like=job.dp._owned_data)
            orthos[i] = None  # the scatter holds its own chunks

        scatter_order = _InOrder([int(f is not None) for f in fulls], scatter)
        mine = [i for i, f in enumerate(fulls) if f is not None]

        def finish(k: int, ortho: torch.Tensor) -> None:
            i = mine[k]
            orthos[i], fulls[i] = ortho, None
            scatter_order.done(i)

        secs = self._orthogonalize_blocks(
            [fulls[i].shape for i in mine],
            [self._head_blocks.get(jobs[i][0].dp) for i in mine],
            [jobs[i][1] for i in mine],
            lambda k: self._full_update(*jobs[mine[k]], fulls[mine[k]]),
            finish,
        )
        return len(mine), secs

    def _full_update(self, job, opts: dict, full: torch.Tensor) -> torch.Tensor:
        """On the TP owner: what NS orthogonalizes of a gathered matrix: the gathered update itself, or the
        momentum (kept whole here) applied to the gathered grad."""
        if not job.dp.tp_full_momentum:
            return full
        return momentum_update(full, self.state[job.dp.param], opts, opts["has_grad"])

    def _orthogonalize_blocks(
        self,
        shapes: Sequence[Sequence[int]],
        blocks: Sequence[tuple[int, int] | None],
        opts: Sequence[dict],
        update_of: Callable[[int], torch.Tensor],
        finish: Callable[[int, torch.Tensor], None],
    ) -> float:
        """NS of matrices 0..n-1 (their `shapes`, head `blocks` or None for the whole matrix, param-group `opts`):
        the blocks of every matrix that have one shape up to transposition and the same NS settings go in one
        batched call, in chunks of at most `ns_max_batch_elements` (`batch_plan`; a matrix without blocks is one
        block, so that path is the plain per-matrix batching). `update_of(i)` gives matrix i's update when its
        first block is due; `finish(i, ortho)` takes its orthogonalized update (the blocks reassembled) once its
        last block is done. Returns the NS seconds."""
        pieces = [(i, b) for i, (shape, hb) in enumerate(zip(shapes, blocks, strict=True)) for b in _blocks(shape, hb)]
        plan = batch_plan(
            [block_shape(shapes[i], blocks[i]) for i, _ in pieces],
            [_ns_key(opts[i]) for i, _ in pieces],
            self.ns_max_batch_elements,
        )
        left = collections.Counter(i for i, _ in pieces)
        updates: dict[int, torch.Tensor] = {}
        done: dict[int, list[torch.Tensor]] = {}
        secs = 0.0
        for chunk in plan:
            mats = []
            for k in chunk:
                i, b = pieces[k]
                if i not in updates:
                    updates[i] = update_of(i)
                mats.append(_block(updates[i], blocks[i], b))
            t0 = time.perf_counter()
            with trace.phase(trace.NEWTON_SCHULZ):
                orthos = self._orthogonalize(mats, opts[pieces[chunk[0]][0]])
            secs += time.perf_counter() - t0
            for k, ortho in zip(chunk, orthos, strict=True):
                i = pieces[k][0]  # a matrix's blocks come in order: batch_plan keeps the order of its input
                done.setdefault(i, []).append(ortho)
                left[i] -= 1
                if not left[i]:
                    del updates[i]
                    finish(i, _assemble(done.pop(i), blocks[i], len(shapes[i])))
        return secs

    def _orthogonalize(self, updates: list[torch.Tensor], opts: dict, tp_gram_of=None) -> list[torch.Tensor]:
        """NS of same-shape full matrices (one batched call), or (TP distributed Gram) of this rank's block of
        `tp_gram_of`'s matrix."""
        kwargs = self.options.ns_kwargs(opts, updates[0].device)
        if tp_gram_of is not None:
            kwargs.update(
                formulation="gram",
                full_shape=tp_gram_of.full_shape,
                reduce_gram=functools.partial(_tp.all_reduce_gram, tp_gram_of, self._state.ledger),
            )
            return [zeropower_via_newtonschulz(updates[0], **kwargs)]
        return orthogonalize_stack(updates, **kwargs)

    def _adamw_step(self, group: dict) -> None:
        adamw_step(group, self.state)


def _block(update: torch.Tensor, head_blocks: tuple[int, int] | None, b: int) -> torch.Tensor:
    """Block `b` of a matrix's update: the whole update, a head block (a narrowed view), or an expert's matrix."""
    if head_blocks is None:
        return update
    if update.dim() == 3:
        return update[b]
    return update.narrow(head_blocks[0], b * head_blocks[1], head_blocks[1])


def _assemble(parts: list[torch.Tensor], head_blocks: tuple[int, int] | None, ndim: int) -> torch.Tensor:
    """The orthogonalized blocks of one matrix put back together (`_block`'s inverse)."""
    if ndim == 3:
        return torch.stack(parts)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=head_blocks[0])


def _blocks(shape: Sequence[int], head_blocks: tuple[int, int] | None) -> range:
    """The indices of a matrix's head blocks (one block, the whole matrix, without head blocks)."""
    return range(num_blocks(shape, head_blocks))


def _active_head_blocks(state, options: MuonOptions) -> dict:
    """dp -> the (dim, size) head blocks its update is split into (per-head Muon; empty when `per_head` is off)."""
    if options.per_head and not state.head_blocks:
        raise OptionError(
            "per_head",
            "is set but no head blocks were recorded for this model: pass head_blocks={fqn: (dim, size)} to "
            "dmuon.dedicate_params (e.g. (0, head_dim) for wq/wk/wv, (1, head_dim) for wo; docs/dmuon.md, "
            '"Per-head Muon")',
        )
    out = {}
    for dp in state.dparams:  # an expert stack: NS on each expert's matrix (costs.EXPERT_BLOCKS), always
        blocks = update_blocks(dp.full_shape, options.active_blocks(state.head_blocks.get(dp.fqn)))
        if blocks is not None:
            out[dp] = blocks
    return out


def _ns_key(opts: dict) -> tuple:
    """The NS settings of a param group: matrices batch together only when these agree."""
    coefficients = opts["ns_coefficients"]
    if not isinstance(coefficients, str):
        coefficients = tuple(resolve_coefficients(coefficients, opts["ns_steps"]))
    return opts["ns_steps"], coefficients, opts["eps"]


class _InOrder:
    """Calls `release(i)` for i = 0, 1, ... in order, each once item i and every item before it have no work
    `remaining`: collectives (publishes, scatters) go out in the same order on every rank, whatever order
    this rank's batched NS finished them in."""

    def __init__(self, remaining: list[int], release: Callable[[int], None]):
        self.remaining, self.release, self.next = list(remaining), release, 0
        self._flush()

    def done(self, i: int) -> None:
        self.remaining[i] -= 1
        self._flush()

    def _flush(self) -> None:
        while self.next < len(self.remaining) and self.remaining[self.next] == 0:
            self.release(self.next)
            self.next += 1


def momentum_update(grad: torch.Tensor, state: dict, opts: dict, has_grad: torch.Tensor | None = None) -> torch.Tensor:
    """torch.optim.Muon's momentum on one matrix: the EMA buffer `state["momentum_buffer"]` (created at zero) takes
    `grad`; returns what Newton-Schulz orthogonalizes (the Nesterov look-ahead, or the buffer). `opts`: the param
    group (its `momentum`, `nesterov`). `has_grad`: a device bool, false where no rank had a grad (the buffer is
    then left as it is; the update it returns is discarded by the caller)."""
    buf = state.get("momentum_buffer")
    if buf is None:
        buf = state["momentum_buffer"] = torch.zeros_like(grad)
    mu = opts["momentum"]
    if has_grad is None:
        buf.lerp_(grad, 1 - mu)
    else:  # no rank had a grad (device flag): the buffer stays as it is (no host read to skip it)
        buf.copy_(torch.where(has_grad, buf.lerp(grad, 1 - mu), buf))
    return grad.lerp(buf, mu) if opts["nesterov"] else buf


def init_adamw_state(p: torch.Tensor, state: dict) -> None:
    """A param's AdamW state before its first step (zero moments, step 0): what `adamw_step` starts from, and
    what a checkpoint template of a fresh optimizer holds."""
    state["step"] = torch.tensor(0.0, dtype=torch.float32)
    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def adamw_step(group: dict, states) -> None:
    """torch.optim.AdamW's own foreach kernel on one param group (`states`: the optimizer's per-param state);
    shared by every optimizer here that runs AdamW beside Muon."""
    params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
    for p in group["params"]:
        if p.grad is None:
            continue
        state = states[p]
        if not state:
            init_adamw_state(p, state)
        params.append(p)
        grads.append(p.grad)
        exp_avgs.append(state["exp_avg"])
        exp_avg_sqs.append(state["exp_avg_sq"])
        steps.append(state["step"])
    if not params:
        return
    beta1, beta2 = group["betas"]
    _adamw_functional(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        foreach=True,
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=False,
    )


def _apply_update(
    dp, ortho: torch.Tensor, opts: dict, head_blocks: tuple[int, int] | None, has_grad: torch.Tensor | None
) -> None:
    """Decoupled weight decay, then the lr-scaled orthogonal step, the lr scaled by the full logical shape (for a
    matrix orthogonalized per head block, per-head Muon, by one block's shape, as torch.optim.Muon scales a
    parameter of that shape). Where no rank had a grad (`has_grad`, the step's `dp._has_grad`, false on the
    device) the matrix is left as it is, as torch.optim.Muon skips a param without a grad; where one did, the
    arithmetic is the same.

    A tall matrix's NS result is a transposed view: it is made contiguous (a blocked transpose copy) before the
    add, since an elementwise add that reads it transposed is ~5x slower on CPU; the values are the same."""
    data = dp._owned_data
    shape = dp.full_shape if head_blocks is None else block_shape(dp.full_shape, head_blocks)
    update = ortho.contiguous().to(data.dtype)
    if has_grad is not None:
        update = update * has_grad
    if opts["weight_decay"]:
        decay = 1 - opts["lr"] * opts["weight_decay"]
        data.mul_(decay if has_grad is None else torch.where(has_grad, decay, 1.0))
    data.add_(update, alpha=-adjusted_lr(opts["lr"], opts["adjust_lr_fn"], shape))


def _finish_tp(pgroup, tp_jobs, tp_column, head_blocks, clip: Callable) -> Work:
    """Wait for the TP scatters, apply the shards' updates (per head block's lr for a per-head matrix) and `clip`
    them (QK-clip), then publish the column's TP shards over the replicate axis."""
    for job, opts in tp_jobs:
        _apply_update(job.dp, job.wait(), opts, head_blocks.get(job.dp), opts["has_grad"])
        clip(job.dp)
    return _replicate.publish(pgroup, tp_column)


def _check_registered(model: nn.Module, state) -> None:
    """Every dedicated param must still be the one the model holds: a wrapper that swaps params (torch DDP's
    TP transform turns DTensor params into new local ones) would leave DMuon's hooks on dead tensors."""
    registered = set(model.parameters())
    lost = [dp.fqn for dp in state.dparams if dp.param not in registered]
    if lost:
        raise RuntimeError(
            f"dmuon.Muon: the dedicated params {lost[:3]} are no longer registered in the model (something "
            "replaced them after dedicate_params; torch DistributedDataParallel over a TP mesh does): with TP "
            "use dmuon.replicate_tp(model, mesh['dp']) instead of DistributedDataParallel"
        )
