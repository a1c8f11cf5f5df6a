"""An estimate of one rank's activation memory for a micro-batch of a decoder family (the dry-run planner prints it
and checks that the plan fits the device).

Counted per token from what the model's autograd graph keeps for backward, in the compute dtype (e bytes per
element) unless said fp32; h = dim, f = the FFN width, H = heads, V = the vocabulary, s = the TP degree (TP here
always comes with sequence parallelism). Each block is counted from its own modules (`block_bytes`): its attention
by kind (`attention_bytes`: attention.py's grouped-query `Attention` or mla.py's `MLAttention`) and its feed-forward
(`feed_forward_bytes`: feed_forward.py's SwiGLU or moe.py's `MoE`, with or without shared experts).
`tests/integration/test_activation_estimate.py` holds the block and head terms against the bytes a real forward
leaves for backward (within 10%); the backward terms (the logits' grads, the recompute) follow from the same counts.

A block without AC keeps, per token:
  * each of its two RMSNorms: the fp32 input (4h), the fp32 1/rms (4) and the normalized value (e h), all split
    over the TP ranks; and the norm's output that the next projections read (e h), all-gathered (not split);
  * grouped-query attention (q = H x head_dim, kv = kv heads x head_dim, H_kv = kv heads):
      - the q and k norms, if any (Qwen3): their fp32 input (4 q, 4 kv), fp32 1/rms per head (4 H, 4 H_kv) and
        normalized value (e q, e kv), all split over TP (each rank normalizes its own heads);
      - SDPA's q (after RoPE), k and v (repeated to q wide for GQA) and output (4 e q), its fp32 log-sum-exp (4H),
        split over TP (the kernels torch picks on GPU, flash or memory-efficient, keep the same);
  * multi-head latent attention (mla.py; r_q = q_lora_rank, r_kv = kv_lora_rank, d_n / d_r = a head's non-rotary /
    rotary width, d_qk = d_n + d_r, d_v = a head's value width):
      - with a query latent (r_q > 0), q_norm as any RMSNorm: fp32 input (4 r_q), 1/rms (4), normalized value
        (e r_q) and the output wq_b reads (e r_q); kv_norm on the kv latent alike (4 r_kv + 4 + 2 e r_kv). Whole on
        every TP rank: the down projections and their norms run on the whole sequence there (mla.py,
        tensor_parallel.py's `mla_attention_plan`). wkv_a's output and the rotary key are not kept (the norm and
        RoPE read fp32 copies, the key is expanded into k);
      - SDPA's q and k after RoPE (e H d_qk each), v, a view of wkv_b's output, which keeps that whole
        (e H (d_n + d_v)), the output (e H d_v) and its fp32 log-sum-exp (4H): split over TP (each rank its
        heads). With d_v < d_qk torch picks the memory-efficient (or cuDNN) kernel on GPU, which keeps the same;
        on CPU such a call falls back to the math path (the fp32 L x L probabilities), so the test's MLA flavors
        make d_v = d_qk;
  * a dense SwiGLU: w1 x, silu(w1 x), w3 x and their product (4 e f), split over TP.
An MoE block (moe.py; with k = top_k experts of E, m = the experts' width) keeps, per token of the rank (under
sequence parallelism each TP rank routes its own chunk, so every routed term is split over TP) instead of the
SwiGLU's 4 e f:
  * the router: the fp32 scores (4E: the softmax's probabilities, or the sigmoid's scores), the top-k ids, the
    sort order and each pair's token (int64, 3 x 8k), and with norm_topk_prob the fp32 top-k scores and their sum
    (4k + 4); the sigmoid router's gate runs in fp32 (moe.py's Fp32Linear), so under a lower compute dtype it also
    keeps its input's fp32 copy (4h);
  * the gathered rows [tokens * k, dim] (e k h) and each pair's weight (e k);
  * the experts' w1 x, silu(w1 x), w3 x and their product (4 e k m, the SwiGLU's terms at k rows per token), and
    their output before weighting (e k h);
  * the norm before it reads its output locally (e h / s), where the dense FFN all-gathers it (e h);
  * shared experts (DeepSeekMoE; m_s = their width, n_shared x the experts' width): a SwiGLU over every token
    (4 e m_s / s: tensor_parallel.py's plan makes it column/row-parallel over the gathered sequence) and, under TP,
    that gathered input (e h; at s = 1 it is the norm's output the router reads).
A block under full AC keeps only its input (e h / s). Op-level selective AC keeps its input, SDPA's output and
log-sum-exp, and the outputs of every other matmul of the block in call order (the 1st, 3rd, ...; recomputed: the
norms, RoPE, the activations, the other matmuls, the all-gathers and reduce-scatters). A matmul's output is split
over TP when it is column-parallel, whole when it is a latent down projection (wq_a, wkv_a: r_q, r_kv + d_r) and
full width (h) when it is row-parallel (wo, w2: the partial sum before its reduce-scatter). Grouped-query attention
runs wq wk wv wo, MLA wq (or wq_a wq_b) wkv_a wkv_b wo, a SwiGLU w1 w3 w2, an MoE its router (e E / s: its own
tokens), the routed experts, then the shared experts' w1 w3 w2. So a Llama block keeps wq, wv, w1 and w2's; an MLA
block with a query latent wq_a, wkv_a, wo's and then its SwiGLU's w3, or its shared experts' w1 and w2. The routed
experts, as moe.py's loop of `aten.mm` runs them (off CUDA's bf16 grouped GEMM), count as half of their outputs
(e k (2m + h) / 2 on average: which ones depends on how many experts got rows) and as an even number of matmuls for
the order of the ones after them (an even number of experts, each with rows). The grouped GEMM is no `aten.mm`: on
GPU its outputs are recomputed and the order is unchanged, so there that half is an over-count. A checkpointed
block's activations come back in backward while it is recomputed: one block's worth on top. A model with several
kinds of block (dense and MoE) gets the mean block (`block`; `checkpointed_block`, the checkpointed ones' mean) and
the largest recompute of a checkpointed one.

The head keeps the final norm (as a block's), the fp32 log-softmax of the logits (4V; split over TP under loss
parallelism, whole on every TP rank without it) and the labels (8); at the start of backward the logits' grads
(fp32 and compute dtype, (4 + e) V, split the same way) come on top.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from titan_dmuon.parallel.parallelize import ac_plan

from .feed_forward import FeedForward
from .mla import MLAttention
from .moe import Fp32Linear, MoE


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


@dataclass(frozen=True)
class PartBytes:
    """A block's attention, or its feed-forward with the norm before it, per token of the micro-batch on one rank,
    after the TP split: `kept`, the bytes it keeps for backward without AC; `matmuls`, the elements of each of its
    matmuls' outputs in call order (op-level selective AC keeps every other one of the block's); `sac`, the bytes
    op-level AC keeps whatever that order (SDPA's output and log-sum-exp; half the routed experts' outputs)."""

    kept: float
    matmuls: tuple[float, ...] = ()
    sac: float = 0.0


def norm_bytes(h: int, e: int, tp: int) -> float:
    """An RMSNorm followed by the projections that read it: fp32 input, 1/rms and normalized value (split over
    TP by sequence parallelism), the output the projections read (all-gathered)."""
    return (4 * h + 4 + e * h) / tp + e * h


def gqa_bytes(attention: nn.Module, h: int, e: int, s: int) -> PartBytes:
    """Grouped-query attention (attention.py's `Attention`): the q/k norms if any, SDPA's q, k, v (repeated to q
    wide), output and log-sum-exp, all split over TP; matmuls wq wk wv (column-parallel) and wo (full width)."""
    heads, kv_heads, head_dim = attention.n_heads, attention.n_kv_heads, attention.head_dim
    q, kv = heads * head_dim, kv_heads * head_dim
    qk_norms = (4 + e) * (q + kv) + 4 * (heads + kv_heads) if attention.q_norm is not None else 0
    return PartBytes(
        kept=(qk_norms + 4 * e * q + 4 * heads) / s,
        matmuls=(q / s, kv / s, kv / s, h),
        sac=(e * q + 4 * heads) / s,
    )


def mla_bytes(attention: MLAttention, h: int, e: int, s: int) -> PartBytes:
    """Multi-head latent attention (mla.py): the latent norms whole on every TP rank; SDPA's q, k, v (wkv_b's whole
    output), output and log-sum-exp split over TP; matmuls (wq_a, wq_b | wq), wkv_a, wkv_b, wo."""
    heads, qk, v, nope = attention.n_heads, attention.qk_head_dim, attention.v_head_dim, attention.nope
    r_q, r_kv, rope = attention.q_lora_rank, attention.kv_lora_rank, attention.rope
    latents = (4 * r_kv + 4 + 2 * e * r_kv) + ((4 * r_q + 4 + 2 * e * r_q) if r_q > 0 else 0)
    sdpa = e * heads * (2 * qk + (nope + v) + v) + 4 * heads
    queries = (r_q, heads * qk / s) if r_q > 0 else (heads * qk / s,)
    return PartBytes(
        kept=latents + sdpa / s,
        matmuls=(*queries, r_kv + rope, heads * (nope + v) / s, h),
        sac=(e * heads * v + 4 * heads) / s,
    )


def attention_bytes(attention: nn.Module, h: int, e: int, s: int) -> PartBytes:
    """The attention's terms by its kind: MLA's or grouped-query attention's."""
    if isinstance(attention, MLAttention):
        return mla_bytes(attention, h, e, s)
    return gqa_bytes(attention, h, e, s)


