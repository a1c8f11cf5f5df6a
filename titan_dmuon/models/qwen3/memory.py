"""An estimate of one rank's activation memory for a Qwen3 micro-batch (the dry-run planner prints it and checks
that the plan fits the device).

Llama 3's count (titan_dmuon/models/llama3/memory.py, which says what each term is) with Qwen3's differences:
the attention is q = heads x head_dim wide (not dim), k and v kv = kv heads x head_dim, and the q and k norms
keep, per token, their fp32 input (4 q, 4 kv), fp32 1/rms per head (4 H, 4 H_kv) and normalized value (e q, e kv),
all split over TP (each rank normalizes its own heads). `tests/integration/test_activation_estimate.py` holds the
block and head terms against the bytes a real forward leaves for backward (within 10%; exact at its shapes).
"""

from __future__ import annotations

from titan_dmuon.models.llama3.memory import ActivationEstimate, norm_bytes
from titan_dmuon.parallel.parallelize import ac_plan

from .model import Transformer


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
    """The terms of one rank's activation memory (llama3's, see the module docstring for what differs)."""
    a = model.args
    h, f, heads, vocab, e, s = a.dim, a.ffn_hidden_dim, a.n_heads, a.vocab_size, dtype_bytes, tp
    q, kv, kv_heads = heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads
    tokens = batch * seq_len
    qk_norms = (4 + e) * (q + kv) + 4 * (heads + kv_heads)
    # SDPA's q, k and v (repeated to q wide for GQA), output, and fp32 log-sum-exp
    attention = 4 * e * q + 4 * heads
    block = tokens * (2 * norm_bytes(h, e, s) + (qk_norms + attention) / s + 4 * e * f / s)
    layers = a.n_layers
    chosen, per_op = ac_plan(ac_mode, ac_option, layers)  # the blocks apply_ac checkpoints
    checkpointed = len(chosen)
    if per_op:
        # its input; SDPA's output and log-sum-exp; the outputs of wq, wv, w1 (split over TP) and w2 (under TP the
        # row-parallel partial sum, full width)
        kept = tokens * (e * h / s + (e * q + 4 * heads) / s + e * (q + kv + f) / s + e * h)
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
