"""Llama-3 weights <-> Hugging Face `LlamaForCausalLM` weights: names, the RoPE row permutation and config.json.

Our attention applies RoPE to consecutive pairs of a head's dimensions (Meta's layout, common/rope.py's
`apply_rope_interleaved`); Hugging Face's `rotate_half` pairs dimension i with i + head_dim/2. The two models agree
when the rows of wq and wk are permuted within each head: our row 2i + c (pair i, component c) is HF row
c * head_dim/2 + i, the permutation `transformers`' convert_llama_weights_to_hf applies to Meta's checkpoints. wv,
wo and the rest are the same matrices under other names.

The names and the rest of the machinery are the shared adapter's (titan_dmuon/models/common/hf_adapter.py).
`titan_dmuon/components/checkpoint/hf_io.py` drives the adapter (export_hf, load_hf_weights);
`scripts/convert_checkpoint.py` converts DCP checkpoints with it. It works on whole tensors: a caller that holds a
shard reads plain slices where `needs_full_tensor` is false, and where it is true the HF rows its rows come from
(`from_hf` permutes rows only).
"""

from __future__ import annotations

from typing import Any

import torch

from titan_dmuon.models.common.hf_adapter import DENSE_LAYER_NAMES, DecoderStateDictAdapter, layer_suffix

from .model import ModelArgs


def permute_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection from our interleaved-pair RoPE layout to HF's rotate_half layout, per head
    (`transformers`' convert_llama_weights_to_hf `permute`)."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def permute_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of `permute_to_hf`."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


class Llama3StateDictAdapter(DecoderStateDictAdapter):
    """Maps one Llama-3 configuration's state dict to and from Hugging Face Llama's, tensor by tensor."""

    family = "llama3"
    args_type = ModelArgs
    layer_names = DENSE_LAYER_NAMES

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        # FQN suffix -> the head count its rows are grouped in, for the projections RoPE rotates
        self._permuted = {"attention.wq.weight": args.n_heads, "attention.wk.weight": args.kv_heads}

    def _heads(self, fqn: str) -> int | None:
        suffix = layer_suffix(fqn)
        return None if suffix is None else self._permuted.get(suffix)

    def needs_full_tensor(self, fqn: str) -> bool:
        """True when converting `fqn` moves rows around (q/k): a shard of it is not a slice of the HF tensor."""
        return self._heads(fqn) is not None

    def to_hf(self, fqn: str, tensor: torch.Tensor) -> torch.Tensor:
        """Our full tensor `fqn` as HF stores it."""
        heads = self._heads(fqn)
        return tensor if heads is None else permute_to_hf(tensor, heads)

    def from_hf(self, fqn: str, tensor: torch.Tensor) -> torch.Tensor:
        """The full HF tensor for `fqn` in our layout."""
        heads = self._heads(fqn)
        return tensor if heads is None else permute_from_hf(tensor, heads)

    def hf_config(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """config.json for `LlamaForCausalLM` with this configuration's shapes. Plain RoPE (no Llama 3.1 scaling),
        untied output, no biases; `max_position_embeddings` is our RoPE table's length (max_seq_len)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **self.decoder_config(dtype),
            "mlp_bias": False,
        }


__all__ = ["Llama3StateDictAdapter", "permute_from_hf", "permute_to_hf"]
