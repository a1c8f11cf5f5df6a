"""The optimizer component: everything the trainer does with an optimizer, behind one interface, and the
registry that maps `optimizer.name` to a component class.

The trainer never asks which optimizer it has. It calls, in this order:

    component = build_optimizer_component(cfg, spec)     # the class registered as cfg.optimizer.name
    ignored = component.prepare(model, dims, mesh)       # inside parallelize (on meta): after TP, before FSDP2
    fully_shard(..., ignored_params=ignored)             # FSDP2 leaves the component's params alone
    component.init_own_params(init_fn, device)           # materialize: the component allocates what it kept
    optimizer = component.build()                        # the torch.optim.Optimizer (lr scheduler, step)
    component.attach_qk_clip()                           # QK-clip / the max-logit metric, when configured
    with component.no_sync(): ...                        # every micro-batch but the last one
    component.reduce_grads()                             # a pipeline: after the schedule, its whole no_sync step
    norm = component.clip_grad_norm_(max_norm)           # one global norm, the same on every rank
    optimizer.step(); component.step_stats()             # the metrics the component adds
    component.model_state_dict() / load_model_state_dict(sd)  # checkpoints: this rank's share, by FQN (DCP)
    component.state_dict() / load_state_dict(sd)         # the optimizer's, likewise
    component.close()                                    # finish in-flight communication

The defaults here serve an optimizer whose params FSDP2 manages (DTensors): `adamw` and `muon_naive` use
them as they are; `dmuon` overrides most of them.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh

from titan_dmuon.components.moe import moe_layers
from titan_dmuon.config import ConfigError, JobConfig
from titan_dmuon.dmuon.qk_clip import QKClip

if TYPE_CHECKING:
    from titan_dmuon.components.model import ModelSpec
    from titan_dmuon.parallel import ParallelDims

Predicate = Callable[[str, nn.Parameter], bool]


def muon_options(cfg: JobConfig) -> dict[str, Any]:
    """The Muon update (`[optimizer.muon]` as a dmuon.MuonOptions) and AdamW (`[optimizer.adamw]`) settings as keyword
    arguments, spelled as dmuon.Muon and NaiveMuon take them: every Muon-family component builds from the same dict,
    so they cannot drift apart."""
    a = cfg.optimizer.adamw
    return dict(
        options=cfg.optimizer.muon.to_options(),
        adamw_lr=a.lr,
        adamw_betas=tuple(a.betas),
        adamw_eps=a.eps,
        adamw_weight_decay=a.weight_decay,
    )


def muon_predicate(pattern: str) -> Predicate:
    """Muon params: 2D params, and 3D expert stacks (experts x out x in, orthogonalized expert by expert), whose FQN
    matches `pattern` (re.search: anchor the pattern to match whole FQNs)."""
    regex = re.compile(pattern)
    return lambda name, p: p.ndim in (2, 3) and regex.search(name) is not None


class OptimizerComponent:
    """One optimizer as the trainer sees it (the module docstring gives the call order).

    Built from the whole JobConfig (its own `[optimizer.*]` tables, plus what it needs elsewhere, such as the
    mixed-precision dtype) and the model family's spec (its default Muon params and its blocks).
    """

    name: ClassVar[str]
    """The `optimizer.name` that selects this component."""
    planned: ClassVar[bool] = False
    """Whether the dry-run planner (titan_dmuon/planner/) models this optimizer's layout: a real run on CUDA then
    checks its memory plan against the device before allocating (`job.check_device_memory`)."""

    def __init__(self, cfg: JobConfig, spec: ModelSpec):
        self.cfg = cfg
        self.spec = spec
        self.muon_params = cfg.optimizer.muon_params or spec.muon_params
        self.muon_predicate = muon_predicate(self.muon_params)
        self.model: nn.Module | None = None
        self.dims: ParallelDims | None = None
        self.mesh: DeviceMesh | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.qk_clip: QKClip | None = None
        """QK-clip or the max-logit metric (`attach_qk_clip`), None when neither is on."""
        self.own_params: set[nn.Parameter] = set()
        """The params this component allocates and initializes itself (set by `prepare`): FSDP2 ignores them
        and the materialization step leaves them to `init_own_params`."""

    # ------------------------------------------------------------------------------------------ setup
    def prepare(self, model: nn.Module, dims: ParallelDims, mesh: DeviceMesh) -> set[nn.Parameter]:
        """Runs inside parallelize, on the meta model, after TP and before FSDP2. Returns the params FSDP2 must
        not manage (`own_params`)."""
        self.model, self.dims, self.mesh = model, dims, mesh
        self._check_qk_clip(model)
        return self.own_params

    def _check_qk_clip(self, model: nn.Module) -> None:
        """A ConfigError when QK-clip or the max-logit metric is on but the model has no attention layer that reports
        its heads (`qk_heads()`, titan_dmuon/dmuon/qk_clip.py). A pipeline stage may hold none (the embedding alone):
        the clip's set-up checks the whole model."""
        wanted = self.cfg.optimizer.muon.qk_clip_tau > 0 or self.cfg.metrics.log_max_logit
        if wanted and not self.pipelined and not any(callable(getattr(m, "qk_heads", None)) for m in model.modules()):
            raise ConfigError(
                f"optimizer.muon.qk_clip_tau / metrics.log_max_logit: {self.spec.name}/{self.cfg.model.flavor} has no "
                "attention layer that reports its heads (a module with qk_heads()): turn them off for this model"
            )

    def init_own_params(self, init_fn: Callable[[str, torch.Tensor, tuple[slice, ...]], None], device) -> None:
        """Materialization (after FSDP2, before `build`): allocate this rank's share of `own_params` on `device`
        and fill it with `init_fn(fqn, out, region)` (the values at `region` of the full tensor `fqn`)."""

    def build(self) -> torch.optim.Optimizer:
        """The optimizer over the parallelized model (after FSDP2); also kept as `self.optimizer`. Its param
        groups carry `kind` ("muon" or "adamw"): the trainer logs each kind's lr."""
        raise NotImplementedError

    def select_muon_params(self, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        """The (FQN, param) pairs Muon takes; a ConfigError when there is none, or when a 3-D one is not an MoE
        layer's expert stack (titan_dmuon/components/moe.py): Muon would orthogonalize its slices one by one,
        which is right only for a stack of experts."""
        selected = [(n, p) for n, p in model.named_parameters() if self.muon_predicate(n, p)]
        source = (
            f"optimizer.muon_params = {self.muon_params!r}"
            if self.cfg.optimizer.muon_params
            else f"the {self.spec.name} family's default Muon params {self.muon_params!r}"
        )
        stacks = {id(p) for layer in moe_layers(model) for p in layer.expert_params().values()}
        strays = [n for n, p in selected if p.ndim == 3 and id(p) not in stacks]
        if strays:
            raise ConfigError(
                f"{source} selects 3-D parameters that are no MoE layer's expert stack: {', '.join(strays[:3])}; "
                "Muon takes 2-D matrices and expert stacks only: narrow the regex"
            )
        if not selected and not self.pipelined:  # a pipeline stage may hold none (the whole model is checked)
            raise ConfigError(
                f"{source} selects no matrix parameter (2-D, or a 3-D expert stack) of "
                f"{self.spec.name}/{self.cfg.model.flavor}"
            )
        return selected

    def head_blocks(self, model: nn.Module) -> dict[str, tuple[int, int]]:
        """Per-head Muon (`optimizer.muon.per_head`): FQN -> (dim, size) head blocks of the Muon params, from the
        family's `ModelSpec.head_blocks` (column blocks, dim 1, only with `per_head_wo`); {} with per_head off. A
        ConfigError names the family when it declares no head blocks."""
        m = self.cfg.optimizer.muon
        if not m.per_head:
            return {}
        if self.spec.head_blocks is None:
            raise ConfigError(
                f"optimizer.muon.per_head needs the model family's head blocks, but {self.spec.name} declares none "
                "(ModelSpec.head_blocks): turn per_head off or add head_blocks to its spec"
            )
        selected = {n for n, _ in self.select_muon_params(model)}
        blocks = {
            fqn: (int(dim), int(size))
            for fqn, (dim, size) in self.spec.head_blocks(model).items()
            if fqn in selected and (dim == 0 or m.per_head_wo)
        }
        if not blocks:
            raise ConfigError(
                f"optimizer.muon.per_head: none of the {self.spec.name} family's head-blocked matrices is a Muon param "
                f"(muon_params {self.muon_params!r})"
            )
        return blocks

    def attach_qk_clip(self) -> None:
        """After `build`: QK-clip (`optimizer.muon.qk_clip_tau` > 0) or the max-logit metric alone
        (`metrics.log_max_logit`). An optimizer that clips itself keeps its own clip (dmuon.Muon: each owner rescales
        its q/k rows before it publishes them); for the others a step post-hook measures and rescales the params
        where they live (plain, FSDP2 or TP shards; titan_dmuon/dmuon/qk_clip.py)."""
        own = getattr(self.optimizer, "qk_clip", None)
        if own is not None:
            self.qk_clip = own
            return
        tau = self.cfg.optimizer.muon.qk_clip_tau
        if not tau and not self.cfg.metrics.log_max_logit:
            return
        device = next(self.model.parameters()).device
        self.qk_clip = clip = QKClip(self.model, tau or math.inf, device)  # inf: measure, never clip
        self.optimizer.register_step_post_hook(lambda *_: clip.apply())

    # ------------------------------------------------------------------------------------------- step
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """No gradient communication inside (grad accumulation): FSDP2 keeps unreduced local grads."""
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    @property
    def pipelined(self) -> bool:
        """Whether the model is this rank's stages of a pipeline (the other stages' params are other ranks')."""
        return self.dims is not None and self.dims.pp_enabled

    @property
    def pp_mesh(self) -> DeviceMesh | None:
        """The ranks holding the other stages (a pipeline only): norms are summed over it."""
        return self.dims.meshes.pp if self.pipelined else None

    def reduce_grads(self) -> None:
        """Reduce the grads a pipeline schedule accumulated under `no_sync` (FSDP2's reduce-scatter here)."""
        from titan_dmuon.parallel.pipeline import fsdp_reduce_grads

        fsdp_reduce_grads(self.model)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every grad so that the global L2 norm is at most `max_norm`; returns the norm before, the same
        value on every rank (over every pipeline stage)."""
        import torch.distributed as dist

        from titan_dmuon.dmuon.clip import grads_sq_norm, scale_grads_

        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        device = grads[0].device if grads else torch.device(self.mesh.device_type if self.mesh else "cpu")
        sq = grads_sq_norm(grads, device)  # FSDP2/TP/EP DTensors, each mesh on its own
        if self.pp_mesh is not None:
            dist.all_reduce(sq, group=self.pp_mesh.get_group())
        total = sq.sqrt()
        scale_grads_(grads, (max_norm / (total + 1e-6)).clamp(max=1.0))
        return total

    def step_stats(self) -> dict[str, float]:
        """Metrics of the last step (TensorBoard tag -> value); only those that carry information here. The
        trainer calls it on every rank, on log steps only: it may run one small collective (`over_ranks`). Here: the
        QK-clip figures (the same on every rank), which the overrides add to theirs."""
        return self.qk_clip.stats() if self.qk_clip is not None else {}

    def over_ranks(self, prefix: str, values: dict[str, float], keys: Sequence[str]) -> dict[str, float]:
        """This rank's `values` as figures of the whole job: `<prefix>/<key>` is the max over all ranks (the
        slowest or busiest rank, which the step waits for) and, with more than one rank, `<prefix>_mean/<key>`
        the mean. One all_gather of a [len(keys)] vector (titan_dmuon.components.metrics.max_and_mean_over_ranks); every
        rank passes the same `keys` (a key a rank lacks counts over the ranks that have it)."""
        from titan_dmuon.components.metrics import max_and_mean_over_ranks

        device = self.mesh.device_type if self.mesh is not None else "cpu"
        maxes, means = max_and_mean_over_ranks(values, keys, device)
        out = {f"{prefix}/{k}": v for k, v in maxes.items()}
        if self.dims is not None and self.dims.world_size > 1:
            out.update({f"{prefix}_mean/{k}": v for k, v in means.items()})
        return out

    # ----------------------------------------------------------------------------------- checkpoints
    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights keyed by the unwrapped model's FQNs, this rank's share only (FSDP2/TP params as
        DTensors, aliasing live storage): what DCP saves, and the template `dcp.load` fills in place. Gathers
        nothing."""
        return get_model_state_dict(self.model)

    def load_model_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """After `dcp.load` filled `model_state_dict()`'s dict (saved by any topology): copy it into the model
        where it does not alias it."""
        set_model_state_dict(self.model, state_dict)

    def state_dict(self) -> dict[str, Any]:
        """The optimizer state keyed by parameter FQN, DTensors left sharded (what DCP saves); a fresh optimizer's
        state is created first, so the dict is a complete load template."""
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The inverse of `state_dict` (the same layout, possibly saved by another topology)."""
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)

    def checkpoint_state_dict(self) -> dict[str, Any]:
        """`state_dict()` as checkpoints save it: under a pipeline each param group lists the FQNs of every stage
        (gathered over the pp ranks: every rank saves the same groups, those of the whole model), so the
        checkpoint loads on any layout."""
        sd = self.state_dict()
        if self.pp_mesh is not None:
            sd = {**sd, "param_groups": _whole_model_groups(sd["param_groups"], self.pp_mesh)}
        return sd

    def load_checkpoint_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The inverse of `checkpoint_state_dict`: under a pipeline the saved groups (the whole model's, by kind)
        must hold the FQNs this model's groups hold over all stages; each rank then takes its own."""
        if self.pp_mesh is not None:
            mine = self.state_dict()["param_groups"]
            groups = _stage_groups(state_dict["param_groups"], mine, self.pp_mesh)
            state_dict = {**state_dict, "param_groups": groups}
        self.load_state_dict(state_dict)

    def close(self) -> None:
        """Finish what is still in flight; called once, before the process group goes."""


