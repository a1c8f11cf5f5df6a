"""Qwen3 (dense) decoder-only transformer, as `transformers`' Qwen3ForCausalLM computes it, without parallelism code.

What differs from Llama 3 (`titan_dmuon/models/llama3/model.py`, whose RMSNorm, SwiGLU and RoPE table this reuses):
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
sparse `MoE` of moe.py (router + 3-D grouped experts) where HF's rule makes the layer sparse
(`ModelArgs.is_moe_layer`), the dense FeedForward elsewhere (`mlp_only_layers`, `decoder_sparse_step`).

The model is built on the meta device and parallelized there; each rank then materializes and initializes only
its share from the per-FQN distributions of ``param_inits`` (titan_dmuon/components/initialization.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_dmuon.components.initialization import ParamInit, constant, init_params, normal, trunc_normal
from titan_dmuon.components.kv_cache import KVCache, LayerCache, run_blocks
from titan_dmuon.models.llama3.model import FeedForward, RMSNorm, precompute_rope

from .moe import MoE, is_moe_layer, moe_layers


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
    bias_update_rate: float = 0.0  # aux-loss-free balancing (moe.py): the bias step per optimizer step; 0 = off

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block `layer_id`'s feed-forward is the sparse MoE (HF's rule, moe.py `is_moe_layer`)."""
        return is_moe_layer(layer_id, self.num_experts, self.decoder_sparse_step, self.mlp_only_layers)

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


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, L, H, D]`` in Hugging Face's rotate_half layout: dimension i (< D/2) and i + D/2 of a head
    are one pair, turned by pair i's angle. ``rope`` is llama3's table ``[max_seq_len, D // 2, 2]`` of (cos, sin)
    (positions ``0..L-1`` are used), or each row's own positions ``[B, L, D // 2, 2]`` (a KV-cached step). Computed
    in fp32, returned in ``x``'s dtype."""
    b, seqlen, h, d = x.shape
    half = d // 2
    if rope.dim() == 4:
        cos, sin = rope[..., 0].unsqueeze(2), rope[..., 1].unsqueeze(2)
    else:
        cos = rope[:seqlen, :, 0].view(1, seqlen, 1, half)
        sin = rope[:seqlen, :, 1].view(1, seqlen, 1, half)
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


class Attention(nn.Module):
    """Grouped-query attention with per-head RMSNorm on q and k. Head counts come from the projections' (possibly
    TP-sharded) output width via ``view(..., -1, head_dim)``, so the same code runs with n_heads // tp local heads;
    ``q_norm`` / ``k_norm`` act on the last dim (head_dim) only, so they run on any subset of the heads."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.n_rep = args.n_heads // args.n_kv_heads  # invariant under TP: q and kv heads shard alike
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = RMSNorm(args.head_dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q = self.q_norm(self.wq(x).view(bs, seqlen, -1, self.head_dim))
        k = self.k_norm(self.wk(x).view(bs, seqlen, -1, self.head_dim))
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        mask = None
        if cache is not None:  # generation: attend to every cached position the mask allows
            k, v, mask = cache.update(k, v)
        if self.n_rep > 1:
            k = k.repeat_interleave(self.n_rep, dim=2)
            v = v.repeat_interleave(self.n_rep, dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class TransformerBlock(nn.Module):
    """One pre-norm block; a module with its own forward so FSDP2/DMuon hooks can attach at ``layers.N``."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.is_moe = args.is_moe_layer(layer_id)
        self.feed_forward: FeedForward | MoE
        if self.is_moe:
            self.feed_forward = MoE(
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
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        depth = (layer_id + 1) if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / (2 * depth) ** 0.5

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        normed = self.attention_norm(x)
        h = x + (self.attention(normed, rope) if cache is None else self.attention(normed, rope, cache))
        return h + self.feed_forward(self.ffn_norm(h))

    def param_inits(self) -> dict[str, ParamInit]:
        """This block's params (FQNs relative to the block): norms (q/k norms included) 1, the input projections
        (wq wk wv w1) trunc_normal(0.02), the others (wo w2 w3) trunc_normal with the depth-scaled std. An MoE
        block's router gate and experts as the dense FFN's matrices: gate and w1 0.02, w2 and w3 depth-scaled."""
        scaled = trunc_normal(self.weight_init_std)
        if self.is_moe:
            ffn = {
                "feed_forward.router.gate.weight": trunc_normal(0.02),
                "feed_forward.experts.w1": trunc_normal(0.02),
                "feed_forward.experts.w2": scaled,
                "feed_forward.experts.w3": scaled,
            }
        else:
            ffn = {
                "feed_forward.w1.weight": trunc_normal(0.02),
                "feed_forward.w2.weight": scaled,
                "feed_forward.w3.weight": scaled,
            }
        return {
            "attention_norm.weight": constant(1.0),
            "ffn_norm.weight": constant(1.0),
            "attention.q_norm.weight": constant(1.0),
            "attention.k_norm.weight": constant(1.0),
            **{f"attention.{w}.weight": trunc_normal(0.02) for w in ("wq", "wk", "wv")},
            "attention.wo.weight": scaled,
            **ffn,
        }


_TIED = "output.weight"


def _drop_tied_output(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """state_dict post-hook of a tied model: the shared matrix is listed once, as `tok_embeddings.weight`."""
    state_dict.pop(prefix + _TIED, None)


def _fill_tied_output(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook of a tied model: `output.weight`, when the dict lacks it, is the embedding's value
    (both keys name the same Parameter)."""
    if prefix + _TIED not in state_dict and prefix + "tok_embeddings.weight" in state_dict:
        state_dict[prefix + _TIED] = state_dict[prefix + "tok_embeddings.weight"]


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        args.validate()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed "0".."n-1" (torchtitan): FQNs stay `layers.N...` even if layers are dropped.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            # One Parameter in both modules. It stays one through `to_empty` (`_apply` below), FSDP2 (one FSDPParam,
            # set on both modules) and TP (the plan re-ties after sharding: tensor_parallel.py); named_parameters()
            # and state_dict() list it once, as tok_embeddings.weight.
            self.output.weight = self.tok_embeddings.weight
            self.register_state_dict_post_hook(_drop_tied_output)
            self.register_load_state_dict_pre_hook(_fill_tied_output)
        self.register_buffer(
            "rope_cache", precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta), persistent=False
        )

    def _apply(self, fn, recurse: bool = True):
        """`to_empty`, `to`, `cuda` ... (all of them run this). A conversion that cannot change a Parameter in place
        (meta -> a device: `to_empty` of a plain model) gives each module a new Parameter of its own: the output
        then holds the embedding's new one again. (DTensor params, under FSDP2 or TP, are swapped in place and
        stay one.)"""
        out = super()._apply(fn, recurse)
        if self.args.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight
        return out

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """``tokens [B, L]`` (int64) -> logits ``[B, L, vocab_size]`` in the compute dtype.

        With a ``cache`` (generation), ``tokens`` continue the cached sequences: row ``b``'s positions start at
        ``cache.length - cache.pad[b]`` (its prompt is left-padded by ``pad[b]`` slots that no query sees)."""
        end = tokens.shape[1] if cache is None else cache.length + tokens.shape[1]
        if end > self.args.max_seq_len:
            raise ValueError(f"sequence length {end} exceeds max_seq_len {self.args.max_seq_len}")
        h = run_blocks(self.layers.values(), self.tok_embeddings(tokens), self.rope_cache, tokens.shape[1], cache)
        return self.output(self.norm(h))

    def param_inits(self) -> dict[str, ParamInit]:
        """Every parameter's initial distribution by FQN (a function of the shapes only: no values read).

        Untied: the embedding N(0, 1) and the output trunc_normal(dim^-0.5) (llama3's). Tied: the one matrix
        N(0, 0.02), Qwen3's own initializer_range (Hugging Face's config). A tied matrix of std s gives the input
        token's own row a lead of about dim * s in the first logits (the final norm's output is mostly that
        embedding, scaled to unit RMS): 0.02 keeps it below llama3's output std's sqrt(dim) up to dim 2500, and on
        the tiny and debug flavors the first steps' losses measured lower with it."""
        std = self.args.dim**-0.5
        head = trunc_normal(std, a=-3.0 * std, b=3.0 * std)
        inits = {"norm.weight": constant(1.0)}
        if self.args.tie_embeddings:
            inits["tok_embeddings.weight"] = normal(0.02)
        else:
            inits.update({"tok_embeddings.weight": normal(1.0), "output.weight": head})
        for i, layer in self.layers.items():
            inits.update({f"layers.{i}.{k}": v for k, v in layer.param_inits().items()})
        return inits

    def init_buffers(self, device: torch.device | str) -> None:
        """Compute the buffers on `device`: the RoPE table, and the MoE layers' aux-free biases and metric sums
        (zeros); they hold no parameters, so every rank computes all."""
        with torch.device(device):
            self.rope_cache = precompute_rope(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta)
            for moe in moe_layers(self):
                moe.router.expert_bias = torch.zeros(moe.num_experts, dtype=torch.float32)
                moe.tokens_per_expert = torch.zeros(moe.num_experts, dtype=torch.int64)
                moe.aux_loss_sum = torch.zeros((), dtype=torch.float32)
                moe.aux_loss_count = 0

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)initialize an unsharded, materialized model in place (after ``to_empty``): the buffers, and every
        parameter from ``param_inits`` with the seed of ``torch.manual_seed`` (``torch.initial_seed()``), so
        ``manual_seed(s); init_weights()`` gives the weights a sharded run with seed ``s`` starts from."""
        self.init_buffers(buffer_device if buffer_device is not None else self.rope_cache.device)
        init_params(self, self.param_inits(), torch.initial_seed())

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Global parameter count, the tied matrix once (DTensor ``numel`` is global, so this holds after
        TP/FSDP too), every expert counted. ``exclude_embedding`` leaves the embedding table out (a tied model's
        output head with it)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.tok_embeddings.weight.numel() if exclude_embedding else n

    def num_inactive_params(self) -> int:
        """The expert params a token does not use: (E - top_k) / E of every MoE layer's experts."""
        a = self.args
        experts = sum(p.numel() for moe in moe_layers(self) for p in moe.experts.parameters())
        return experts * (a.num_experts - a.top_k) // a.num_experts if a.num_experts else 0

    def num_active_params(self) -> int:
        """The params one token uses (the embedding included): all but the unselected experts."""
        return self.num_params() - self.num_inactive_params()

    def num_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (torchtitan/PaLM convention): 6 * the matmul params a token uses (the blocks'
        with only top_k of each MoE layer's experts and the router, and the output head's, tied or not: the
        embedding lookup is no matmul) plus 12 * layers * heads * head_dim * seq_len for attention scores/values."""
        a = self.args
        matmul = self.num_params(exclude_embedding=True) + (self.output.weight.numel() if a.tie_embeddings else 0)
        matmul -= self.num_inactive_params()
        return 6 * matmul + 12 * a.n_layers * a.n_heads * a.head_dim * seq_len


def get_nparams_and_flops(model: Transformer, seq_len: int) -> tuple[int, int]:
    """``(total params, training FLOPs per token)`` for MFU reporting."""
    return model.num_params(), model.num_flops_per_token(seq_len)


__all__ = [
    "ModelArgs",
    "Attention",
    "TransformerBlock",
    "Transformer",
    "apply_rope",
    "get_nparams_and_flops",
]
