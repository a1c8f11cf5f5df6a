"""Tensor-parallel plan for the Llama-3 model (torchtitan's plan, by FQN). No DMuon or FSDP code here."""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

logger = logging.getLogger(__name__)


def apply_tp(
    model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = True, loss_parallel: bool = True
) -> nn.Module:
    """Shard ``model`` (a ``titan_dmuon.models.llama3.Transformer``) over the 1D ``tp_mesh`` in place and return it.

    Attention/FFN input projections are column-parallel and output projections row-parallel, so each rank
    holds ``n_heads // tp`` query heads and ``n_kv_heads // tp`` kv heads; attention infers its local head
    count from the projection width. With ``sequence_parallel`` the activations between blocks, the norms
    and the residual stream are sharded along the sequence dim (``Shard(1)``), so the sequence length must
    divide by the TP degree.

    With ``loss_parallel`` the output projection keeps its logits sharded over the vocabulary: the model returns
    a DTensor ``[B, L, vocab_size]`` placed ``Shard(-1)`` on ``tp_mesh`` (each rank computes only its
    ``vocab_size // tp`` columns), for a cross-entropy run inside ``torch.distributed.tensor.parallel.
    loss_parallel()`` (the trainer's ``_loss``). Without it the logits come back as a plain, replicated tensor.
    """
    output_layouts, use_local_output = (Shard(-1), False) if loss_parallel else (Replicate(), True)
    tp = tp_mesh.size()
    args = model.args
    for name, heads in (("n_heads", args.n_heads), ("n_kv_heads", args.kv_heads)):
        if heads % tp:
            raise ValueError(f"{name} ({heads}) must be divisible by the tensor-parallel degree ({tp})")

    if sequence_parallel:
        top_plan = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(
                input_layouts=Shard(1), output_layouts=output_layouts, use_local_output=use_local_output
            ),
        }
        block_plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
    else:
        # Activations stay replicated between blocks; norms remain plain (replicated) parameters.
        top_plan = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(
                input_layouts=Replicate(), output_layouts=output_layouts, use_local_output=use_local_output
            ),
        }
        block_plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
        }

    parallelize_module(model, tp_mesh, top_plan)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan)
    logger.info(
        "Applied tensor parallel (degree %d, sequence_parallel=%s, loss_parallel=%s)",
        tp,
        sequence_parallel,
        loss_parallel,
    )
    return model
