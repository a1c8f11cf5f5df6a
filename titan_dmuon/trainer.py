"""The training loop, built in an explicit order like torchtitan's Trainer.

    trainer = Trainer(cfg)   # model spec + optimizer component (by name), device, distributed runtime, mesh, seed,
    try:                     # tokenizer, data (+ validator), meta model, parallelize, materialize, optimizer, lr,
        trainer.train()      # checkpoint (loads the newest complete one: the run resumes), metrics (profiler: train())
    finally:
        trainer.close()      # a checkpoint in flight, optimizer component, metrics, the runtime (heartbeat, group)

The trainer knows neither the model family nor the optimizer: it asks the family's ModelSpec
(titan_dmuon/components/model.py) and the optimizer component (titan_dmuon/components/optimizer/). The process
group, its timeouts and the heartbeat are the DistributedRuntime's (titan_dmuon/parallel/runtime.py); validation is
the Validator's (titan_dmuon/components/validate.py).
Every rank runs the same steps and the same collectives. A step reads nothing to the host: the loss and grad norm
stay on the device, where the step also records the first step whose loss or grad norm was non-finite (identical
on every rank after the reductions) and the all-reduced stop flag. The host reads them in one sync on "read steps"
(`Trainer.read_due`: log steps, validation and checkpoint steps, and at least every READ_EVERY steps): a recorded
divergence raises `TrainingDivergedError` naming the step it happened at, on every rank at the same read step and
before any checkpoint or validation of a diverged state; an agreed stop signal stops every rank after that step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import math
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from titan_dmuon.components.checkpoint import CheckpointManager, check_async_mode
from titan_dmuon.components.initialization import materialize
from titan_dmuon.components.loaders import build_job_dataloader, global_batch_size
from titan_dmuon.components.lr_scheduler import build_lr_scheduler
from titan_dmuon.components.metrics import (
    MetricsLogger,
    SectionTimer,
    device_memory_stats,
    get_peak_flops,
    throughput_metrics,
)
from titan_dmuon.components.model import build_meta_model, check_flavor, get_model_spec, model_vocab_size
from titan_dmuon.components.moe import moe_layers, moe_stats, set_aux_loss_scale, update_moe_bias
from titan_dmuon.components.optimizer import build_optimizer_component
from titan_dmuon.components.profiling import maybe_enable_memory_snapshot, maybe_enable_profiling
from titan_dmuon.components.validate import Validator
from titan_dmuon.config import ConfigError, JobConfig, dump_toml
from titan_dmuon.data import DataError, build_tokenizer
from titan_dmuon.dtypes import to_dtype
from titan_dmuon.parallel import ParallelDims, parallelize
from titan_dmuon.parallel.layout import check_node_layout, describe_layout
from titan_dmuon.parallel.pipeline import (
    Pipeline,
    describe_stages,
    keep_stages,
    plan_stages,
    stage_ids,
    stage_slices,
)
from titan_dmuon.parallel.preemption import StopRequested, StopSignals
from titan_dmuon.parallel.runtime import DistributedRuntime, ranks_per_node

logger = logging.getLogger(__name__)

# The host reads the step's device record (divergence, the stop flag; the loss and grad norm on log steps) at least
# every READ_EVERY steps: a stop signal is acted on at most READ_EVERY - 1 steps after the step it arrived in (fewer
# with a metrics.log_freq below it: every log step reads too), and a divergence is raised at most as late.
READ_EVERY = 10


class TrainingDivergedError(RuntimeError):
    """The loss or the gradient norm became NaN/inf."""


class Trainer:
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.step = 0
        self.stop_signals = StopSignals()  # installed around the training loop
        self.stop_agreed = False  # every rank saw a stop signal's flag after the last step
        self.tokens_seen = 0  # over all DP ranks
        self.last_loss = math.nan  # the loss of the last step this run read (the last step is always read)
        # On the device, updated by every step and read by `_read` only: [the first step whose loss or grad norm was
        # non-finite (0: none yet), its loss, its grad norm], and the last step's all-reduced stop flag.
        self._health: torch.Tensor | None = None
        self._stops: torch.Tensor | None = None
        self.complete = False  # the checkpoint loaded is at or past training.steps: nothing to train or write
        self.elapsed_before = 0.0  # training wall time of the runs this one resumes (from the checkpoint)
        self._train_start: float | None = None  # when this run's training loop started (perf_counter)
        self.checkpointer: CheckpointManager | None = None
        self.metrics: MetricsLogger | None = None
        self.optimizer_component = None  # chosen by optimizer.name; self.optimizer is its torch.optim.Optimizer
        self.validator: Validator | None = None
        self.runtime = DistributedRuntime(cfg.comm)  # process group, timeouts, heartbeat, teardown
        try:
            with self.runtime.comm_failures():  # a dead or hung peer: CommFailureError
                self._build()
        except BaseException as e:  # e.g. a ConfigError found after dist init: leave no process group behind
            self.close(graceful=isinstance(e, ConfigError))
            raise

    def _build(self) -> None:
        cfg, t = self.cfg, self.cfg.training

        # 0. The model family and the optimizer component, by name (config errors before any process group).
        try:
            self.spec = get_model_spec(cfg.model.name)
        except ValueError as e:
            raise ConfigError(f"model.name: {e}") from None
        try:
            check_flavor(self.spec, cfg.model.flavor)
        except ValueError as e:
            raise ConfigError(f"model.flavor: {e}") from None
        self.optimizer_component = build_optimizer_component(cfg, self.spec)
        cfg.checkpoint.validate()  # also for a config that did not come through parse_args
        check_async_mode(cfg)
        # 1. Device.
        self.device = self._init_device()
        self._health = torch.zeros(3, dtype=torch.float64, device=self.device)
        self.optimizer_timer = SectionTimer(self.device)  # each step's optimizer.step(): time/optimizer_share
        # 2. Process group: gloo on CPU, NCCL on CUDA; a lone process without torchrun makes a 1-rank group; a group
        #    the caller made (e.g. a test harness) is used and left to it.
        self.runtime.init(self.device)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # 3. Degrees and the one mesh (replicate, shard, tp); TP ranks of a DP group share data.
        self.dims = ParallelDims.from_config(cfg, self.world_size, ranks_per_node())
        self.mesh = self.dims.build_mesh(self.device.type)
        # 3b. Where the ranks run (one all_gather_object, the heartbeat started before it), checked for replicate =
        #     "nodes", logged.
        places = self.runtime.meet()
        if cfg.parallelism.data_parallel_replicate_degree == "nodes":
            check_node_layout(self.dims, places)
        logger.info("%s", describe_layout(self.dims, self.runtime.hosts))
        self.dp_rank, self.dp_world_size = self.dims.dp_coordinates(self.mesh)
        logger.info("%s; %s", cfg.job.description, self.dims.describe())
        # 4. Seed (the same on every rank: the initial weights are drawn from it) and determinism.
        self.seed = self._set_determinism()
        logger.info("Seed %d%s", self.seed, " (training.seed unset: drawn at random)" if t.seed is None else "")
        # 5. Tokenizer.
        try:
            self.tokenizer = build_tokenizer(cfg.model.tokenizer)
        except DataError as e:
            raise ConfigError(f"model.tokenizer: {e}") from None
        # 5b. Data, checked before the model is built (a bad dataset is a config error, not a late traceback): this
        #     DP rank's rows of each global batch of local x DP x accumulation rows (and of the held-out split).
        self.global_batch_size = global_batch_size(cfg, self.dp_world_size)
        self.dataloader = build_job_dataloader(
            cfg,
            "train",
            tokenizer=self.tokenizer,
            dp_rank=self.dp_rank,
            dp_world_size=self.dp_world_size,
            seed=self.seed,
            device=self.device,
        )
        self.validator = (
            Validator(cfg, self.tokenizer, self.dp_rank, self.dp_world_size, self.device, self.seed, self._eval_loss)
            if cfg.validation.enable
            else None
        )
        # 6. Model, on the meta device: nothing is allocated yet.
        vocab = model_vocab_size(cfg, self.tokenizer.vocab_size)
        if vocab != self.tokenizer.vocab_size:  # saved in config.toml: a resume or generate.py needs no HF folder
            cfg.model.vocab_size = vocab
        model = build_meta_model(self.spec, cfg, vocab)
        self.num_params, self.flops_per_token = self.spec.nparams_and_flops(model, t.seq_len)
        self.n_layers = len(self.spec.blocks(model))
        #    Whether the whole model has MoE layers, and their expert count: a pipeline stage may hold none
        #    (DeepSeek-V3's dense first layers) and must still join the step's MoE all-reduce, with the grid's shape.
        whole_moe = moe_layers(model)
        self.has_moe, self._moe_experts = bool(whole_moe), max((m.num_experts for m in whole_moe), default=0)
        #    Pipeline: this rank keeps the modules of its stages only, with the whole model's FQNs
        #    (titan_dmuon/parallel/pipeline.py); everything below treats that part as the model.
        self.pipeline: Pipeline | None = None
        if self.dims.pp_enabled:
            self._stages = plan_stages(cfg, self.n_layers)
            pp_rank = self.dims.meshes.pp.get_local_rank()
            ids = stage_ids(pp_rank, self.dims.pp, len(self._stages), cfg.parallelism.pipeline_parallel_schedule)
            self._slices = stage_slices(self._stages, ids)
            keep_stages(model, self._slices)
            logger.info("%s", describe_stages(self._stages, self.dims.pp, cfg.parallelism.pipeline_parallel_schedule))
        logger.info(
            "Model %s/%s: %s params, %.3g training FLOPs/token",
            cfg.model.name,
            cfg.model.flavor,
            f"{self.num_params:,}",
            self.flops_per_token,
        )
        # 7. Parallelize on meta: TP -> EP -> AC -> compile -> the optimizer component's prepare (the params it keeps
        #    from FSDP2) -> FSDP2 (titan_dmuon/parallel/parallelize.py).
        self.model = parallelize(
            model, self.dims, self.mesh, cfg, self.spec, self.optimizer_component, whole_model_has_moe=self.has_moe
        )
        #     Loss parallel (TP): the model's logits stay sharded over the vocabulary (see `_loss_parallel`).
        self.loss_parallel = self.dims.tp_enabled and not cfg.parallelism.disable_loss_parallel
        #     On CUDA, each rank's memory plan against its GPU's free memory, before anything is allocated: a plan
        #     that cannot fit is a ConfigError (on every rank) naming its largest terms and the changes that would.
        if self.device.type == "cuda" and self.optimizer_component.planned:
            self._check_device_memory()
        # 7b. Materialize: each rank allocates only what it holds (its FSDP2 shards, the optimizer component's
        #     own params, TP shards) and fills it with values that are a function of (seed, FQN) only, so the run
        #     starts from the same weights on any cluster shape (titan_dmuon/components/initialization.py).
        materialize(self.model, self.spec, self.optimizer_component, self.device, self.seed)
        #     MoE layers inject their auxiliary loss's gradient themselves (it must survive reentrant activation
        #     checkpointing): scaled as the loss is, by 1 / accumulation steps (titan_dmuon/components/moe.py).
        self._moe_rows = self._moe_layer_rows()
        self._moe_rows_device: torch.Tensor | None = None
        #     Pipeline: the schedule over this rank's stages; the step's rows (all accumulation micro-batches) are
        #     its microbatches.
        if self.dims.pp_enabled:
            self.pipeline = self._build_pipeline()
        n_micro = self.pipeline.n_microbatches if self.pipeline is not None else t.gradient_accumulation_steps
        set_aux_loss_scale(self.model, 1.0 / n_micro)
        self._moe_scalars: dict[str, torch.Tensor] = {}
        # 8. Optimizer and 9. lr schedule (one factor for every param group).
        self.optimizer = self.optimizer_component.build()
        self.optimizer_component.attach_qk_clip()  # QK-clip, or the max-logit metric alone, when configured
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, t.steps)
        # 10. MFU's peak and the clipping norm.
        self.peak_flops = get_peak_flops(self.device)
        self.max_norm = t.max_norm if t.max_norm > 0 else math.inf
        # 11. Checkpoints: resume from the newest complete one in the folder (or checkpoint.load_step, or start
        #     from checkpoint.initial_load_path): weights, optimizer, schedule, data position, step, RNG.
        self.checkpointer = CheckpointManager(
            cfg,
            optim=self.optimizer_component,
            lr_scheduler=self.lr_scheduler,
            dataloader=self.dataloader,
            dp_rank=self.dp_rank,
            dp_world_size=self.dp_world_size,
            global_batch_size=self.global_batch_size,
            device=self.device,
            seed=self.seed,
        )
        self.step, self.tokens_seen = self.checkpointer.load()
        self.elapsed_before = self.checkpointer.elapsed_s
        # A checkpoint at or past training.steps: the run is complete, and its rerun writes nothing (no events file,
        # no config.toml, no W&B run, no checkpoint); `train` says so and which flag trains further.
        self.complete = self.step >= t.steps
        if self.complete:
            return
        if self.step:
            logger.info("Resumed at step %d (%s tokens seen)", self.step, f"{self.tokens_seen:,}")
        # 12. Metrics (rank 0 writes), and the resolved config (the seed it drew, if random) beside them. The first
        #     step this run logs is step + 1: TensorBoard drops the events an earlier run left there or past it
        #     (killed after logging steps it never saved), so each step shows once, with this run's value.
        resolved = dataclasses.replace(cfg, training=dataclasses.replace(t, seed=self.seed))  # W&B's run config
        self.metrics = MetricsLogger(
            cfg.metrics, cfg.job.dump_folder, self.rank, t.steps, purge_step=self.step + 1, job_config=resolved
        )
        if self.rank == 0:
            self._save_config()

    # ------------------------------------------------------------------------------------------- setup
    def _init_device(self) -> torch.device:
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
            return device
        return torch.device("cpu")

    def _set_determinism(self) -> int:
        seed = self.cfg.training.seed
        if seed is None:  # random, but one value for all ranks
            t = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=self.device)
            dist.broadcast(t, src=0)
            seed = int(t.item())
        torch.manual_seed(seed)
        if self.cfg.training.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.deterministic = True
            torch.backends.cudnn.benchmark = False
        return seed

    def _save_config(self) -> None:
        """`<dump_folder>/config.toml` (and TensorBoard text "config"): the config this run trains with, with
        the seed it used, so `--config` of that file repeats the run."""
        resolved = dataclasses.replace(self.cfg, training=dataclasses.replace(self.cfg.training, seed=self.seed))
        text = dump_toml(resolved)
        os.makedirs(self.cfg.job.dump_folder, exist_ok=True)
        path = os.path.join(self.cfg.job.dump_folder, "config.toml")
        with open(path, "w") as f:
            f.write(text)
        self.metrics.log_text("config", "".join(f"    {line}\n" for line in text.splitlines()))
        logger.info("Config in %s", path)

    def _check_device_memory(self) -> None:
        from titan_dmuon.planner import check_device_memory

        def worst_of_ranks(ratio: float) -> float:
            t = torch.tensor([ratio], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return t.item()

        free, total = torch.cuda.mem_get_info(self.device)
        check_device_memory(self.model, self.spec, self.dims, self.cfg, self.rank, free, total, worst_of_ranks)

    # -------------------------------------------------------------------------------------------- step
    def _loss_parallel(self) -> contextlib.AbstractContextManager:
        """Loss parallel (TP, unless parallelism.disable_loss_parallel): the context a micro-batch's forward, loss
        and backward run in; a no-op otherwise.

        The TP plan leaves the logits a DTensor sharded on the vocab dim; inside torch's `loss_parallel()` the
        cross-entropy's log-softmax and NLL reduce over the TP group (a max, a sum and the target logit, each
        [tokens] wide) instead of every TP rank holding the whole [tokens, vocab] logits. Their backward is
        also loss parallel's own op, so `loss.backward()` must run inside too.
        """
        return loss_parallel() if self.loss_parallel else contextlib.nullcontext()

    def _loss_of(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss of `logits` as a plain scalar tensor (the same on all TP ranks)."""
        loss = self.spec.loss_fn(logits, labels)
        if isinstance(loss, DTensor):  # loss parallel: replicated over TP, so no communication here
            loss = loss.full_tensor()
        return loss

    def _loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One micro-batch's loss as a plain scalar tensor (the same on all TP ranks). Call it, and backward it,
        inside `self._loss_parallel()`."""
        return self._loss_of(self.model(inputs), labels)

    def _eval_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The Validator's loss: `_loss` inside `_loss_parallel()`, no backward. Under a pipeline the last stage's
        ranks compute it: they return it times the pipeline degree and the other ranks 0, so the Validator's mean
        over all ranks is the mean over the last stage's."""
        with self._loss_parallel():
            if self.pipeline is None:
                return self._loss(inputs, labels)
            loss = self.pipeline.eval(inputs, labels)
            if loss is None:
                return torch.zeros((), device=self.device)
            return loss * self.dims.pp

    def _build_pipeline(self) -> Pipeline:
        t, p = self.cfg.training, self.cfg.parallelism
        dim = self.model.args.dim
        length = t.seq_len // self.dims.tp if self.dims.tp_enabled else t.seq_len  # sequence parallel between blocks
        dtype = to_dtype(t.mixed_precision_param)
        return Pipeline(
            self.model,
            self._slices,
            len(self._stages),
            p.pipeline_parallel_schedule,
            self.dims.meshes.pp.get_group(),
            self.device,
            self._loss_of,
            rows=t.local_batch_size * t.gradient_accumulation_steps,
            eval_rows=t.local_batch_size,
            microbatch_size=p.pipeline_parallel_microbatch_size,
            seq_len=t.seq_len,
            hidden=(length, dim, dtype),
            vocab=self.model.args.vocab_size,
            logits_mesh=self.dims.meshes.tp if self.loss_parallel else None,
        )

    def train_step(self, data_iter) -> tuple[torch.Tensor, torch.Tensor, int]:
        """One optimizer step over gradient_accumulation_steps micro-batches, with no host sync: nothing is read to
        the host here (`_read` does, on read steps).

        Returns (loss averaged over the DP ranks, global grad norm, tokens this rank processed): the first two as
        0-dim fp32 tensors on the device (reading one, `float(t)`, is a host sync). It also records on the device
        whether this step's loss or grad norm was non-finite (the first such step is kept) and every rank's stop
        flag after this step; the optimizer step runs either way (a diverged run raises at the next read step and
        saves nothing after the divergence).
        """
        accum = self.cfg.training.gradient_accumulation_steps
        self.optimizer.zero_grad()
        # [the loss, whether this rank got a stop signal]: one all-reduce gives every rank both.
        loss_sum = torch.zeros(2, dtype=torch.float32, device=self.device)
        ntokens = 0
        if self.pipeline is not None:
            loss, ntokens = self._pipeline_step(data_iter, accum)
            loss_sum[0] += loss
        else:
            for i in range(accum):
                inputs, labels = next(data_iter)
                # Pinned by the loader on CUDA: the copies run on the stream, the host goes on (no sync).
                inputs = inputs.to(self.device, non_blocking=True)
                labels = labels.to(self.device, non_blocking=True)
                # No gradient communication on the micro-batches before the last one (grad accumulation).
                with (
                    self.optimizer_component.no_sync() if i < accum - 1 else contextlib.nullcontext(),
                    self._loss_parallel(),
                ):
                    loss = self._loss(inputs, labels) / accum  # mean over tokens; the grads sum to the mean
                    loss.backward()
                loss_sum[0] += loss.detach()
                ntokens += labels.numel()
        grad_norm = self.optimizer_component.clip_grad_norm_(self.max_norm)  # global: the same on every rank
        # TP ranks hold the same loss, so the mean over all ranks is the mean over the DP ranks (under a pipeline
        # only the last stage's ranks, one stage's worth, hold one). A stop signal is sampled here, on every rank
        # after the same step (titan_dmuon/parallel/preemption.py); the host reads the sum on read steps.
        loss_sum[1] = 1.0 if self.stop_signals.pending else 0.0  # a fill on the device: no copy
        dist.all_reduce(loss_sum)
        loss = loss_sum[0] / self.dims.stage_size
        norm = grad_norm.detach().to(self.device, torch.float32)
        self._stops = loss_sum[1]
        self._record_health(loss, norm)
        with self.optimizer_timer.section():
            self.optimizer.step()
        self.lr_scheduler.step()
        if self.has_moe:
            self._moe_scalars = self._moe_after_step()
        return loss, norm, ntokens

    def _record_health(self, loss: torch.Tensor, norm: torch.Tensor) -> None:
        """On the device: keep (this step, loss, grad norm) in `_health` if either is non-finite and no earlier
        step's was (the same on every rank: both are reduced)."""
        values = torch.stack([loss, norm]).double()
        first = torch.isfinite(values).all().logical_not() & (self._health[0] == 0)
        now = torch.cat([values.new_full((1,), float(self.step)), values])
        self._health = torch.where(first, now, self._health)

    def log_due(self, step: int, last: bool) -> bool:
        """Whether step `step` logs its metrics: step 1, every metrics.log_freq steps and the last."""
        return step == 1 or step % self.cfg.metrics.log_freq == 0 or last

    def read_due(self, step: int, last: bool) -> bool:
        """Whether the host reads the device record after `step` (`_read`): on log steps (`log_due`), before a
        checkpoint save or a validation, and every READ_EVERY steps (the stop flag's lag). The same on every
        rank."""
        validate = self.validator is not None and self.validator.due(step)
        return self.log_due(step, last) or self.checkpointer.save_due(step, last) or validate or step % READ_EVERY == 0

    def _read(self, loss: torch.Tensor, norm: torch.Tensor) -> tuple[float, float]:
        """The one host sync of a read step: the divergence record, the stop flag and this step's loss and grad
        norm in one read. Raises TrainingDivergedError (every rank, at the same read step) if a step since the
        start diverged, naming the first; sets `stop_agreed`. Returns (loss, grad norm) as floats."""
        record = torch.cat([self._health, torch.stack([self._stops.double(), loss.double(), norm.double()])])
        bad_step, bad_loss, bad_norm, stops, loss_value, norm_value = record.tolist()
        if bad_step:
            raise TrainingDivergedError(
                f"training diverged at step {int(bad_step)}: loss = {bad_loss}, grad norm = {bad_norm} "
                f"(non-finite; read after step {self.step}, before any checkpoint or validation of a diverged "
                "state). Lower the learning rates (the lr of each [optimizer.*] table), raise "
                "lr_scheduler.warmup_steps or lower training.max_norm"
            )
        self.stop_agreed = stops > 0
        return loss_value, norm_value

    def _pipeline_step(self, data_iter, accum: int) -> tuple[torch.Tensor, int]:
        """The forwards and backwards of a step under a pipeline: the accumulation micro-batches' rows are the
        schedule's microbatches, every backward without gradient communication, then one reduce of the grads.
        Returns (the step's mean loss on the last stage's ranks, 0 elsewhere; the tokens this rank fed)."""
        batches = [next(data_iter) for _ in range(accum)]  # pinned on CUDA: copied without a host sync
        inputs = torch.cat([b[0].to(self.device, non_blocking=True) for b in batches])
        labels = torch.cat([b[1].to(self.device, non_blocking=True) for b in batches])
        with self.optimizer_component.no_sync(), self._loss_parallel():
            loss = self.pipeline.step(inputs, labels)
        self.optimizer_component.reduce_grads()
        return (loss if loss is not None else torch.zeros((), device=self.device)), labels.numel()

    def _moe_after_step(self) -> dict[str, torch.Tensor]:
        """A Mixture-of-Experts model's step: every rank's tokens per expert summed (one all-reduce of the
        [MoE layers, experts] counts; each rank counts the tokens it routed, before expert parallelism moves
        them), the auxiliary-loss-free bias update from those global counts (the same on every rank), and the
        metrics: the auxiliary loss (mean over ranks) and the most and least loaded expert of any layer, as a
        fraction of the mean load (1 = balanced), as device scalars (read on log steps only: no host sync here).
        Tokens are never dropped (no capacity limit)."""
        stats = moe_stats(self.model)
        experts = self._moe_experts
        local = stats["tokens_per_expert"].to(self.device, torch.float64).reshape(-1, experts)  # [0, E] on no layer
        n_local = local.shape[0]
        # One row per layer of the whole model (a pipeline stage holds some of them), a last column flagging the
        # rows of MoE layers, and the aux loss summed over this rank's layers with their number: summed over every
        # rank, each layer's counts are its stage's ranks' and the aux loss is the mean over layers and ranks.
        n_rows = max([self.n_layers, *(r + 1 for r in self._moe_rows)])  # the whole model's layers
        grid = torch.zeros(n_rows, experts + 1, dtype=torch.float64, device=self.device)
        if self._moe_rows_device is None:  # made once: a tensor from a list is a (synchronous) host-to-device copy
            self._moe_rows_device = torch.tensor(self._moe_rows, dtype=torch.long, device=self.device)
        rows = self._moe_rows_device
        grid[rows, :experts] = local
        grid[rows, experts] = 1.0
        aux = stats["aux_loss"].to(self.device, torch.float64).reshape(1)
        flat = torch.cat([grid.flatten(), aux * n_local, aux.new_full((1,), float(n_local))])
        dist.all_reduce(flat)
        grid = flat[:-2].view_as(grid)
        update_moe_bias(self.model, grid[rows, :experts])
        # The rows of MoE layers by a mask kept on the device (indexing by it would read its count to the host).
        is_moe = grid[:, experts:] > 0
        counts = grid[:, :experts]
        mean = counts.mean(dim=1, keepdim=True).clamp(min=1e-12)
        load = counts / mean
        return {
            "moe/aux_loss": flat[-2] / flat[-1].clamp(min=1.0),
            "moe/max_load": torch.where(is_moe, load, -math.inf).max(),
            "moe/min_load": torch.where(is_moe, load, math.inf).min(),
            "moe/layers": is_moe.sum(),
        }

    def _moe_layer_rows(self) -> list[int]:
        """Each of this rank's MoE layers' row among the whole model's layers (its block index `layers.N`), in
        `moe_layers` order."""
        names = {id(m): n for n, m in self.model.named_modules()}
        rows = []
        for i, layer in enumerate(moe_layers(self.model)):
            parts = names[id(layer)].split(".")
            rows.append(int(parts[1]) if parts[0] == "layers" and parts[1].isdigit() else i)
        return rows

    # -------------------------------------------------------------------------------------------- loop
    def train(self) -> None:
        """Run training.steps steps; a collective that fails because a peer died or hung raises CommFailureError."""
        with self.runtime.comm_failures():
            self._train()

    def _train(self) -> None:
        cfg, t = self.cfg, self.cfg.training
        if self.complete:
            logger.info(
                "Nothing to do: the run is complete at step %d (checkpoint %s, training.steps = %d); nothing was "
                "written. To train further, rerun with --training.steps M (M > %d)",
                self.step,
                self.checkpointer.folder / f"step-{self.step}",
                t.steps,
                self.step,
            )
            return
        data_iter = iter(self.dataloader)
        logger.info(
            "Training %d steps: global batch %d x %d tokens (local %d x %d DP ranks x %d accumulation)",
            t.steps,
            self.global_batch_size,
            t.seq_len,
            t.local_batch_size,
            self.dp_world_size,
            t.gradient_accumulation_steps,
        )
        with (
            self.stop_signals.installed(),
            maybe_enable_profiling(cfg.profiling, cfg.job.dump_folder, self.step, self.rank) as profiler,
            maybe_enable_memory_snapshot(cfg.profiling, cfg.job.dump_folder, self.step, self.rank) as snapshot,
        ):
            self._train_start = time.perf_counter()
            interval_start, interval_tokens = self._train_start, 0
            while self.step < t.steps:
                self.step += 1
                # The lrs this step trains with (train_step advances the schedule): the first group's of each kind.
                lrs: dict[str, float] = {}
                for i, group in enumerate(self.optimizer.param_groups):
                    lrs.setdefault(f"lr/{group.get('kind', f'group{i}')}", group["lr"])
                loss, grad_norm, ntokens = self.train_step(data_iter)  # device tensors: no host sync
                self.runtime.use_train_timeout()  # set-up and this process's first step (compile) are done
                interval_tokens += ntokens
                self.tokens_seen += ntokens * self.dp_world_size  # every DP rank processes as many
                last = self.step == t.steps
                # The step's one host sync, on read steps only: raises on a divergence before anything below
                # logs, validates or saves (a stop saves only here too).
                if self.read_due(self.step, last):
                    loss, grad_norm = self._read(loss, grad_norm)
                    self.last_loss = loss
                scalars: dict[str, float] = {}
                if self.log_due(self.step, last):
                    optimizer_s = self.optimizer_timer.read()  # on CUDA, first waits for the last step's optimizer
                    now = time.perf_counter()
                    scalars.update({"loss/train": loss, "grad_norm": grad_norm, **lrs})
                    scalars["progress/tokens_seen"] = self.tokens_seen
                    scalars["progress/elapsed_s"] = self.elapsed_s(now)  # across resumes
                    # Per device (TP ranks process the same tokens), and over all of them (the DP ranks' tokens).
                    scalars.update(
                        throughput_metrics(
                            interval_tokens / self.dims.non_dp_size,
                            now - interval_start,
                            self.flops_per_token,
                            self.peak_flops,
                            ranks=self.world_size,
                        )
                    )
                    scalars["time/optimizer_share"] = optimizer_s / (now - interval_start)
                    scalars.update(device_memory_stats(self.device))
                    scalars.update({k: float(v) for k, v in self._moe_scalars.items()})
                    # Over ranks: one small collective, on log steps only.
                    scalars.update(self.optimizer_component.step_stats())
                    interval_tokens = 0
                if self.validator is not None and self.validator.due(self.step):
                    val_start = time.perf_counter()
                    scalars.update(self.validator.validate())
                    interval_start += time.perf_counter() - val_start  # validation is not training time
                if scalars:
                    self.metrics.log(self.step, scalars)
                self.checkpointer.maybe_save(self.step, self.tokens_seen, last=last, elapsed_s=self.elapsed_s())
                if self.stop_agreed and self.step < t.steps:
                    self._stop()
                profiler.step()
                snapshot.step()
                if "loss/train" in scalars:  # logging, validation and trace export are not training time
                    interval_start = time.perf_counter()
        logger.info("%s", self._done_line())

    def _done_line(self) -> str:
        """The last line of a finished run: where it ended and where its outputs are."""
        cfg = self.cfg
        line = (
            f"Training done: {self.step} steps, final loss {self.last_loss:.4f}, {self.tokens_seen:,} tokens seen, "
            f"{datetime.timedelta(seconds=round(self.elapsed_s()))} of training"
        )
        where = []
        if cfg.checkpoint.enable and self.checkpointer.saved_step is not None:
            where.append(f"checkpoint {self.checkpointer.folder / f'step-{self.checkpointer.saved_step}'}")
            if cfg.checkpoint.last_save_in_hf:
                where.append(f"Hugging Face export {self.checkpointer.hf_folder(self.checkpointer.saved_step)}")
        if self.metrics.writer is not None:
            where.append(f"TensorBoard {self.metrics.log_dir}")
        where.append(f"config {os.path.join(cfg.job.dump_folder, 'config.toml')}")
        return f"{line}; {', '.join(where)}"

    def elapsed_s(self, now: float | None = None) -> float:
        """Training wall time so far, across resumes: the earlier runs' (saved in the checkpoint's train state)
        plus this run's training loop (set-up excluded)."""
        if self._train_start is None:
            return self.elapsed_before
        return self.elapsed_before + ((time.perf_counter() if now is None else now) - self._train_start)

    def _stop(self) -> None:
        """Every rank saw a stop signal's flag after this step: save a checkpoint of it (waiting for the save, and
        for any async save in flight, to be committed) and raise StopRequested (train.py's exit code says so)."""
        # Which signal: the one the ranks that got one got (the largest number, if they differ), the same on every
        # rank, for one exit code across the job.
        signum = torch.tensor([self.stop_signals.received or 0], dtype=torch.int64, device=self.device)
        dist.all_reduce(signum, op=dist.ReduceOp.MAX)
        saved = self.checkpointer.save_for_stop(self.step, self.tokens_seen, elapsed_s=self.elapsed_s())
        raise StopRequested(int(signum.item()), self.step, saved)

    def close(self, graceful: bool = True) -> None:
        """Close the optimizer component and the metrics writer, and the runtime (the heartbeat, and the process
        group it created).

        graceful=False (after an unexpected error) talks to no other rank: the peers may be gone or stuck.
        """
        if self.checkpointer is not None:
            if dist.is_initialized():  # an async save still in flight: finished and committed, if all is well
                self.checkpointer.close(graceful=graceful)
            self.checkpointer = None
        self.runtime.stop_heartbeat(graceful)
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.optimizer_component is not None:
            if graceful and dist.is_initialized():  # e.g. an HSDP async publish may still be in flight
                self.optimizer_component.close()
            self.optimizer_component = None
        self.runtime.close(graceful)  # graceful: frees the groups now, joining gloo's threads


LOG_LEVEL_ENV = "TITAN_DMUON_LOG_LEVEL"


def set_up_logging(rank: int | None = None) -> None:
    """INFO on rank 0, WARNING elsewhere (rank from $RANK when not given). $TITAN_DMUON_LOG_LEVEL (DEBUG, INFO,
    WARNING, ERROR) sets rank 0's level for titan_dmuon's own messages instead: DEBUG adds the machine-readable
    records (the checkpoint memory JSON) without the DEBUG chatter of other libraries."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    name = os.environ.get(LOG_LEVEL_ENV, "").strip().upper()
    level = logging.getLevelName(name) if name else logging.INFO
    bad = not isinstance(level, int)
    if bad:
        level = logging.INFO
    mine = level if rank == 0 else max(level, logging.WARNING)
    logging.basicConfig(
        level=max(mine, logging.INFO),
        format=f"[rank{rank}] %(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    logging.getLogger("titan_dmuon").setLevel(mine if name else logging.NOTSET)
    if bad:
        logger.warning("%s=%s is not a logging level (DEBUG, INFO, WARNING, ERROR): using INFO", LOG_LEVEL_ENV, name)


__all__ = ["LOG_LEVEL_ENV", "Trainer", "TrainingDivergedError", "set_up_logging"]
