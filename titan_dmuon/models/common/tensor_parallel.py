"""The tensor-parallel plan of the decoder families (torchtitan's, by FQN), read off the model's structure. No
DMuon or FSDP code here.

Attention/FFN input projections are column-parallel and output projections row-parallel, so each rank holds
``n_heads // tp`` query heads and ``n_kv_heads // tp`` kv heads; attention infers its local head count from the
projection width. With ``sequence_parallel`` the activations between blocks, the norms and the residual stream are
sharded along the sequence dim (``Shard(1)``), so the sequence length must divide by the TP degree. What a family's
modules add to the plan:

  * q_norm / k_norm (Qwen3). They normalize each head over head_dim with a weight of head_dim entries, and after
    the column-parallel wq / wk each rank holds its own heads: the norm is a replicated weight applied to the local
    heads. Its grad differs per rank (each sees other heads), so it must be summed over the TP group: the plan
    makes the weight a Replicate DTensor and the norm's input the local heads as a DTensor sharded on the heads
    dim (`SequenceParallel(sequence_dim=2)`: [B, L, heads, head_dim] sharded on dim 2), so the weight's grad
    comes out partial over TP and is reduced as any sequence-parallel norm's; the norm's output is handed back as
    a plain local tensor. The same in both plans (with or without sequence parallelism between blocks: the heads
    are local either way).
  * Tied embeddings. The embedding (row-wise parallel) and the output (column-wise parallel) both shard their
    [vocab, dim] weight on dim 0, the vocabulary: each TP rank holds the same vocab rows of both. Sharding makes
    one DTensor per module, so the plan ties them again to the embedding's (one Parameter, Shard(0) over TP);
    FSDP2 then shards that one Parameter's rows again over the data-parallel ranks (a _StridedShard over TP).
  * MoE feed-forwards (moe.py): the attention is sharded as above; the MoE is not split over TP. With sequence
    parallelism each TP rank runs the MoE on its own chunk of the sequence: the module gets the local chunk (the
    local tensor of ffn_norm's `Shard(1)` DTensor) and returns that chunk's output, a plain tensor, as the
    row-parallel wo and w2 return their `Shard(1)` output (the residual stream between the norms is the local
    chunk). The experts stay plain tensors, whole on every TP rank (their grads, from different tokens per rank,
    are the optimizer's to sum over TP). The router's gate becomes a Replicate DTensor applied to the local tokens
    as a DTensor sharded on the token dim (`SequenceParallel(sequence_dim=0)` on its [tokens, dim] input), so its
    grad comes out partial over TP and is summed like a sequence-parallel norm's; and the MoE's `aux_group` is the
    TP group, over which the aux loss sums its expert counts (the ranks' shares add up to the aux loss of the
    group's whole sequence). Without sequence parallelism (generation) every rank holds the whole sequence and runs
    the MoE as one process would.

  * Multi-head latent attention (mla.py, DeepSeek-V3): `mla_attention_plan`. Each rank its heads (the query and
    key/value up-projections column-parallel, `wo` row-parallel); the low-rank down projections and their norms
    whole on every rank, on the whole sequence; the shared rotary key's grad summed over TP.
  * Shared experts (DeepSeekMoE): a SwiGLU beside the routed experts, sharded as a dense one; under sequence
    parallelism it gathers the MoE's chunks and scatters its output back to them.
"""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from .mla import MLAttention
from .moe import MoE

logger = logging.getLogger(__name__)

Plan = dict[str, ParallelStyle]

# q_norm / k_norm: a replicated weight on the local heads ([B, L, heads, head_dim], heads sharded over TP)
_HEAD_NORM = SequenceParallel(sequence_dim=2, use_local_output=True)
# an MoE under sequence parallelism: its own chunk of the sequence in (ffn_norm's Shard(1) DTensor, as the local
# tensor); its output, that chunk's, joins the residual stream as a plain local tensor, as wo's and w2's do
_MOE_CHUNK = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True)
# the router's gate: a replicated weight on the local tokens ([tokens, dim], tokens sharded over TP)
_ROUTER_GATE = SequenceParallel(sequence_dim=0, use_local_output=True)