def _group_key(group: dict[str, Any], index: int) -> str:
    return str(group.get("kind", index))


def _whole_model_groups(groups: list[dict[str, Any]], pp_mesh: DeviceMesh) -> list[dict[str, Any]]:
    """Every pp rank's param groups merged by kind (a stage without Muon matrices has no "muon" group), each
    listing the FQNs of all stages, in pp rank order: the same list on every rank (one all_gather_object)."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * pp_mesh.size()
    dist.all_gather_object(gathered, groups, group=pp_mesh.get_group())
    merged: dict[str, dict[str, Any]] = {}
    for rank_groups in gathered:
        for i, g in enumerate(rank_groups):
            key = _group_key(g, i)
            if key not in merged:
                merged[key] = {**g, "params": list(g["params"])}
            else:
                known = set(merged[key]["params"])
                merged[key]["params"] += [p for p in g["params"] if p not in known]
    return list(merged.values())


def _stage_groups(saved: list[dict[str, Any]], mine: list[dict[str, Any]], pp_mesh: DeviceMesh) -> list[dict]:
    """This rank's groups with the saved hyper-parameters, after checking that the saved groups hold, kind by kind,
    the FQNs the model's groups hold over all its stages (ValueError otherwise: another model, or other
    optimizer.muon_params)."""
    whole = {_group_key(g, i): g for i, g in enumerate(_whole_model_groups(mine, pp_mesh))}
    by_key = {_group_key(g, i): g for i, g in enumerate(saved)}
    for key in sorted(set(whole) | set(by_key)):
        want = sorted(whole[key]["params"]) if key in whole else []
        got = sorted(by_key[key]["params"]) if key in by_key else []
        if want != got:
            diff = sorted(set(want) ^ set(got))
            raise ValueError(
                f"the checkpoint's optimizer param group {key!r} differs from this model's in {diff[:5]} (another "
                "model or optimizer.muon_params?)"
            )
    return [{**by_key[_group_key(g, i)], "params": g["params"]} for i, g in enumerate(mine)]


_REGISTRY: dict[str, type[OptimizerComponent]] = {}


def register_optimizer(cls: type[OptimizerComponent]) -> type[OptimizerComponent]:
    """Class decorator: make `cls` selectable as `optimizer.name = cls.name`."""
    existing = _REGISTRY.get(cls.name)
    if existing is not None and existing is not cls:
        raise ValueError(f"optimizer {cls.name!r} is registered already ({existing.__qualname__})")
    _REGISTRY[cls.name] = cls
    return cls


def available_optimizers() -> list[str]:
    return sorted(_REGISTRY)


def get_optimizer_component(name: str) -> type[OptimizerComponent]:
    """The component class registered as `name`; ValueError lists what exists."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown optimizer {name!r}; registered optimizers: {', '.join(available_optimizers())}")
    return _REGISTRY[name]


def build_optimizer_component(cfg: JobConfig, spec: ModelSpec) -> OptimizerComponent:
    """The component `cfg.optimizer.name` names, for a model of family `spec`; ConfigError for an unknown name."""
    try:
        cls = get_optimizer_component(cfg.optimizer.name)
    except ValueError as e:
        raise ConfigError(f"optimizer.name: {e}") from None
    return cls(cfg, spec)