def moe_bytes(moe: MoE, dim: int, e: int) -> float:
    """An MoE's routed part's bytes per routed token (the module docstring's list), before the TP split."""
    k, m = moe.top_k, moe.experts.w1.shape[1]
    router = 4 * moe.num_experts + 3 * 8 * k + ((4 * k + 4) if moe.router.norm_topk_prob else 0)
    if isinstance(moe.router.gate, Fp32Linear) and e < 4:
        router += 4 * dim  # the fp32 copy of the gate's input, kept for its weight's grad
    return router + e * k * (2 * dim + 4 * m + 1)


def swiglu_width(ffn: FeedForward) -> int:
    """A SwiGLU's hidden width (w1's rows: the global shape, a DTensor's under TP)."""
    return ffn.w1.weight.shape[0]


def feed_forward_bytes(ffn: nn.Module, h: int, e: int, s: int) -> PartBytes:
    """The norm before the feed-forward and the feed-forward: a dense SwiGLU (its input all-gathered, matmuls w1 w3
    column-parallel and w2 full width) or an MoE on the rank's own tokens (router, routed experts, and the shared
    experts over the gathered sequence, if any)."""
    if not isinstance(ffn, MoE):
        f = swiglu_width(ffn)
        return PartBytes(kept=norm_bytes(h, e, s) + 4 * e * f / s, matmuls=(f / s, f / s, h))
    norm_local = (4 * h + 4 + e * h) / s + e * h / s  # an RMSNorm whose output is read locally
    k, m = ffn.top_k, ffn.experts.w1.shape[1]
    logits = ffn.num_experts * (4 / e if isinstance(ffn.router.gate, Fp32Linear) else 1)  # fp32 logits: 4/e elements
    kept, matmuls = norm_local + moe_bytes(ffn, h, e) / s, (logits / s,)
    if ffn.shared_experts is not None:
        m_s = swiglu_width(ffn.shared_experts)
        kept += 4 * e * m_s / s + (e * h if s > 1 else 0)
        matmuls += (m_s / s, m_s / s, h)
    return PartBytes(kept=kept, matmuls=matmuls, sac=e * k * (2 * m + h) / 2 / s)


