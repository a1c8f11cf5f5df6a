"""JobConfig: one dataclass per TOML section, one docstring per field.

The attribute docstrings are what `python train.py --help` shows (tyro reads them), so they say
what a value means and what it is for, not just its type. Each section's `validate()` checks its own ranges
(raising ConfigError "<section>.<field> ..."); `validate_config` (manager.py) calls them, then the checks that
span sections.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal


class ConfigError(ValueError):
    """An invalid configuration; the message says which key, where, and what is allowed."""


def require(cond: bool, msg: str) -> None:
    """ConfigError(msg) unless `cond`: the one form every config check takes."""
    if not cond:
        raise ConfigError(msg)


def _at_least(section: str, minimum: int, **values: float) -> None:
    for key, value in values.items():
        require(value >= minimum, f"{section}.{key} must be >= {minimum}, got {value}")


@dataclass
class Job:
    dump_folder: str = "./outputs"
    """Folder for everything a run writes: TensorBoard events, profiler traces, checkpoints."""
    description: str = "default job"
    """Free-text description of the run, logged at start-up."""
    dry_run: bool = False
    """Plan the run instead of training it: build the real model and the real TP/DMuon/FSDP2 placement on meta
    tensors over a fake process group of dry_run_world_size ranks (no GPU, no memory), print per-rank memory, the
    LPT plan and the bytes per step, and exit (titan_dmuon/planner/).
    """
    dry_run_world_size: int = 0
    """Ranks the dry run plans for (the parallelism degrees are resolved against it as for a real launch); 0 =
    dry_run_nodes x dry_run_gpus_per_node.
    """
    dry_run_nodes: int = 0
    """Nodes the dry run plans for (world size = nodes x dry_run_gpus_per_node; the layout it prints puts ranks on
    nodes as torchrun numbers them). 0 = from dry_run_world_size.
    """
    dry_run_gpus_per_node: int = 8
    """GPUs (ranks) per node of the planned cluster: what parallelism.data_parallel_replicate_degree = "nodes" and
    the printed node layout resolve against.
    """
    dry_run_json: str = ""
    """Also write the dry run's figures (per rank too) to this JSON file."""
    dry_run_tflops: float = 790.0
    """Sustained bf16 matmul TFLOP/s per GPU for the dry run's Newton-Schulz time (790: what an H100/H200, dense
    peak 989, sustains on large matmuls).
    """
    check_device_memory: bool = True
    """On CUDA, before the model is allocated, compare each rank's memory plan (the dry run's, for its own build)
    with its GPU's free memory: a plan that does not fit is an error naming the changes that would (false: a
    warning). Only for the optimizers whose layout the planner models (dmuon).
    """
    dry_run_device_memory_gib: float = 80.0
    """Memory of one device (GiB) the plan must fit in (80: an H100 80GB). A plan above it is an error (exit 2)
    that lists the changes that would fit; above 90% of it, a warning. On CUDA a real run checks its own rank's plan
    against the device's free memory instead.
    """

    def validate(self) -> None:
        _at_least("job", 1, dry_run_gpus_per_node=self.dry_run_gpus_per_node)
        require(
            not self.dry_run or self.dry_run_world_size >= 1 or self.dry_run_nodes >= 1,
            f"job.dry_run needs job.dry_run_world_size >= 1 (the ranks to plan for) or job.dry_run_nodes >= 1, got "
            f"{self.dry_run_world_size}",
        )
        require(
            not (self.dry_run_world_size and self.dry_run_nodes)
            or self.dry_run_world_size == self.dry_run_nodes * self.dry_run_gpus_per_node,
            f"job.dry_run_world_size ({self.dry_run_world_size}) != job.dry_run_nodes ({self.dry_run_nodes}) x "
            f"job.dry_run_gpus_per_node ({self.dry_run_gpus_per_node}): give one of them, or both consistent",
        )
        require(self.dry_run_tflops > 0, f"job.dry_run_tflops must be > 0, got {self.dry_run_tflops}")
        require(
            self.dry_run_device_memory_gib > 0,
            f"job.dry_run_device_memory_gib must be > 0, got {self.dry_run_device_memory_gib}",
        )


