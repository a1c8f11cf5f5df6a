"""Dry-run planner: what a run costs on a cluster you do not have, from this CPU.

    python train.py --config train_configs/llama3_70b.toml --job.dry_run --job.dry_run_world_size 256 \\
        --parallelism.data_parallel_replicate_degree 4 --parallelism.tensor_parallel_degree 1

It builds the real model and the real placement with the trainer's own code (build_meta_model, then
`parallelize`: TP -> AC -> compile -> DMuon's dedicate_params -> FSDP2) on meta tensors, as rank 0 of torch's
fake process group of `job.dry_run_world_size` ranks (collectives are no-ops; nothing is allocated). Every other
rank's figures follow from that one build, exactly: DMuon's LPT plan is global and the same on every rank (owner
coordinates, TP owners), and a rank's FSDP2 / TP shard shapes are torch.chunk's arithmetic evaluated at its mesh
coordinate (memory.py). Rank g sits at the coordinates `ParallelDims.coordinates` gives it (row-major over
(replicate, shard, tp)), on node g // job.dry_run_gpus_per_node (as torchrun numbers ranks); `--job.dry_run_nodes
M` plans M nodes of that many GPUs and the plan starts with the node layout the run's start-up log will show
(titan_dmuon/parallel/layout.py).

Expert parallelism (`parallelism.expert_parallel_degree` = E, MoE models): the shard coordinate splits into efsdp
x ep (N / E x E), the dense matrices' shard axis unchanged. Each rank holds its EP shard of every expert stack
(P_E / E elements); DMuon owns the stacks over the expert axes (its `expert_mesh`: the G_e = N / E x T ranks of an
expert shard group, coordinate efsdp x T + tp, replicate as the dense matrices, "tp" the EP index), so an owner's
fp32 masters, momentum and reduced grad of a stack are its EP shard's, on the EP ranks of its expert column; its
ledger kinds (broadcast, reduce, replicate_*) are over G_e, not N, and land in the same kinds; its NS runs on each
of its owner's E EP ranks (their own experts, no TP gather or scatter). The MoE layers' token all-to-all is printed
apart (`expert_parallel.all_to_all_bytes`, uniform routing: it is the model's, the same under every optimizer); the
naive FSDP2 + Muon and FSDP2 + AdamW figures shard the stacks over the G_e ranks of the expert FSDP mesh, as
`apply_fsdp` does.

Printed (and written to `job.dry_run_json`, with every rank's value): per-rank resident bytes (FSDP2 shards,
DMuon fp32 masters, Muon momentum, AdamW moments, gradients), the DMuon packed-buffer transient peak and an
activation estimate; the LPT plan (Newton-Schulz FLOPs per rank against a certified lower bound, owners per
layer) and the owners' NS time at a given TFLOP/s; DMuon's bytes per step by ledger kind (the figures
`dmuon.comm_stats` reports on a real run, next to the docs/dmuon.md formulas) and, on the same mesh, naive
FSDP2 + Muon and FSDP2 + AdamW; with MoE layers, their all-to-all bytes per rank.

DMuon's figures are the library's public cost model (`dmuon.costs`: per-matrix ledger shares, Newton-Schulz FLOPs,
the TP path of each matrix) summed over the model's dedicated matrices (`dmuon.dedicated_matrices`); the ranks'
coordinates are ParallelDims' own. Modules: plan.py (build on the fake world, plan, the dry run), memory.py,
lpt.py, communication.py (bytes per step), report.py (the printed plan).
"""

from .memory import Placement, plan_memory
from .plan import _vocab_size as _vocab_size  # where tests/integration/test_hf_assets.py imports it from
from .plan import build_on_fake_world, check_device_memory, dry_run, plan, tp_alternatives
from .report import format_capacity, format_plan

__all__ = [
    "Placement",
    "build_on_fake_world",
    "check_device_memory",
    "dry_run",
    "format_capacity",
    "format_plan",
    "plan",
    "plan_memory",
    "tp_alternatives",
]