def every_other(matmuls: Sequence[float]) -> float:
    """The elements op-level selective AC keeps of a block's matmul outputs in call order: the 1st, 3rd, ..."""
    return sum(matmuls[::2])


def block_bytes(block: nn.Module, e: int, s: int) -> tuple[float, float]:
    """(bytes a block keeps per token without AC, bytes it keeps under op-level selective AC): see the module
    docstring."""
    h = block.attention_norm.weight.shape[0]
    attention = attention_bytes(block.attention, h, e, s)
    ffn = feed_forward_bytes(block.feed_forward, h, e, s)
    kept = norm_bytes(h, e, s) + attention.kept + ffn.kept
    op_kept = e * h / s + attention.sac + ffn.sac + e * every_other(attention.matmuls + ffn.matmuls)
    return kept, op_kept


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
    `Attention` or mla.py's `MLAttention`; see the module docstring for what each counts)."""
    a = model.args
    h, vocab, e, s = a.dim, a.vocab_size, dtype_bytes, tp
    tokens = batch * seq_len
    per_block = [block_bytes(block, e, s) for block in model.layers.values()]  # a pipeline stage's part: its blocks
    layers = len(per_block)
    chosen, per_op = ac_plan(ac_mode, ac_option, layers)  # the blocks apply_ac checkpoints
    checkpointed = len(chosen)
    full = [tokens * kept for kept, _ in per_block]
    if per_op:
        kept_by = [tokens * op_kept for _, op_kept in per_block]
    else:
        kept_by = [tokens * e * h / s] * layers
    block = sum(full) / max(layers, 1)
    kept = sum(kept_by[i] for i in chosen) / checkpointed if checkpointed else 0.0
    recompute = max((full[i] - kept_by[i] for i in chosen), default=0.0)
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
        recompute=recompute,
    )


__all__ = [
    "ActivationEstimate",
    "PartBytes",
    "activation_estimate",
    "attention_bytes",
    "block_bytes",
    "feed_forward_bytes",
    "gqa_bytes",
    "mla_bytes",
    "moe_bytes",
    "norm_bytes",
]
