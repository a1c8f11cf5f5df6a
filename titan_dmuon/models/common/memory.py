"""An estimate of one rank's activation memory for a micro-batch of a decoder family (the dry-run planner prints it
and checks that the plan fits the device).

Counted per token from what the model's autograd graph keeps for backward, in the compute dtype (e bytes per
element) unless said fp32; h = dim, q = heads x head_dim (Llama 3: h), kv = kv heads x head_dim, f = the FFN width,
H = heads, H_kv = kv heads, V = the vocabulary, s = the TP degree (TP here always comes with sequence
parallelism). `tests/integration/test_activation_estimate.py` holds the block and head terms against the bytes a
real forward leaves for backward (within 10%); the backward terms (the logits' grads, the recompute) follow from
the same counts.

A dense block without AC keeps, per token:
  * each of its two RMSNorms: the fp32 input (4h), the fp32 1/rms (4) and the normalized value (e h), all split
    over the TP ranks; and the norm's output that the next projections read (e h), all-gathered (not split);
  * the q and k norms, if any (Qwen3): their fp32 input (4 q, 4 kv), fp32 1/rms per head (4 H, 4 H_kv) and
    normalized value (e q, e kv), all split over TP (each rank normalizes its own heads);
  * attention: SDPA's q (after RoPE), k and v (repeated to q wide for GQA) and output (4 e q), its fp32
    log-sum-exp (4H), split over TP (the kernels torch picks on GPU, flash or memory-efficient, keep the same);
  * SwiGLU: w1 x, silu(w1 x), w3 x and their product (4 e f), split over TP.
An MoE block (moe.py; with k = top_k experts of E, m = the experts' width) keeps, per token of the rank (under
sequence parallelism each TP rank routes its own chunk, so every MoE term is split over TP) instead of the
SwiGLU's 4 e f:
  * the router: the fp32 probabilities (4E), the top-k ids, the sort order and each pair's token (int64, 3 x 8k),
    and with norm_topk_prob the fp32 top-k probabilities and their sum (4k + 4);
  * the gathered rows [tokens * k, dim] (e k h) and each pair's weight (e k);
  * the experts' w1 x, silu(w1 x), w3 x and their product (4 e k m, the SwiGLU's terms at k rows per token), and
    their output before weighting (e k h);
  * the norm before it reads its output locally (e h / s), where the dense FFN all-gathers it (e h).
A block under full AC keeps only its input (e h / s). Op-level selective AC keeps its input, the SDPA output and
log-sum-exp, and the outputs of every other matmul (wq, wv, w1, w2: the wq/wv/w1 ones split over TP; w2's is the
row-parallel partial sum, full width: its reduce-scatter, like the norms' all-gathers, is recomputed), or of an
MoE's router (e E) and, on average, half of its experts' (e k (2m + h) / 2: which ones depends on how many experts
got rows). A checkpointed block's activations come back in backward while it is recomputed: one block's worth on
top. A model with dense and MoE layers gets the mean block (`block`, `checkpointed_block`) and its largest
recompute.

The head keeps the final norm (as a block's), the fp32 log-softmax of the logits (4V; split over TP under loss
parallelism, whole on every TP rank without it) and the labels (8); at the start of backward the logits' grads
(fp32 and compute dtype, (4 + e) V, split the same way) come on top.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from titan_dmuon.components.moe import moe_layers
from titan_dmuon.parallel.parallelize import ac_plan

from .moe import MoE


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


def moe_bytes(moe: MoE, dim: int, e: int) -> float:
    """An MoE feed-forward's bytes per routed token (the module docstring's list), before the TP split."""
    k, m = moe.top_k, moe.experts.w1.shape[1]
    router = 4 * moe.num_experts + 3 * 8 * k + ((4 * k + 4) if moe.router.norm_topk_prob else 0)
    return router + e * k * (2 * dim + 4 * m + 1)


def moe_kept_bytes(moe: MoE, dim: int) -> float:
    """What op-level selective AC keeps of an MoE feed-forward per routed token, in elements: the router's logits
    and, on average, half of the experts' matmul outputs."""
    return moe.num_experts + moe.top_k * (2 * moe.experts.w1.shape[1] + dim) / 2