def gqa_attention_plan(attention: nn.Module, sequence_parallel: bool) -> Plan:
    """Grouped-query attention (attention.py), FQNs relative to the block: column-parallel wq wk wv, the q/k norms
    (if any) on the local heads, row-parallel wo (its output back to sequence shards under sequence parallelism)."""
    plan: Plan = {}
    if sequence_parallel:
        plan["attention"] = PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        )
    plan.update({f"attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")})
    if getattr(attention, "q_norm", None) is not None:
        plan.update({"attention.q_norm": _HEAD_NORM, "attention.k_norm": _HEAD_NORM})
    plan["attention.wo"] = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
    return plan


class _SumGradOverTP(ParallelStyle):
    """Identity forward on a tensor every TP rank holds whole; its grad summed over the TP group in backward (the
    tensor met only this rank's heads). MLA's shared rotary key."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(_module, _inputs, output):
            held = DTensor.from_local(output, device_mesh, (Replicate(),), run_check=False)
            return held.to_local(grad_placements=(Partial(),))  # backward: Partial -> Replicate, an all-reduce

        module.register_forward_hook(hook)
        return module


def mla_attention_plan(attention: nn.Module, sequence_parallel: bool) -> Plan:
    """Multi-head latent attention (mla.py), FQNs relative to the block. Each rank its heads: column-parallel
    query projection (`wq` or `wq_b`) and key/value up-projection `wkv_b`, row-parallel `wo`. The down projections
    (`wq_a`, `wkv_a`) and their norms stay plain, whole on every rank, fed the whole sequence (a plain tensor: under
    sequence parallelism the attention's input is gathered): their grads come out the same on every TP rank, since
    the column-parallel inputs sum theirs over TP and `rope_key` sums the shared rotary key's."""
    plan: Plan = {}
    if sequence_parallel:
        plan["attention"] = PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None), use_local_output=True
        )
    plan[f"attention.{attention.q_proj}"] = ColwiseParallel()
    plan["attention.wkv_b"] = ColwiseParallel()
    plan["attention.rope_key"] = _SumGradOverTP()
    plan["attention.wo"] = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
    return plan


def attention_plan(attention: nn.Module, sequence_parallel: bool) -> Plan:
    """The attention's plan by its kind: MLA's or grouped-query attention's."""
    if isinstance(attention, MLAttention):
        return mla_attention_plan(attention, sequence_parallel)
    return gqa_attention_plan(attention, sequence_parallel)


def swiglu_plan(prefix: str, sequence_parallel: bool) -> Plan:
    """A SwiGLU at `prefix` (column-parallel w1 w3, row-parallel w2); under sequence parallelism its input is
    gathered from sequence shards and its output reduce-scattered back to them."""
    plan: Plan = {}
    if sequence_parallel:
        plan[prefix] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan[f"{prefix}.w1"] = ColwiseParallel()
    plan[f"{prefix}.w2"] = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
    plan[f"{prefix}.w3"] = ColwiseParallel()
    return plan


def feed_forward_plan(feed_forward: nn.Module, sequence_parallel: bool) -> Plan:
    """A dense SwiGLU, or an MoE (its own sequence chunk, the router's gate on the local tokens; nothing to shard
    without sequence parallelism) whose shared experts, if any, are a SwiGLU over the whole sequence (gathered
    from the chunks and scattered back), FQNs relative to the block."""
    if not isinstance(feed_forward, MoE):
        return swiglu_plan("feed_forward", sequence_parallel)
    plan: Plan = {"feed_forward": _MOE_CHUNK, "feed_forward.router.gate": _ROUTER_GATE} if sequence_parallel else {}
    if feed_forward.shared_experts is not None:
        plan.update(swiglu_plan("feed_forward.shared_experts", sequence_parallel))
    return plan


