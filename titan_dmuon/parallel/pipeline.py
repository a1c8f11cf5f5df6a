"""Pipeline parallelism: the split of a decoder into stages, this rank's part of it, and the schedule that runs it
(torch.distributed.pipelining), with DMuon and FSDP2 inside every stage.

The model is split by module FQN into stages (`plan_stages`: "tok_embeddings", "layers.N", "norm", "output"),
each pp rank holds one stage (two or more under a looped schedule, two in a V under ZBVZeroBubble and
DualPipeV), and this rank's stages stay ONE module: the family's model on the meta device with the modules of
the other ranks' stages removed (`keep_stages`). Every FQN is the one the whole model has, so TP, DMuon, FSDP2,
materialization, the optimizer and the checkpoints treat a rank's part as they treat a whole model: a checkpoint
saved by any pipeline degree loads on any other layout and the other way round. The schedule runs each stage
through a thin view (`_StageView`) whose children are the stage's modules (what torch reads the stage's params
from) and whose forward calls the part with that stage's slice (`Decoder.forward(layers=..., embed=, head=)`),
so FSDP2's root hooks run on every stage's forward.

The gradients: every microbatch's backward runs with the reduces off (`no_sync`: local grads accumulate), and
once the schedule is done `reduce_grads` reduces them (DMuon to the owners, FSDP2's reduce-scatter), in the
same order on every rank of the stage. That is also what the zero-bubble schedules need: they compute the grads
of a stage's inputs first and its weight grads later, outside that backward, so no backward's end is the point
where a group's grads are complete. DMuon's owners are per stage: each stage's matrices are dedicated over that
stage's DP ranks, and the optimizer adds no traffic between stages.

Under a pipeline the loss is computed on the last stage (each microbatch's mean over its tokens, divided by the
number of microbatches, so the grads sum to the mean over the step's rows, as accumulation gives without one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from titan_dmuon.config import ConfigError, JobConfig

SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
"""One stage per pp rank."""
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
"""Two stages per pp rank in a V: rank r holds stages r and 2 pp - 1 - r (the first and the last on rank 0)."""

EMBED, NORM, HEAD = "tok_embeddings", "norm", "output"


# ------------------------------------------------------------------------------------------------ the split
def _parse_split(text: str) -> list[list[str]]:
    return [[m.strip() for m in stage.split(",") if m.strip()] for stage in text.split(";")]


def _balanced(n_layers: int, num_stages: int) -> list[list[str]]:
    """Contiguous stages over the units [embedding, block 0, ..., block n-1, norm + head], as even as they divide
    (the embedding and the head each count as one block, as torchtitan's default split does)."""
    units = [[EMBED]] + [[f"layers.{i}"] for i in range(n_layers)] + [[NORM, HEAD]]
    if num_stages > len(units):
        raise ConfigError(
            f"the pipeline has {num_stages} stages but the model only {n_layers} blocks (+ the embedding and the "
            f"head, {len(units)} units): lower parallelism.pipeline_parallel_degree or the stages per rank"
        )
    bounds = [len(units) * s // num_stages for s in range(num_stages + 1)]
    return [[m for u in units[bounds[s] : bounds[s + 1]] for m in u] for s in range(num_stages)]


def stages_per_rank(schedule: str) -> int:
    """The stages a pp rank holds by default: 1 for GPipe and 1F1B, 2 for the multi-stage schedules."""
    return 1 if schedule in SINGLE_STAGE_SCHEDULES else 2


def plan_stages(cfg: JobConfig, n_layers: int) -> list[list[str]]:
    """The modules of every stage, in pipeline order: `module_fqns_per_model_part` when set, else
    `pipeline_parallel_layers_per_stage` blocks per stage, else `stages_per_rank` stages per pp rank, balanced.
    ConfigError names what does not fit (the schedule's stages per rank, a block missing or twice, the embedding
    not first or the head not last)."""
    p = cfg.parallelism
    pp, schedule = p.pipeline_parallel_degree, p.pipeline_parallel_schedule
    if p.module_fqns_per_model_part.strip():
        stages = _parse_split(p.module_fqns_per_model_part)
        where = f"parallelism.module_fqns_per_model_part = {p.module_fqns_per_model_part!r}"
    elif p.pipeline_parallel_layers_per_stage:
        units = n_layers + 2
        num = -(-units // p.pipeline_parallel_layers_per_stage)
        num = -(-num // pp) * pp  # a whole number of stages per rank
        stages = _balanced(n_layers, num)
        where = f"parallelism.pipeline_parallel_layers_per_stage = {p.pipeline_parallel_layers_per_stage}"
    else:
        stages = _balanced(n_layers, pp * stages_per_rank(schedule))
        where = f"the default split for {schedule}"
    _check_split(stages, n_layers, pp, schedule, where)
    return stages


def _check_split(stages: list[list[str]], n_layers: int, pp: int, schedule: str, where: str) -> None:
    num = len(stages)
    if any(not s for s in stages):
        raise ConfigError(f"{where}: a stage holds no module")
    if num % pp:
        raise ConfigError(f"{where}: {num} stages do not divide over pipeline_parallel_degree = {pp} ranks")
    if schedule in SINGLE_STAGE_SCHEDULES and num != pp:
        raise ConfigError(
            f"{where}: {num} stages for {pp} ranks, but {schedule} runs one stage per rank: use a multi-stage schedule "
            f"(e.g. Interleaved1F1B) or {pp} stages"
        )
    if schedule in V_SCHEDULES and num != 2 * pp:
        raise ConfigError(f"{where}: {schedule} runs two stages per rank (a V): give it {2 * pp} stages, not {num}")
    known = {EMBED, NORM, HEAD} | {f"layers.{i}" for i in range(n_layers)}
    seen: dict[str, int] = {}
    for s, mods in enumerate(stages):
        for m in mods:
            if m not in known:
                raise ConfigError(
                    f"{where}: {m!r} is no module of the model (tok_embeddings, layers.0 .. layers.{n_layers - 1}, "
                    "norm, output)"
                )
            if m in seen:
                raise ConfigError(f"{where}: {m!r} is in stages {seen[m]} and {s}: each module belongs to one stage")
            seen[m] = s
    missing = sorted(known - set(seen), key=lambda m: (len(m), m))
    if missing:
        raise ConfigError(f"{where}: no stage holds {', '.join(missing)}")
    if seen[EMBED] != 0 or seen[HEAD] != num - 1 or seen[NORM] != num - 1:
        raise ConfigError(f"{where}: the first stage must hold tok_embeddings, the last norm and output")
    order = [int(m.split(".")[1]) for mods in stages for m in mods if m.startswith("layers.")]
    if order != sorted(order):
        raise ConfigError(f"{where}: the blocks must run in order (layers.0 first), got {order}")


def stage_ids(pp_rank: int, pp: int, num_stages: int, schedule: str) -> list[int]:
    """The stages pp rank `pp_rank` holds: r, r + pp, r + 2 pp ... (looped), or r and 2 pp - 1 - r (V)."""
    if schedule in V_SCHEDULES:
        return [pp_rank, num_stages - 1 - pp_rank]
    return list(range(pp_rank, num_stages, pp))


def stage_ranks(schedule: str, pp: int, num_stages: int) -> list[int]:
    """The pp rank of every stage (the inverse of `stage_ids`)."""
    where = [0] * num_stages
    for r in range(pp):
        for i in stage_ids(r, pp, num_stages, schedule):
            where[i] = r
    return where


def describe_stages(stages: list[list[str]], pp: int, schedule: str) -> str:
    """One line: the schedule, and every stage with its pp rank and modules."""
    where = stage_ranks(schedule, pp, len(stages))
    listed = "; ".join(f"stage {i} on pp {where[i]}: {', '.join(mods)}" for i, mods in enumerate(stages))
    return f"Pipeline {schedule}: {len(stages)} stages over {pp} pp ranks: {listed}"


@dataclass(frozen=True)
class StageSlice:
    """What one stage runs of the model: its blocks (keys of `layers`), whether it embeds the tokens, whether it
    ends with the final norm and the head."""

    index: int
    layers: tuple[str, ...]
    embed: bool
    head: bool


def stage_slices(stages: list[list[str]], ids: Sequence[int]) -> list[StageSlice]:
    return [
        StageSlice(
            index=i,
            layers=tuple(m.split(".", 1)[1] for m in stages[i] if m.startswith("layers.")),
            embed=EMBED in stages[i],
            head=HEAD in stages[i],
        )
        for i in ids
    ]


def keep_stages(model: nn.Module, slices: Sequence[StageSlice]) -> None:
    """Remove from `model` (a Decoder, on meta) every module no slice runs: this rank's part of the model, with
    the FQNs of the whole. A tied embedding needs the first and the last stage on one rank (a V schedule)."""
    embed = any(s.embed for s in slices)
    head = any(s.head for s in slices)
    if getattr(model, "tie_embeddings", False) and embed != head:
        raise ConfigError(
            "this model ties its embedding and output head (one matrix), so the first and the last pipeline stage "
            "must be on one rank: use a V schedule (parallelism.pipeline_parallel_schedule = ZBVZeroBubble or "
            "DualPipeV), or an untied flavor"
        )
    keep = {k for s in slices for k in s.layers}
    for k in [k for k in model.layers if k not in keep]:
        del model.layers[k]
    if not embed:
        model.tok_embeddings = None
    if not head:
        model.norm = None
        model.output = None


class _StageView(nn.Module):
    """One stage as torch's PipelineStage sees it: its modules as children (the params the schedule computes
    weight grads for), a forward that runs the rank's part with this stage's slice."""

    def __init__(self, part: nn.Module, slice_: StageSlice):
        super().__init__()
        self.slice = slice_
        self._part = [part]  # not a child: its other stages' params are not this stage's
        if slice_.embed:
            self.tok_embeddings = part.tok_embeddings
        self.layers = nn.ModuleDict({k: part.layers[k] for k in slice_.layers})
        if slice_.head:
            self.norm, self.output = part.norm, part.output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.slice
        return self._part[0](x, layers=s.layers, embed=s.embed, head=s.head)


def held_by_schedule(
    schedule: str, pp: int, rank: int, m: int, v: int, weights: dict[int, tuple[float, ...]] | None = None
) -> tuple[float, ...] | None:
    """What rank `rank` holds at once at its peak in torch's action list for `schedule`: a forward (F) holds its
    stage-microbatch's activations until its full backward (B) or, split, its weight pass (W: the input pass I
    leaves what W needs). With `weights` (stage -> a tuple of byte terms per microbatch) the terms at the peak of
    their sum; else the number of stage-microbatches, as a 1-tuple. The list comes from the schedule class's own
    planning method, on an instance built without stages or a process group (the attributes it reads); None if
    that is not possible (GPipe and 1F1B have no such method: their closed forms are exact)."""
    try:
        from torch.distributed.pipelining.schedules import _ComputationType, get_schedule_class

        cls = get_schedule_class(schedule)
        plan = cls.__new__(cls)
        plan.pp_group_size, plan._n_microbatches, plan.n_local_stages, plan.num_stages = pp, m, v, v * pp
        plan.number_of_rounds = max(1, m // pp)
        plan.microbatches_per_round = m // plan.number_of_rounds
        actions = plan._calculate_single_rank_operations(rank)
    except Exception:  # noqa: BLE001 - a private method of torch's: the caller falls back to a closed form
        return None
    kinds = _ComputationType
    live: set[tuple[int, int]] = set()
    best: tuple[float, ...] = (0.0,)

    def terms() -> tuple[float, ...]:
        if weights is None:
            return (float(len(live)),)
        return tuple(sum(col) for col in zip(*(weights[s] for s, _ in live), strict=True)) if live else best

    for action in actions:
        if action is None:
            continue
        for a in getattr(action, "sub_actions", None) or (action,):
            key = (a.stage_index, a.microbatch_index)
            if a.computation_type == kinds.FORWARD:
                live.add(key)
                now = terms()
                if sum(now) > sum(best):
                    best = now
            elif a.computation_type in (kinds.FULL_BACKWARD, kinds.BACKWARD_WEIGHT):
                live.discard(key)
    return best


# ------------------------------------------------------------------------------------------- the schedule
def fsdp_reduce_grads(model: nn.Module) -> None:
    """FSDP2's reduce-scatter of the grads accumulated with gradient sync off, outside a backward (what torch's
    PipelineStage.perform_reduce_grad does for an FSDP2 stage), on every FSDP2 unit of `model`; no-op without
    FSDP2."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if not isinstance(model, FSDPModule):
        return
    model.set_is_last_backward(True)
    model.set_reshard_after_backward(True)
    model.set_requires_gradient_sync(True)
    state = fully_shard.state(model)
    for unit in state._state_ctx.all_states:
        for group in unit._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


def hold_unsharded(model: nn.Module) -> None:
    """During a schedule: FSDP2 keeps each unit gathered between its microbatches' backwards and leaves the last
    one to `fsdp_reduce_grads` (a zero-bubble weight grad lands after its unit's post-backward); DMuon keeps each
    group's broadcast buffer until `dmuon.reduce_grads` (under Z2 one broadcast per step, not per microbatch; Z3
    still frees it after each forward)."""
    from torch.distributed.fsdp import FSDPModule

    from titan_dmuon.dmuon.state import find_state

    if isinstance(model, FSDPModule):
        model.set_is_last_backward(False)
        model.set_reshard_after_backward(False)
    state = find_state(model)
    if state is not None:
        state.reshard_after_backward = False


class Pipeline:
    """This rank's stages and the schedule that runs them (train and eval).

    `step(inputs, labels)` runs one training step's forwards and backwards over every microbatch and returns the
    sum of the microbatch losses (the step's mean loss) on the ranks holding the last stage, None elsewhere;
    the grads are then accumulated locally: the caller reduces them (`reduce_grads` of its optimizer component)."""

    def __init__(
        self,
        part: nn.Module,
        slices: Sequence[StageSlice],
        num_stages: int,
        schedule: str,
        pp_group,
        device: torch.device,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        rows: int,
        eval_rows: int,
        microbatch_size: int,
        seq_len: int,
        hidden: tuple[int, int, torch.dtype],
        vocab: int,
        logits_mesh=None,
    ):
        for what, n in (("local_batch_size x gradient_accumulation_steps", rows), ("local_batch_size", eval_rows)):
            if n % microbatch_size:
                raise ConfigError(
                    f"training.{what} = {n} rows do not split into microbatches of "
                    f"parallelism.pipeline_parallel_microbatch_size = {microbatch_size}"
                )
        self.part, self.slices, self.schedule_name = part, list(slices), schedule
        self.num_stages, self.pp_group, self.device = num_stages, pp_group, device
        self.microbatch_size, self.seq_len, self.hidden = microbatch_size, seq_len, hidden
        self.vocab, self.logits_mesh = vocab, logits_mesh
        self.n_microbatches = rows // microbatch_size
        self.has_first = any(s.index == 0 for s in slices)
        self.has_last = any(s.index == num_stages - 1 for s in slices)
        self._loss_fn = loss_fn
        self.schedule = self._build(self.n_microbatches, train=True)
        self._eval_microbatches = eval_rows // microbatch_size
        self._eval_schedule = None  # built at the first validation

    def _stage(self, s: StageSlice, train: bool):
        from torch.distributed.pipelining import PipelineStage

        mb, (length, dim, dtype) = self.microbatch_size, self.hidden
        # The shapes between stages, given (no shape-inference run of the stage: its DMuon and FSDP2 hooks would
        # count a forward and backward no step asked for). requires_grad: grads flow back between stages.
        hidden = torch.empty(mb, length, dim, dtype=dtype, device=self.device, requires_grad=train)
        tokens = torch.zeros(mb, self.seq_len, dtype=torch.long, device=self.device)
        inp = tokens if s.embed else hidden
        out = self._logits(dtype, train) if s.head else hidden
        # Every stage's metadata in full (the grads' too: the logits are a DTensor under loss parallel), so torch runs
        # no metadata-inference forward and backward of a stage.
        return PipelineStage(
            _StageView(self.part, s),
            s.index,
            self.num_stages,
            self.device,
            input_args=(inp,),
            output_args=(out,),
            input_grads=(None if s.embed else hidden,),
            output_grads=(out,),
            group=self.pp_group,
        )

    def _logits(self, dtype: torch.dtype, train: bool) -> torch.Tensor:
        """The last stage's output for one microbatch: the logits, a DTensor sharded over the vocabulary under
        loss parallelism."""
        mb, length = self.microbatch_size, self.seq_len
        mesh = self.logits_mesh
        if mesh is None:
            return torch.empty(mb, length, self.vocab, dtype=dtype, device=self.device, requires_grad=train)
        from torch.distributed.tensor import DTensor, Shard

        local = torch.empty(mb, length, self.vocab // mesh.size(), dtype=dtype, device=self.device)
        shape = (mb, length, self.vocab)
        stride = (length * self.vocab, self.vocab, 1)
        out = DTensor.from_local(local, mesh, [Shard(2)], run_check=False, shape=shape, stride=stride)
        return out.requires_grad_(train)

    def _build(self, n_microbatches: int, train: bool):
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

        cls = get_schedule_class(self.schedule_name)
        stages = [self._stage(s, train) for s in self.slices]
        loss_fn = self._scaled_loss(n_microbatches)
        try:
            if issubclass(cls, PipelineScheduleSingle):
                return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
            return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
        except (ValueError, AssertionError, RuntimeError) as e:
            raise ConfigError(
                f"parallelism.pipeline_parallel_schedule = {self.schedule_name!r} with {n_microbatches} microbatches "
                f"over {self.num_stages} stages: {e}"
            ) from None

    def _scaled_loss(self, n: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return self._loss_fn(output, target) / n  # the microbatches' sum is the step's mean

        return loss

    def _run(self, schedule, inputs: torch.Tensor, labels: torch.Tensor, train: bool) -> torch.Tensor | None:
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        target = labels if self.has_last else None
        if train:
            schedule.step(*args, target=target, losses=losses, return_outputs=False)
        else:
            schedule.eval(*args, target=target, losses=losses)
        if not self.has_last:
            return None
        return torch.stack([loss.detach() for loss in losses]).sum()

    def step(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        hold_unsharded(self.part)
        return self._run(self.schedule, inputs, labels, train=True)

    @torch.no_grad()
    def eval(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """The mean loss of one validation batch (local_batch_size rows) on the last stage's ranks, None elsewhere."""
        if self._eval_schedule is None:
            self._eval_schedule = self._build(self._eval_microbatches, train=False)
        return self._run(self._eval_schedule, inputs, labels, train=False)


__all__ = [
    "SINGLE_STAGE_SCHEDULES",
    "V_SCHEDULES",
    "Pipeline",
    "StageSlice",
    "describe_stages",
    "fsdp_reduce_grads",
    "held_by_schedule",
    "keep_stages",
    "plan_stages",
    "stage_ids",
    "stage_ranks",
    "stage_slices",
    "stages_per_rank",
]
