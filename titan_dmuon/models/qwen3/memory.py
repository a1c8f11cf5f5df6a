"""An estimate of one rank's activation memory for a Qwen3 micro-batch (the dry-run planner prints it and checks
that the plan fits the device).

Llama 3's count (titan_dmuon/models/llama3/memory.py, which says what each term is) with Qwen3's differences:
the attention is q = heads x head_dim wide (not dim), k and v kv = kv heads x head_dim, and the q and k norms
keep, per token, their fp32 input (4 q, 4 kv), fp32 1/rms per head (4 H, 4 H_kv) and normalized value (e q, e kv),
all split over TP (each rank normalizes its own heads). `tests/integration/test_activation_estimate.py` holds the
block and head terms against the bytes a real forward leaves for backward (within 10%; exact at its shapes).

An MoE block (models/qwen3/moe.py; with k = top_k experts of E, m = moe_hidden_dim) keeps, per token of the rank
(under sequence parallelism each TP rank routes its own chunk, so every MoE term is split over TP) instead of
the SwiGLU's 4 e f:
  * the router: the fp32 probabilities (4E), the top-k ids, the sort order and each pair's token (int64, 3 x 8k),
    and with norm_topk_prob the fp32 top-k probabilities and their sum (4k + 4);
  * the gathered rows [tokens * k, dim] (e k h) and each pair's weight (e k);
  * the experts' w1 x, silu(w1 x), w3 x and their product (4 e k m, the SwiGLU's terms at k rows per token), and
    their output before weighting (e k h);
  * the norm before it reads its output locally (e h / s), where the dense FFN all-gathers it (e h).
Op-level selective AC keeps every other matmul output: the router's logits (e E) and, on average, half of the
experts' (e k (2m + h) / 2: which ones depends on how many experts got rows). A model with dense and MoE layers
gets the mean block (`block`, `checkpointed_block`) and its largest recompute.
"""

from __future__ import annotations

from titan_dmuon.models.llama3.memory import ActivationEstimate, norm_bytes
from titan_dmuon.parallel.parallelize import ac_plan

from .model import ModelArgs, Transformer


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
    """The terms of one rank's activation memory (llama3's, see the module docstring for what differs; the MoE
    blocks' terms too)."""
    a = model.args
    h, f, heads, vocab, e, s = a.dim, a.ffn_hidden_dim, a.n_heads, a.vocab_size, dtype_bytes, tp
    q, kv, kv_heads = heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads
    tokens = batch * seq_len
    qk_norms = (4 + e) * (q + kv) + 4 * (heads + kv_heads)
    # SDPA's q, k and v (repeated to q wide for GQA), output, and fp32 log-sum-exp
    attention = 4 * e * q + 4 * heads
    norm_local = (4 * h + 4 + e * h) / s + e * h / s  # an RMSNorm whose output is read locally (the MoE's)
    dense = tokens * (2 * norm_bytes(h, e, s) + (qk_norms + attention) / s + 4 * e * f / s)
    moe = tokens * (norm_bytes(h, e, s) + norm_local + (qk_norms + attention + _moe_bytes(a, e)) / s)
    layers, n_moe = a.n_layers, a.n_moe_layers
    block = (dense * (layers - n_moe) + moe * n_moe) / layers
    chosen, per_op = ac_plan(ac_mode, ac_option, layers)  # the blocks apply_ac checkpoints
    checkpointed = len(chosen)
    if per_op:
        # its input; SDPA's output and log-sum-exp; the outputs of wq, wv (split over TP), then of w1 (split
        # over TP) and w2 (under TP the row-parallel partial sum, full width), or of an MoE's router and half its
        # experts' matmuls (its own tokens: split over TP)
        attn_kept = tokens * (e * h / s + (e * q + 4 * heads) / s + e * (q + kv) / s)
        kept_dense = attn_kept + tokens * (e * f / s + e * h)
        kept_moe = attn_kept + tokens * e * (a.num_experts + a.top_k * (2 * a.moe_hidden_dim + h) / 2) / s
        kept = (kept_dense * (layers - n_moe) + kept_moe * n_moe) / layers
        recompute = max(dense - kept_dense if n_moe < layers else 0.0, moe - kept_moe if n_moe else 0.0)
    else:
        kept = tokens * e * h / s if checkpointed else 0.0
        recompute = max(dense if n_moe < layers else 0.0, moe if n_moe else 0.0) - kept
    lp = s if loss_parallel else 1
    head = tokens * (norm_bytes(h, e, s) + 4 * vocab / lp + 8)
    return ActivationEstimate(
        block=block,
        checkpointed_block=kept,
        checkpointed=checkpointed,
        layers=layers,
        head=head,
        head_backward=tokens * (4 + e) * vocab / lp,
        recompute=recompute if checkpointed else 0.0,
    )


def _moe_bytes(a: ModelArgs, e: int) -> float:
    """An MoE feed-forward's bytes per routed token (the module docstring's list), before the TP split."""
    k, m = a.top_k, a.moe_hidden_dim
    router = 4 * a.num_experts + 3 * 8 * k + ((4 * k + 4) if a.norm_topk_prob else 0)
    return router + e * k * (2 * a.dim + 4 * m + 1)
