"""An estimate of one rank's activation memory for a Llama-3 micro-batch (the dry-run planner prints it and
checks that the plan fits the device).

Counted per token from what this model's autograd graph keeps for backward, in the compute dtype (e bytes per
element) unless said fp32; h = dim, kv = kv heads x head_dim, f = the FFN width, H = heads, V = the vocabulary,
s = the TP degree (TP here always comes with sequence parallelism). `tests/integration/test_activation_estimate.py`
holds the block and head terms against the bytes a real forward leaves for backward (within 10%); the backward
terms (the logits' grads, the recompute) follow from the same counts.

A block without AC keeps, per token:
  * each of its two RMSNorms: the fp32 input (4h), the fp32 1/rms (4) and the normalized value (e h), all split
    over the TP ranks; and the norm's output that the next projections read (e h), all-gathered (not split);
  * attention: SDPA's q (after RoPE), k and v (repeated to h wide for GQA) and output (4 e h), its fp32
    log-sum-exp (4H), split over TP (the kernels torch picks on GPU, flash or memory-efficient, keep the same);
  * SwiGLU: w1 x, silu(w1 x), w3 x and their product (4 e f), split over TP.
A block under full AC keeps only its input (e h / s). Op-level selective AC keeps its input, the SDPA output
and log-sum-exp, and the outputs of every other matmul (wq, wv, w1, w2: the wq/wv/w1 ones split over TP; w2's is
the row-parallel partial sum, full width: its reduce-scatter, like the norms' all-gathers, is recomputed).
A checkpointed block's activations come back in backward while it is recomputed: one block's worth on top.

The head keeps the final norm (as a block's), the fp32 log-softmax of the logits (4V; split over TP under loss
parallelism, whole on every TP rank without it) and the labels (8); at the start of backward the logits' grads
(fp32 and compute dtype, (4 + e) V, split the same way) come on top.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_dmuon.parallel.parallelize import ac_plan

from .model import Transformer


@dataclass(frozen=True)
class ActivationEstimate:
    """Bytes one rank holds for a micro-batch: per-block and head terms, and the peak of its backward."""

    block: float  # a block without AC
    checkpointed_block: float  # what a checkpointed block keeps (0 when no block is checkpointed)
    checkpointed: int  # how many blocks are checkpointed
    layers: int
    head: float  # final norm + loss
    head_backward: float  # the logits' grads at the start of backward
    recompute: float  # a checkpointed block's activations while it is recomputed

    @property
    def blocks(self) -> float:
        return (self.layers - self.checkpointed) * self.block + self.checkpointed * self.checkpointed_block

    @property
    def total(self) -> float:
        """The peak: every block's kept activations, plus the head with its backward's grads (first in backward)
        or, later, one block being recomputed (the head's activations are freed by then)."""
        return self.blocks + max(self.head + self.head_backward, self.recompute)


def norm_bytes(h: int, e: int, tp: int) -> float:
    """An RMSNorm followed by the projections that read it: fp32 input, 1/rms and normalized value (split over
    TP by sequence parallelism), the output the projections read (all-gathered)."""
    return (4 * h + 4 + e * h) / tp + e * h


def activation_estimate(
    model: Transformer,
    *,
    batch: int,
    seq_len: int,
    dtype_bytes: int,
    tp: int = 1,
    ac_mode: str = "none",
    ac_option: str = "2",
    loss_parallel: bool = True,
) -> ActivationEstimate:
    """The terms of one rank's activation memory (see the module docstring for what each counts)."""
    a = model.args
    h, f, kv, heads, vocab, e, s = (
        a.dim,
        a.ffn_hidden_dim,
        a.kv_heads * a.head_dim,
        a.n_heads,
        a.vocab_size,
        dtype_bytes,
        tp,
    )
    tokens = batch * seq_len
    block = tokens * (2 * norm_bytes(h, e, s) + (4 * e * h + 4 * heads) / s + 4 * e * f / s)
    layers = a.n_layers
    chosen, per_op = ac_plan(ac_mode, ac_option, layers)  # the blocks apply_ac checkpoints
    checkpointed = len(chosen)
    if per_op:
        w2 = e * h  # under TP the row-parallel partial sum, full width, before its reduce-scatter
        kept = tokens * (e * h / s + (e * h + 4 * heads) / s + e * (h + kv + f) / s + w2)
    else:
        kept = tokens * e * h / s if checkpointed else 0.0
    lp = s if loss_parallel else 1
    head = tokens * (norm_bytes(h, e, s) + 4 * vocab / lp + 8)
    return ActivationEstimate(
        block=block,
        checkpointed_block=kept,
        checkpointed=checkpointed,
        layers=layers,
        head=head,
        head_backward=tokens * (4 + e) * vocab / lp,
        recompute=block - kept if checkpointed else 0.0,
    )