def activation_estimate(
    model: nn.Module,
    *,
    batch: int,
    seq_len: int,
    dtype_bytes: int,
    tp: int = 1,
    ac_mode: str = "none",
    ac_option: str = "2",
    loss_parallel: bool = True,
) -> ActivationEstimate:
    """The terms of one rank's activation memory of ``model`` (a `decoder.Decoder` whose blocks hold attention.py's
    `Attention`; see the module docstring for what each counts)."""
    a = model.args
    h, f, heads, vocab, e, s = a.dim, a.ffn_hidden_dim, a.n_heads, a.vocab_size, dtype_bytes, tp
    q, kv, kv_heads = heads * a.head_dim, a.kv_heads * a.head_dim, a.kv_heads
    tokens = batch * seq_len
    qk_norm = any(getattr(block.attention, "q_norm", None) is not None for block in model.layers.values())
    qk_norms = (4 + e) * (q + kv) + 4 * (heads + kv_heads) if qk_norm else 0
    # SDPA's q, k and v (repeated to q wide for GQA), output, and fp32 log-sum-exp
    attention = 4 * e * q + 4 * heads
    norm_local = (4 * h + 4 + e * h) / s + e * h / s  # an RMSNorm whose output is read locally (the MoE's)
    dense = tokens * (2 * norm_bytes(h, e, s) + (qk_norms + attention) / s + 4 * e * f / s)
    moes = moe_layers(model)  # every MoE layer of a model has the same shapes
    layers, n_moe = len(model.layers), len(moes)  # a pipeline stage's part holds some of the blocks
    moe = kept_moe = 0.0
    if moes:
        moe = tokens * (norm_bytes(h, e, s) + norm_local + (qk_norms + attention + moe_bytes(moes[0], h, e)) / s)
    block = (dense * (layers - n_moe) + moe * n_moe) / max(layers, 1)
    chosen, per_op = ac_plan(ac_mode, ac_option, layers)  # the blocks apply_ac checkpoints
    checkpointed = len(chosen)
    if per_op:
        # its input; SDPA's output and log-sum-exp; the outputs of wq, wv (split over TP), then of w1 (split
        # over TP) and w2 (under TP the row-parallel partial sum, full width), or of an MoE's router and half its
        # experts' matmuls (its own tokens: split over TP)
        attn_kept = tokens * (e * h / s + (e * q + 4 * heads) / s + e * (q + kv) / s)
        kept_dense = attn_kept + tokens * (e * f / s + e * h)
        if moes:
            kept_moe = attn_kept + tokens * e * moe_kept_bytes(moes[0], h) / s
        kept = (kept_dense * (layers - n_moe) + kept_moe * n_moe) / max(layers, 1)
        recompute = max(dense - kept_dense if n_moe < layers else 0.0, moe - kept_moe if n_moe else 0.0)
    else:
        kept = tokens * e * h / s if checkpointed else 0.0
        recompute = max(dense if n_moe < layers else 0.0, moe if n_moe else 0.0) - kept
    lp = s if loss_parallel else 1
    has_head = getattr(model, "output", None) is not None  # a pipeline stage before the last has none
    head = tokens * (norm_bytes(h, e, s) + 4 * vocab / lp + 8) if has_head else 0.0
    return ActivationEstimate(
        block=block,
        checkpointed_block=kept,
        checkpointed=checkpointed,
        layers=layers,
        head=head,
        head_backward=tokens * (4 + e) * vocab / lp if has_head else 0.0,
        recompute=recompute if checkpointed else 0.0,
    )


__all__ = ["ActivationEstimate", "activation_estimate", "moe_bytes", "moe_kept_bytes", "norm_bytes"]