@dataclass
class Model:
    name: str = "llama3"
    """Model family: a registered ModelSpec (models/<name> registers itself; titan_dmuon/models/README.md adds one)."""
    flavor: str = "debugmodel"
    """Size preset of that family (its ModelSpec's flavors, e.g. debugmodel, 8B, 70B)."""
    tokenizer: str = "byte"
    """Tokenizer: "byte" for the built-in byte-level tokenizer, else a path to a Hugging Face tokenizer.json."""
    vocab_size: int = 0
    """Rows of the embedding (and output) matrix: 0 = the tokenizer's ids, or, when checkpoint.initial_load_path is a
    Hugging Face folder, its config.json's vocab_size (published vocabularies are padded past the tokenizer's ids:
    Qwen3's 151,936 rows for 151,669 ids). Set it to train from scratch with a padded vocabulary; the rows past the
    tokenizer's ids are never a target."""

    def validate(self) -> None:
        """The names are checked against their registries when the trainer starts (the registries import torch and
        the model families)."""
        _at_least("model", 0, vocab_size=self.vocab_size)


@dataclass
class MuonConfig:
    """[optimizer.muon]: the Muon half of "dmuon" and "muon_naive" (the same update rule in both). Each key is the
    field of the same name of the library's `dmuon.MuonOptions` (titan_dmuon/dmuon/options.py), whose docstrings
    document them in full and whose checks `validate()` runs; the defaults here are the framework's own choices (an
    AdamW-sized lr with "match_rms_adamw", no Muon weight decay, Polar Express), where the library's are
    torch.optim.Muon's.
    """

    lr: float = 0.02
    """Muon learning rate, before adjust_lr_fn's shape scaling and the lr schedule (MuonOptions.lr)."""
    momentum: float = 0.95
    """Muon momentum, the EMA factor of the gradient buffer, in [0, 1) (MuonOptions.momentum)."""
    nesterov: bool = True
    """Use Nesterov momentum for Muon (MuonOptions.nesterov)."""
    weight_decay: float = 0.0
    """Decoupled weight decay of the Muon params (MuonOptions.weight_decay)."""
    ns_steps: int = 5
    """Newton-Schulz iterations that orthogonalize the Muon update, 1 to 99 (MuonOptions.ns_steps)."""
    ns_coefficients: Literal["polar_express", "muon"] = "polar_express"
    """Newton-Schulz coefficients: "polar_express" (one optimal triple per iteration) or "muon" (Keller Jordan's
    (3.4445, -4.775, 2.0315) repeated, torch.optim.Muon's) (MuonOptions.ns_coefficients)."""
    eps: float = 1e-7
    """Floor of the norm Newton-Schulz divides the update by (MuonOptions.eps)."""
    adjust_lr_fn: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """Muon lr shape scaling: "match_rms_adamw" (0.2*sqrt(max(rows, cols)): Muon takes AdamW-sized lrs, the framework's
    default) or "original" (sqrt(max(1, rows/cols)), torch.optim.Muon's and the library's default)
    (MuonOptions.adjust_lr_fn).
    """
    ns_dtype: Literal["", "float32", "bfloat16"] = ""
    """Newton-Schulz precision; empty = the library's default for the device: bfloat16 on CUDA and on CPUs with
    native bf16 matmuls, float32 elsewhere (MuonOptions.ns_dtype).
    """
    ns_formulation: Literal["direct", "gram"] = "direct"
    """Newton-Schulz formulation: "direct" (torch.optim.Muon's iteration) or "gram" (on the short-side Gram matrix:
    fewer FLOPs for rectangular matrices) (MuonOptions.ns_formulation).
    """
    kernel: Literal["auto", "triton", "torch"] = "auto"
    """Who runs Newton-Schulz's symmetric products: "auto" (Triton on CUDA when it passes a one-time check, else
    torch; DMUON_NS_KERNEL overrides it), "triton" or "torch" (MuonOptions.kernel).
    """
    per_head: bool = False
    """Per-head Muon: orthogonalize wq/wk/wv one attention head at a time (the family's head blocks, ModelSpec.
    head_blocks), each head's lr scaled by its own shape; a family without head blocks is a config error. Under TP
    the heads stay on their TP rank: no TP gather/scatter for them (MuonOptions.per_head; docs/dmuon.md).
    """
    per_head_wo: bool = False
    """With per_head, also orthogonalize the attention output projection wo per head (its input-dim column blocks)
    (MuonOptions.per_head_wo).
    """
    qk_clip_tau: float = 0.0
    """QK-clip (MuonClip): after each optimizer step, every attention head whose largest logit q·k/sqrt(head_dim)
    of the step exceeded this gets its query/key weights (or QK-norm gains) scaled down to it; 0 = off, Kimi K2
    used 100. Also applies with optimizer.name = "adamw". Logs attn/max_logit and attn/clipped_heads
    (MuonOptions.qk_clip_tau; docs/training.md, "QK-clip").
    """

    def to_options(self):
        """This table as the library's `dmuon.MuonOptions` (the one conversion: the component builds its optimizer
        from it). Imports the library (torch). ConfigError "optimizer.muon.<field> ..." for an invalid value."""
        import dataclasses

        from titan_dmuon import dmuon

        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values["ns_dtype"] = values["ns_dtype"] or None  # "" = the device's default
        try:
            return dmuon.MuonOptions(**values)
        except dmuon.OptionError as e:
            raise ConfigError(f"optimizer.muon.{e.field} {e.problem}") from None

    def validate(self) -> None:
        """MuonOptions' own checks, reported under optimizer.muon.<field>."""
        self.to_options()


