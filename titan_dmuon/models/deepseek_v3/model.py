"""DeepSeek-V3 decoder-only transformer (Moonlight, Kimi K2), as `transformers`' DeepseekV3ForCausalLM computes it,
without parallelism code.

Built on the shared core (titan_dmuon/models/common/). What differs from Llama 3 and Qwen3:
  * multi-head latent attention (common/mla.py): keys and values from a low-rank latent, an optional low-rank query
    path (``q_lora_rank``), a rotary part of each head (``qk_rope_head_dim``) beside its non-rotary part, one rotary
    key shared by all heads; RoPE on the rotary part only, optionally YaRN-scaled (``rope_scaling``, with the
    softmax scale it implies);
  * DeepSeekMoE (common/moe.py): sigmoid scores, the selection bias (`router.expert_bias`, HF's
    e_score_correction_bias) for auxiliary-loss-free balancing, group-limited top-k (``n_group``, ``topk_group``),
    ``routed_scaling_factor``, and shared experts beside the routed ones;
  * the first ``first_k_dense_replace`` layers are dense (a SwiGLU of ``ffn_hidden_dim``), the rest sparse.

Multi-token prediction (DeepSeek-V3's one MTP module, `model.layers.61`) is not built: transformers' model ignores
those weights too, Moonlight and Kimi K2 publish none, and its loss would be a second head on the last stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from titan_dmuon.models.common.block import TransformerBlock, depth_init_std
from titan_dmuon.models.common.decoder import Decoder, get_nparams_and_flops
from titan_dmuon.models.common.feed_forward import FeedForward
from titan_dmuon.models.common.mla import MLAttention
from titan_dmuon.models.common.moe import MoE
from titan_dmuon.models.common.rope import Yarn, precompute_rope


@dataclass
class ModelArgs:
    dim: int = 7168
    n_layers: int = 61
    n_heads: int = 128
    vocab_size: int = -1  # set from the tokenizer for the debug flavors
    ffn_hidden_dim: int = 18432  # HF intermediate_size: the dense layers' SwiGLU width
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Yarn | None = None
    max_seq_len: int = 2048  # length of the precomputed RoPE table; the trainer sets it to its seq_len
    depth_init: bool = True  # torchtitan: output-projection init std shrinks with the layer index
    tie_embeddings: bool = False
    # multi-head latent attention
    q_lora_rank: int = 0  # 0: a full-rank query projection (HF q_lora_rank null)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # DeepSeekMoE (HF DeepseekV3Config's names in the comments)
    num_experts: int = 0  # n_routed_experts; 0 = every layer dense
    top_k: int = 8  # num_experts_per_tok
    moe_hidden_dim: int = 2048  # moe_intermediate_size
    n_shared_experts: int = 1  # the shared experts' width is n_shared_experts * moe_hidden_dim
    first_k_dense_replace: int = 3
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    aux_loss_coef: float = 0.0  # common/moe.py's auxiliary loss (DeepSeek-V3 balances with the bias instead)
    bias_update_rate: float = 0.0  # aux-loss-free balancing: the bias step per optimizer step; 0 = off

    @property
    def kv_heads(self) -> int:
        return self.n_heads

    @property
    def head_dim(self) -> int:
        """A query/key head's width (non-rotary + rotary)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        s = self.rope_scaling
        return self.head_dim**-0.5 if s is None else s.softmax_scale(self.head_dim)

    def is_moe_layer(self, layer_id: int) -> bool:
        """HF's rule: sparse from layer first_k_dense_replace on (when there are experts)."""
        return self.num_experts > 0 and layer_id >= self.first_k_dense_replace

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    def validate(self) -> None:
        if self.vocab_size <= 0:
            raise ValueError(f"ModelArgs.vocab_size must be set (> 0), got {self.vocab_size}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even for RoPE")
        if self.num_experts > 0:
            if not 0 < self.top_k <= self.num_experts:
                raise ValueError(f"top_k ({self.top_k}) must be in [1, num_experts ({self.num_experts})]")
            if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
                raise ValueError(
                    f"n_group ({self.n_group}) must divide num_experts ({self.num_experts}) and topk_group "
                    f"({self.topk_group}) be in [1, n_group]"
                )


def build_block(layer_id: int, args: ModelArgs) -> TransformerBlock:
    """Block ``layer_id``: MLA, then a dense SwiGLU (the first ``first_k_dense_replace`` layers) or DeepSeekMoE;
    torchtitan's depth-scaled init."""
    attention = MLAttention(
        args.dim,
        args.n_heads,
        q_lora_rank=args.q_lora_rank,
        kv_lora_rank=args.kv_lora_rank,
        qk_nope_head_dim=args.qk_nope_head_dim,
        qk_rope_head_dim=args.qk_rope_head_dim,
        v_head_dim=args.v_head_dim,
        softmax_scale=args.softmax_scale,
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
            score_func="sigmoid",
            n_group=args.n_group,
            topk_group=args.topk_group,
            route_scale=args.routed_scaling_factor,
            shared_hidden_dim=args.n_shared_experts * args.moe_hidden_dim,
        )
    else:
        feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
    init_std = depth_init_std(layer_id, args.n_layers, args.depth_init)
    return TransformerBlock(layer_id, args.dim, args.norm_eps, attention, feed_forward, init_std)


class Transformer(Decoder):
    """DeepSeek-V3: the shared decoder with MLA and DeepSeekMoE blocks (FQNs `tok_embeddings`, `layers.N....`,
    `norm`, `output`); its RoPE table covers the rotary dims only, YaRN-scaled when the flavor says so."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, build_block, tie_embeddings=args.tie_embeddings)

    def rope_table(self) -> torch.Tensor:
        a = self.args
        return precompute_rope(a.qk_rope_head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling)

    def attention_flops_per_token(self, seq_len: int) -> int:
        """Scores over head_dim (non-rotary + rotary) and values over v_head_dim: 6 * layers * heads * (their sum) *
        seq_len."""
        a = self.args
        return 6 * a.n_layers * a.n_heads * (a.head_dim + a.v_head_dim) * seq_len


__all__ = ["ModelArgs", "Transformer", "build_block", "get_nparams_and_flops"]