def block_plan(block: nn.Module, sequence_parallel: bool) -> Plan:
    """One block's plan: under sequence parallelism the norms sharded on the sequence; the attention's (its input
    gathered) and the feed-forward's own."""
    plan: Plan = {"attention_norm": SequenceParallel()} if sequence_parallel else {}
    plan.update(attention_plan(block.attention, sequence_parallel))
    if sequence_parallel:
        plan["ffn_norm"] = SequenceParallel()
    plan.update(feed_forward_plan(block.feed_forward, sequence_parallel))
    return plan


def top_plan(sequence_parallel: bool, loss_parallel: bool) -> Plan:
    """The embedding (row-parallel), the final norm and the output head (column-parallel; with ``loss_parallel`` its
    logits stay a DTensor sharded on the vocabulary, else a plain replicated tensor)."""
    output_layouts, use_local_output = (Shard(-1), False) if loss_parallel else (Replicate(), True)
    if sequence_parallel:
        return {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(
                input_layouts=Shard(1), output_layouts=output_layouts, use_local_output=use_local_output
            ),
        }
    # Activations stay replicated between blocks; the block norms remain plain (replicated) parameters.
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(
            input_layouts=Replicate(), output_layouts=output_layouts, use_local_output=use_local_output
        ),
    }


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool = True,
    loss_parallel: bool = True,
) -> nn.Module:
    """Shard ``model`` (a `decoder.Decoder`) over the 1D ``tp_mesh`` in place and return it (see the module
    docstring). With ``loss_parallel`` the model returns a DTensor ``[B, L, vocab_size]`` placed ``Shard(-1)`` on
    ``tp_mesh`` (each rank computes only its ``vocab_size // tp`` columns), for a cross-entropy run inside
    ``torch.distributed.tensor.parallel.loss_parallel()`` (the trainer's ``_loss``); without it the logits come
    back as a plain, replicated tensor (generation uses ``sequence_parallel=False, loss_parallel=False``). A tied
    embedding/output stays one Parameter. ValueError when the heads do not divide by the degree."""
    tp = tp_mesh.size()
    args = model.args
    for name, heads in (("n_heads", args.n_heads), ("n_kv_heads", args.kv_heads)):
        if heads % tp:
            raise ValueError(f"{name} ({heads}) must be divisible by the tensor-parallel degree ({tp})")

    # A pipeline stage holds some of the embedding, the final norm and the head (absent ones are None).
    plan = {k: v for k, v in top_plan(sequence_parallel, loss_parallel).items() if getattr(model, k) is not None}
    parallelize_module(model, tp_mesh, plan)
    if model.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        # Both modules sharded their [vocab, dim] weight the same way (Shard(0)): hold the embedding's in both.
        emb, out = model.tok_embeddings.weight, model.output.weight
        if emb.placements != out.placements or emb.shape != out.shape:
            raise RuntimeError(f"tied weight sharded differently: {emb.placements} vs {out.placements}")
        model.output.weight = emb
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan(block, sequence_parallel))
        block.attention.tp_rank, block.attention.tp_size = tp_mesh.get_local_rank(), tp  # its heads' place (QK-clip)
        if isinstance(block.feed_forward, MoE) and sequence_parallel:
            block.feed_forward.aux_group = tp_mesh.get_group()
    logger.info(
        "Applied tensor parallel (degree %d, sequence_parallel=%s, loss_parallel=%s)",
        tp,
        sequence_parallel,
        loss_parallel,
    )
    return model


__all__ = [
    "Plan",
    "apply_tp",
    "attention_plan",
    "block_plan",
    "feed_forward_plan",
    "gqa_attention_plan",
    "mla_attention_plan",
    "swiglu_plan",
    "top_plan",
]