@dataclass
class AdamWConfig:
    """[optimizer.adamw]: AdamW for the params Muon does not take (all of them for name = "adamw")."""

    lr: float = 1e-3
    """AdamW learning rate: of the non-Muon params (embeddings, norms, output), or of every param for "adamw"."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""

    def validate(self) -> None:
        for key in ("lr", "eps", "weight_decay"):
            value = getattr(self, key)
            require(value >= 0, f"optimizer.adamw.{key} must be >= 0, got {value}")
        require(all(0 <= b < 1 for b in self.betas), f"optimizer.adamw.betas must be in [0, 1), got {self.betas}")


@dataclass
class DMuonConfig:
    """[optimizer.dmuon]: how DMuon distributes the Muon matrices (used by name = "dmuon" only)."""

    reshard_after_forward: bool = True
    """Free the gathered dedicated params after forward and broadcast them again for backward (DMuon-Z3); false keeps
    them from forward to backward (DMuon-Z2: one broadcast per step, more memory).
    """
    replicate_async: bool = True
    """With HSDP, publish the updated dedicated params over the replicate axis asynchronously (overlapped with the
    next forward) instead of before the step returns.
    """
    tp_distributed_gram: bool = False
    """With tensor parallelism, compute the Newton-Schulz Gram matrix across the TP ranks instead of gathering the full
    matrix on the TP owner (for the matrices tp_distributed_gram_policy picks).
    """
    tp_distributed_gram_policy: Literal["beneficial", "always", "never"] = "beneficial"
    """With tp_distributed_gram, which TP matrices that can take the Gram path (the whole matrix TP-split on its long
    side) take it, decided per matrix: "beneficial" those whose Gram all-reduces move fewer bytes than gathering and
    scattering the full update (long side > (1 + Gram restarts) x short side: 2x for Polar Express at 5 steps, 3x
    for "muon"); "always" every one; "never" none (docs/dmuon.md, "tp_distributed_gram"). The start-up log prints
    each matrix's path and why.
    """
    tp_gather: Literal["backward", "step"] = "backward"
    """With tensor parallelism, when a TP matrix is gathered onto its TP owner for Newton-Schulz: "backward" gathers
    its reduced gradient from the backward that completes it (beside the rest of the backward), with its momentum
    kept whole on the TP owner; "step" gathers the momentum-applied update inside the optimizer step, with the
    momentum on the TP shards (docs/dmuon.md, "The TP gather"). Checkpoints of either load into the other.
    """


@dataclass
class Optimizer:
    name: str = "dmuon"
    """Optimizer component (titan_dmuon/components/optimizer/): "dmuon" = Muon on the muon_params matrices, each
    updated by one owner rank, AdamW on the rest; "muon_naive" = the same update with every matrix FSDP2-sharded, its
    grad all-gathered and Newton-Schulz run on every rank (the baseline); "adamw" = AdamW on every param.
    """
    muon_params: str = ""
    """Regex over parameter FQNs (as in model.named_parameters()) selecting the Muon params: 2D matrices and 3D expert
    stacks (each expert's matrix orthogonalized on its own); the others use AdamW. Empty = the model family's default
    (its block matrices and expert stacks).
    """
    muon: MuonConfig = field(default_factory=MuonConfig)
    """Muon settings, for "dmuon" and "muon_naive"."""
    adamw: AdamWConfig = field(default_factory=AdamWConfig)
    """AdamW settings, for every optimizer."""
    dmuon: DMuonConfig = field(default_factory=DMuonConfig)
    """DMuon's distribution settings, for "dmuon"."""

    def validate(self) -> None:
        """muon_params compiles; then [optimizer.muon] and [optimizer.adamw] (their own `validate()`)."""
        import re

        try:
            re.compile(self.muon_params)
        except re.error as e:
            raise ConfigError(f"optimizer.muon_params is not a valid regex ({e}): {self.muon_params!r}") from None
        self.muon.validate()
        self.adamw.validate()


@dataclass
class LRScheduler:
    warmup_steps: int = 200
    """Steps of linear warmup; the factor goes (step+1)/(warmup_steps+1), so it starts near 0, not at 0."""
    decay_ratio: float | None = None
    """Fraction of training.steps spent decaying at the end; the steps between warmup and decay keep the full lr. Unset
    (None) decays over every step after warmup.
    """
    decay_type: Literal["linear", "cosine", "sqrt"] = "linear"
    """Decay shape: linear, cosine (half period) or sqrt (1 - sqrt(progress))."""
    min_lr_factor: float = 0.0
    """The decay ends at lr * min_lr_factor."""

    def validate(self) -> None:
        _at_least("lr_scheduler", 0, warmup_steps=self.warmup_steps)
        require(
            self.decay_ratio is None or 0 <= self.decay_ratio <= 1,
            f"lr_scheduler.decay_ratio must be in [0, 1] or unset, got {self.decay_ratio}",
        )
        require(0 <= self.min_lr_factor <= 1, f"lr_scheduler.min_lr_factor must be in [0, 1], got {self.min_lr_factor}")


@dataclass
class Training:
    local_batch_size: int = 8
    """Sequences per data-parallel rank per micro-batch."""
    seq_len: int = 2048
    """Tokens per sequence."""
    steps: int = 10000
    """Optimizer steps to train for."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged)."""
    gradient_accumulation_steps: int = 1
    """Micro-batches whose gradients are summed before each optimizer step."""
    mixed_precision_param: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the params in forward/backward (FSDP2 MixedPrecisionPolicy param_dtype); master weights stay float32."""
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the gradient reduction (FSDP2 MixedPrecisionPolicy reduce_dtype)."""
    seed: int | None = None
    """Random seed for model init and data order; unset = nondeterministic."""
    deterministic: bool = False
    """Use deterministic algorithms (slower), for bit-reproducible runs."""
    dataset: Literal["stdlib", "text", "jsonl", "parquet", "tokens"] = "stdlib"
    """Dataset kind: "tokens" = the folder scripts/prepare_data.py wrote (pre-tokenized shards, memory-mapped: for
    corpora of any size); "stdlib" = the embedded default corpus (Python standard library sources, works offline);
    "text", "jsonl", "parquet": raw files at dataset_path, tokenized while training (small corpora).
    """
    dataset_path: str = ""
    """File, folder or glob (quoted) of the dataset files; for "tokens" the prepared folder (unused for "stdlib")."""
    dataset_field: str = "text"
    """Field holding the text in JSONL records and parquet columns."""
    text_documents: Literal["blank_line", "file"] = "blank_line"
    """How "text" files split into documents: "blank_line" = each run of non-blank lines (so one file can be split for
    validation), "file" = each file whole.
    """
    num_workers: int = 0
    """DataLoader worker processes per rank that read, tokenize and pack ahead of the training step (0 = in the
    training process). A resumed loader state needs the same value.
    """

    def validate(self) -> None:
        _at_least(
            "training",
            1,
            local_batch_size=self.local_batch_size,
            seq_len=self.seq_len,
            steps=self.steps,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
        )
        _at_least("training", 0, max_norm=self.max_norm)
        require(
            self.dataset == "stdlib" or bool(self.dataset_path),
            f"training.dataset_path is required for training.dataset = {self.dataset!r}",
        )


PIPELINE_SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
"""torch.distributed.pipelining's schedules, by the names its get_schedule_class takes."""


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int | Literal["nodes"] = 1
    """Replicas of the model (the HSDP replicate axis; DDP when the shard degree is 1). "nodes" = one replica per node
    (the number of nodes: torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE), so each shard group stays inside a node and each
    replicate group spans the nodes; it needs shard x tp = ranks per node, and start-up checks it on the real hosts.
    """
    data_parallel_shard_degree: int = -1
    """Ranks one replica is sharded over (FSDP2 / DMuon ownership); -1 = world_size // (replicate * tp)."""
    tensor_parallel_degree: int = 1
    """Tensor-parallel degree (the innermost mesh axis)."""
    expert_parallel_degree: int = 1
    """Expert parallelism (MoE models): the experts are split over this many ranks, borrowed from the shard axis
    (it must divide data_parallel_shard_degree), and tokens travel to their experts by all-to-all. Dense params
    keep the whole shard axis; each expert shard is data-parallel over the remaining shard ranks (x TP ranks, x
    replicas). 1 = every rank holds every expert."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """FSDP2 reshard_after_forward: "default" reshards every block unit but not the root (its params are needed
    again at the start of backward), "always" reshards all, "never" keeps them gathered (ZeRO-2). Under dmuon the
    blocks are no FSDP2 units (their matrices are DMuon's; the norms join the root), so this sets only the root's.
    """
    disable_loss_parallel: bool = False
    """Under TP the output projection keeps its logits sharded over the vocabulary and the cross-entropy runs over
    the TP group (loss parallelism: no replicated [tokens, vocab] logits on every TP rank); true gathers the logits
    and computes the loss on each TP rank instead. No effect without TP.
    """

    pipeline_parallel_degree: int = 1
    """Pipeline stages' rank groups (the outermost mesh axis: pp x replicate x shard x tp = the world size); 1 = no
    pipeline. Each pp rank holds one stage of the model (two or more under a looped or V schedule) with its own
    TP, DMuon owners and FSDP2 shards over the replicate x shard x tp ranks of that stage (docs/training.md,
    "Pipeline parallelism")."""
    pipeline_parallel_schedule: str = "1F1B"
    """The schedule of torch.distributed.pipelining: GPipe, 1F1B (one stage per rank), Interleaved1F1B, LoopedBFS,
    InterleavedZeroBubble (several stages per rank, looped), ZBVZeroBubble, DualPipeV (two stages per rank, in a V:
    the first and the last stage on pp rank 0)."""
    pipeline_parallel_microbatch_size: int = 1
    """Rows per microbatch. A step's local_batch_size x gradient_accumulation_steps rows are its microbatches (the
    accumulation runs as more microbatches of one schedule step), so their number is that over this size."""
    pipeline_parallel_layers_per_stage: int = 0
    """Transformer blocks per stage (the embedding and the head count as one block each); 0 = one stage per rank
    (two per rank under a multi-stage schedule), the blocks, the embedding and the head balanced over them."""
    module_fqns_per_model_part: str = ""
    """An explicit split instead: the modules of each stage in order, stages separated by ';' and modules by ','
    (e.g. "tok_embeddings,layers.0,layers.1;layers.2,layers.3,norm,output"); each block exactly once."""

    def validate(self) -> None:
        """The degrees alone; whether they fit the world size is `validate_parallelism`'s (at launch)."""
        _at_least(
            "parallelism",
            1,
            tensor_parallel_degree=self.tensor_parallel_degree,
            expert_parallel_degree=self.expert_parallel_degree,
            pipeline_parallel_degree=self.pipeline_parallel_degree,
            pipeline_parallel_microbatch_size=self.pipeline_parallel_microbatch_size,
        )
        _at_least("parallelism", 0, pipeline_parallel_layers_per_stage=self.pipeline_parallel_layers_per_stage)
        require(
            self.pipeline_parallel_schedule in PIPELINE_SCHEDULES,
            f"parallelism.pipeline_parallel_schedule = {self.pipeline_parallel_schedule!r} is not a schedule: one of "
            + ", ".join(PIPELINE_SCHEDULES),
        )
        replicate = self.data_parallel_replicate_degree
        require(
            replicate == "nodes" or replicate >= 1,
            f'parallelism.data_parallel_replicate_degree must be >= 1 or "nodes", got {replicate}',
        )
        require(
            self.data_parallel_shard_degree == -1 or self.data_parallel_shard_degree >= 1,
            f"parallelism.data_parallel_shard_degree must be -1 or >= 1, got {self.data_parallel_shard_degree}",
        )


@dataclass
class Comm:
    """[comm]: process-group timeouts and the heartbeat, so a dead or hung rank ends the job instead of holding it."""

    init_timeout_seconds: int = 300
    """Timeout of every collective from process-group creation to the end of the first training step (rendezvous,
    mesh, weight init, the first step with its compile): a rank that does not join within it ends the job.
    """
    train_timeout_seconds: int = 100
    """Timeout of every collective after the first step (torch's default: 30 min on gloo, 10 on NCCL): a dead or hung
    rank ends the job after this long. Raise it when validation keeps some ranks out of collectives for longer
    (checkpoint saves and loads are bounded by checkpoint.timeout_seconds instead).
    """
    heartbeat_seconds: float = 5.0
    """Interval of each rank's heartbeat (a counter in the rendezvous store). Ranks 0 and world-1 watch the others and
    name, with its host, a rank that missed 3 in a row (dead, stopped or hung), also in their error when a collective
    fails. 0 turns it off.
    """

    def validate(self) -> None:
        _at_least(
            "comm", 1, init_timeout_seconds=self.init_timeout_seconds, train_timeout_seconds=self.train_timeout_seconds
        )
        require(self.heartbeat_seconds >= 0, f"comm.heartbeat_seconds must be >= 0, got {self.heartbeat_seconds}")


@dataclass
class Checkpoint:
    """[checkpoint]: sharded DCP checkpoints (titan_dmuon/components/checkpoint/); train.py resumes from the newest
    one."""

    enable: bool = False
    """Save checkpoints every `interval` steps and at the last step, and resume from the newest complete one in
    `folder` at start-up.
    """
    folder: str = "checkpoint"
    """Folder of the checkpoints, under job.dump_folder: one sub-folder step-<N> per checkpoint (torch DCP format)."""
    interval: int = 500
    """Save every this many steps (and at the last step)."""
    keep_latest_k: int = 0
    """Keep only the newest k complete checkpoints (older ones are deleted after a new one is complete); 0 keeps all."""
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """How saving overlaps training. "disabled": training waits for the save; "async": a copy of the state is
    written by a background thread while training goes on (committed when done, at the latest before the next save
    and at the end); "async_with_pinned_mem": the same, copying to pinned host memory (CUDA only).
    """
    load_step: int = -1
    """The step to resume from; -1 = the newest complete checkpoint in folder (none: start from scratch)."""
    initial_load_path: str = ""
    """Where to start from when folder holds no checkpoint: a DCP checkpoint folder (a step-<N> folder) or a Hugging
    Face folder (config.json + *.safetensors, weights only). Empty = from the seeded initialization.
    """
    initial_load_model_only: bool = True
    """Load only the model weights from initial_load_path (not the optimizer, schedule, data position, step)."""
    last_save_model_only: bool = False
    """Make the last step's checkpoint model weights only (in export_dtype): smaller, for evaluation or export, but
    not resumable with the optimizer state.
    """
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the weights of a model-only last checkpoint (last_save_model_only); full checkpoints stay float32."""
    last_save_in_hf: bool = False
    """After the last step's checkpoint is saved, rank 0 also writes it as a Hugging Face folder `step-<N>-hf` beside
    it (safetensors in export_dtype, config.json, the run's tokenizer, generation_config.json): what
    scripts/convert_checkpoint.py writes from `step-<N>`. Needs `enable` and a model family with an HF adapter.
    """
    timeout_seconds: int = 1800
    """Timeout of every collective of a save or a load (instead of comm.train_timeout_seconds): a rank may wait this
    long for a peer still writing its files, or for rank 0 committing (fsync, rename, deleting old checkpoints).
    """

    def validate(self) -> None:
        """The ranges and the folder; whether this machine can pin memory for async_with_pinned_mem is checked
        where the checkpointer is built (components/checkpoint/manager.py)."""
        require(self.interval >= 1, f"checkpoint.interval must be >= 1, got {self.interval}")
        require(
            self.keep_latest_k >= 0,
            f"checkpoint.keep_latest_k must be >= 0 (0 keeps every checkpoint), got {self.keep_latest_k}",
        )
        require(self.timeout_seconds >= 1, f"checkpoint.timeout_seconds must be >= 1, got {self.timeout_seconds}")
        require(
            self.load_step >= -1,
            f"checkpoint.load_step must be -1 (the newest) or a step >= 0, got {self.load_step}",
        )
        require(
            bool(self.folder) and not os.path.isabs(self.folder) and ".." not in Path(self.folder).parts,
            f"checkpoint.folder must be a relative folder under job.dump_folder, got {self.folder!r}",
        )
        require(
            self.enable or not self.last_save_in_hf,
            "checkpoint.last_save_in_hf converts the last checkpoint: it needs checkpoint.enable = true",
        )


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "selective", "full"] = "none"
    """Activation checkpointing of the transformer blocks (recomputed in backward, docs/training.md says what each
    mode keeps): "none"; "full" (every block keeps only its input); "selective", as `selective_ac_option` says.
    """
    selective_ac_option: str = "2"
    """Under mode "selective": "op" checkpoints every block but keeps the outputs of its expensive ops (attention,
    every other matmul), recomputing the cheap ones (norms, activations, the other matmuls); an integer n checkpoints
    every n-th block whole (blocks 0, n, 2n, ...; "1" is "full"), the others keep everything.
    """

    def validate(self) -> None:
        """Also what `parallelize.ac_plan` asks of a mode and option given to it directly."""
        require(
            self.mode in ("none", "selective", "full"),
            f"activation_checkpoint.mode must be 'none', 'selective' or 'full', got {self.mode!r}",
        )
        option = self.selective_ac_option
        require(
            option == "op" or (option.isdecimal() and option.isascii() and int(option) >= 1),
            f"activation_checkpoint.selective_ac_option must be 'op' or a positive integer n (every n-th block), got "
            f"{option!r}",
        )


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each transformer block."""

    def validate(self) -> None:
        """A switch: nothing to check."""


@dataclass
class Metrics:
    log_freq: int = 10
    """Log metrics every this many steps."""
    enable_tensorboard: bool = True
    """Write TensorBoard events (rank 0)."""
    save_tb_folder: str = "tb"
    """TensorBoard folder, under job.dump_folder."""
    enable_wandb: bool = False
    """Also log the scalars to Weights & Biases (rank 0; files under job.dump_folder/wandb, or $WANDB_DIR/wandb).
    Needs the wandb extra: pip install 'titan_dmuon[wandb]'. Offline: WANDB_MODE=offline, then `wandb sync`."""
    wandb_project: str = ""
    """W&B project ("" = $WANDB_PROJECT, else "titan_dmuon")."""
    wandb_run_name: str = ""
    """W&B run's display name ("" = $WANDB_NAME, else one W&B makes up)."""
    wandb_entity: str = ""
    """W&B entity, a user or team ("" = $WANDB_ENTITY, else the logged-in user's default entity)."""
    log_max_logit: bool = False
    """Measure every attention head's largest logit in the training forwards and log attn/max_logit (the largest)
    and attn/max_logit/<layer> without clipping (optimizer.muon.qk_clip_tau logs them anyway). Costs an extra
    q·k pass per attention layer (docs/training.md, "QK-clip")."""

    def validate(self) -> None:
        _at_least("metrics", 1, log_freq=self.log_freq)


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Record a torch.profiler trace every profile_freq steps."""
    profile_freq: int = 100
    """Steps between traces; the trace covers the last step of each period."""
    save_traces_folder: str = "profile_traces"
    """Trace folder, under job.dump_folder (iteration_<step>/rank<r>_trace.json)."""
    enable_memory_snapshot: bool = False
    """Record CUDA memory history and dump a snapshot every profile_freq steps (CUDA only)."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Memory snapshot folder, under job.dump_folder."""

    def validate(self) -> None:
        _at_least("profiling", 1, profile_freq=self.profile_freq)


@dataclass
class Validation:
    enable: bool = False
    """Evaluate the loss on held-out data during training."""
    freq: int = 100
    """Validate every this many steps."""
    steps: int = 10
    """Batches per validation."""
    dataset: Literal["", "stdlib", "text", "jsonl", "parquet", "tokens"] = ""
    """Empty = a held-out split of the training dataset; else a dataset kind as in training.dataset."""
    dataset_path: str = ""
    """Files of the validation dataset when dataset is set ("" = training.dataset_path)."""

    def validate(self) -> None:
        """Its own ranges; whether a dataset path is given (here or in [training]) is `validate_config`'s."""
        _at_least("validation", 1, freq=self.freq, steps=self.steps)

    def own_dataset(self, training: Training) -> tuple[str, str] | None:
        """(kind, path) of a validation dataset of its own, its path defaulting to training.dataset_path; None when
        validation reads a held-out split of the training data. The one statement of that rule: the loaders, the
        config check and the launch's path check read it here."""
        return (self.dataset, self.dataset_path or training.dataset_path) if self.dataset else None


@dataclass
class JobConfig:
    """titan_dmuon training. Load a TOML file with --config PATH; --section.field flags override it."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    comm: Comm = field(default_factory=Comm)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    validation: Validation = field(default_factory=Validation)
