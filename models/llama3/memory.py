"""An estimate of one rank's activation memory for a Llama-3 micro-batch (the dry-run planner prints it).

Counted per token, from what this model's autograd graph keeps for backward (GPU SDPA, i.e. flash or
memory-efficient attention: no seq x seq scores). Per block, in the compute dtype (e bytes): the two norm
outputs (2h, the inputs of wq/wk/wv and of w1/w3), SDPA's q, k, v (kv heads repeated to h) and output (4h), the
input of wo (h), and the SwiGLU intermediates w1 x, silu(w1 x), w3 x and their product (4F); in fp32: the two
norm inputs (2h) and the rotated q and k (h + kv). Under TP with sequence parallelism everything is split over
the TP ranks except the two all-gathered norm outputs. A checkpointed block keeps only its input (h), and one
block's activations come back during its recompute. The head adds the final norm, the logits (V in the compute
dtype) and the fp32 copy and log-softmax of the loss (2V, not split by TP: the logits come back replicated).
"""

from __future__ import annotations

from .model import Transformer


def activation_bytes(
    model: Transformer, *, batch: int, seq_len: int, dtype_bytes: int, tp: int = 1, ac_mode: str = "none"
) -> float:
    """Estimated bytes of activations one rank holds at the peak of a micro-batch's backward."""
    a = model.args
    h, f, kv, e = a.dim, a.ffn_hidden_dim, a.kv_heads * a.head_dim, dtype_bytes
    tokens = batch * seq_len
    gathered = 2 * h * e  # the norm outputs, all-gathered by TP before the column-parallel projections
    sharded = (5 * h + 4 * f) * e + (3 * h + kv) * 4
    block = tokens * (gathered + sharded / tp)
    layers = a.n_layers
    checkpointed = {"none": 0, "selective": (layers + 1) // 2, "full": layers}[ac_mode]
    blocks = (layers - checkpointed) * block + checkpointed * tokens * h * e / tp
    if checkpointed:
        blocks += block  # the block being recomputed
    head = tokens * (h * (4 + e) / tp + a.vocab_size * (e + 8))
    return float(blocks + head)
