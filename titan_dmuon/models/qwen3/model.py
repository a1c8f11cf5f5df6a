"""Qwen3 (dense) decoder-only transformer, as `transformers`' Qwen3ForCausalLM computes it, without parallelism code.

Built on the shared core (titan_dmuon/models/common/), as Llama 3 is. What differs from Llama 3:
  * an RMSNorm on q and on k per head (over head_dim, a weight of size head_dim), before RoPE;
  * head_dim is a field of its own: n_heads * head_dim need not be dim (Qwen3-0.6B: dim 1024, 16 heads of 128);
  * RoPE in Hugging Face's rotate_half layout (dimension i of a head is paired with i + head_dim/2): our wq and wk
    rows are HF's rows as they are, so the HF adapter only renames (Llama 3 uses Meta's interleaved pairs and its
    adapter permutes rows);
  * the output head can share the embedding matrix (`tie_embeddings`; Qwen3 0.6B, 1.7B and 4B do): one Parameter
    held by `tok_embeddings` and `output`, listed once in `named_parameters()` and once in `state_dict()`
    (as `tok_embeddings.weight`; module hooks keep `output.weight` out of it and fill it back on load), as Hugging
    Face saves a tied checkpoint (no `lm_head.weight`).
  * FFN width is a field (Qwen3's intermediate_size), RMSNorm eps 1e-6, no biases.

Qwen3-MoE (`Qwen3MoeForCausalLM`) is the same model with `num_experts > 0`: a block's `feed_forward` is then the
sparse `MoE` of common/moe.py (router + 3-D grouped experts) where HF's rule makes the layer sparse
(`ModelArgs.is_moe_layer`: `decoder_sparse_step`, `mlp_only_layers`), the dense FeedForward elsewhere.

The model is built on the meta device and parallelized there; each rank then materializes and initializes only
its share from the per-FQN distributions of ``param_inits`` (titan_dmuon/components/initialization.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from titan_dmuon.models.common.attention import Attention
from titan_dmuon.models.common.block import TransformerBlock, depth_init_std
from titan_dmuon.models.common.decoder import Decoder, get_nparams_and_flops
from titan_dmuon.models.common.feed_forward import FeedForward
from titan_dmuon.models.common.moe import MoE


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 36
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128  # per head; n_heads * head_dim may differ from dim
    ffn_hidden_dim: int = 12288  # Hugging Face's intermediate_size
    vocab_size: int = -1  # set from the tokenizer for the debug flavors
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_seq_len: int = 2048  # length of the precomputed RoPE table; the trainer sets it to its seq_len
    tie_embeddings: bool = False  # the output head is the embedding matrix (one Parameter)
    depth_init: bool = True  # torchtitan: output-projection init std shrinks with the layer index
    # Qwen3-MoE (HF Qwen3MoeConfig); num_experts 0 = dense. ffn_hidden_dim stays the width of the dense layers.
    num_experts: int = 0
    top_k: int = 2  # HF num_experts_per_tok
    moe_hidden_dim: int = 0  # HF moe_intermediate_size: each expert's SwiGLU width
    norm_topk_prob: bool = True  # renormalize the top-k routing weights to sum 1
    aux_loss_coef: float = 0.001  # HF router_aux_loss_coef: CE + coef * mean over MoE layers of the aux loss
    decoder_sparse_step: int = 1  # a layer is sparse when (layer_id + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and it is not one of these
    bias_update_rate: float = 0.0  # aux-loss-free balancing (common/moe.py): the bias step per optimizer step; 0 = off

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block `layer_id`'s feed-forward is the sparse MoE. HF's rule (Qwen3MoeDecoderLayer): sparse iff
        there are experts, the layer is not in mlp_only_layers and (layer_id + 1) is a multiple of
        decoder_sparse_step."""
        return (
            self.num_experts > 0
            and layer_id not in self.mlp_only_layers
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    def validate(self) -> None:
        if self.vocab_size <= 0:
            raise ValueError(f"ModelArgs.vocab_size must be set (> 0), got {self.vocab_size}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.num_experts > 0:
            if not 0 < self.top_k <= self.num_experts:
                raise ValueError(f"top_k ({self.top_k}) must be in [1, num_experts ({self.num_experts})]")
            if self.moe_hidden_dim <= 0 or self.decoder_sparse_step <= 0:
                raise ValueError("an MoE flavor needs moe_hidden_dim > 0 and decoder_sparse_step > 0")


def build_block(layer_id: int, args: ModelArgs) -> TransformerBlock:
    """Block ``layer_id``: GQA with q/k norms and rotate_half RoPE, then the SwiGLU or, where `is_moe_layer`, the
    MoE; torchtitan's depth-scaled init (an MoE's router and expert stacks as the dense FFN's matrices)."""
    attention = Attention(
        args.dim,
        args.n_heads,
        args.n_kv_heads,
        args.head_dim,
        rope_layout="rotate_half",
        qk_norm=True,
        norm_eps=args.norm_eps,
    )
    feed_forward: nn.Module
    if args.is_moe_layer(layer_id):
        feed_forward = MoE(
            args.dim,
            args.moe_hidden_dim,
            args.num_experts,
            args.top_k,
            norm_topk_prob=args.norm_topk_prob,
            aux_loss_coef=args.aux_loss_coef,
            n_moe_layers=args.n_moe_layers,
            bias_update_rate=args.bias_update_rate,
        )
    else:
        feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
    init_std = depth_init_std(layer_id, args.n_layers, args.depth_init)
    return TransformerBlock(layer_id, args.dim, args.norm_eps, attention, feed_forward, init_std)


class Transformer(Decoder):
    """Qwen3 / Qwen3-MoE: the shared decoder with Qwen3's blocks, its output head tied to the embedding when
    ``tie_embeddings`` (FQNs `tok_embeddings`, `layers.N....`, `norm`, `output`)."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, build_block, tie_embeddings=args.tie_embeddings)


__all__ = ["ModelArgs", "Transformer", "TransformerBlock", "build_block", "get_nparams_and_flops"]
