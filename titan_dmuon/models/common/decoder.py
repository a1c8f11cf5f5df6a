"""The decoder-only transformer the families share, without any parallelism code: token embedding, the blocks in a
``ModuleDict`` named ``layers`` (FQNs ``layers.N....``), the final RMSNorm and the output head, which may be the
embedding matrix itself (tied).

A family subclasses `Decoder` with its block builder (which attention, which feed-forward per layer). Parallelism
(TP, FSDP2, DMuon) is applied from outside by FQN: see ``tensor_parallel.py``. The model is built on the meta
device and parallelized there; each rank then materializes and initializes only its share, from the per-FQN
distributions ``param_inits`` declares (titan_dmuon/components/initialization.py), so nothing here may depend on
parameter values at construction time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn

from titan_dmuon.components.initialization import ParamInit, constant, init_params, normal, trunc_normal
from titan_dmuon.components.kv_cache import KVCache, run_blocks
from titan_dmuon.components.moe import moe_layers

from .norms import RMSNorm
from .rope import precompute_rope


class DecoderArgs(Protocol):
    """What the shared core reads from a family's (dataclass) arguments."""

    dim: int
    n_layers: int
    n_heads: int
    head_dim: int
    kv_heads: int
    ffn_hidden_dim: int
    vocab_size: int
    norm_eps: float
    rope_theta: float
    max_seq_len: int
    depth_init: bool

    def validate(self) -> None: ...


_TIED = "output.weight"


def _drop_tied_output(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """state_dict post-hook of a tied model: the shared matrix is listed once, as `tok_embeddings.weight`."""
    state_dict.pop(prefix + _TIED, None)


def _fill_tied_output(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook of a tied model: `output.weight`, when the dict lacks it, is the embedding's value
    (both keys name the same Parameter)."""
    if prefix + _TIED not in state_dict and prefix + "tok_embeddings.weight" in state_dict:
        state_dict[prefix + _TIED] = state_dict[prefix + "tok_embeddings.weight"]


class Decoder(nn.Module):
    """Embedding -> ``build_block(i, args)`` for each layer -> RMSNorm -> output head.

    With ``tie_embeddings`` the output head is the embedding matrix: one Parameter in both modules, listed once in
    `named_parameters()` and `state_dict()` (as `tok_embeddings.weight`; module hooks keep `output.weight` out and
    fill it back on load), as Hugging Face saves a tied checkpoint (no `lm_head.weight`)."""

    def __init__(
        self, args: DecoderArgs, build_block: Callable[[int, DecoderArgs], nn.Module], *, tie_embeddings: bool = False
    ):
        super().__init__()
        args.validate()
        self.args = args
        self.tie_embeddings = tie_embeddings
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed "0".."n-1" (torchtitan): FQNs stay `layers.N...` even if layers are dropped.
        self.layers = nn.ModuleDict({str(i): build_block(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if tie_embeddings:
            # One Parameter in both modules. It stays one through `to_empty` (`_apply` below), FSDP2 (one FSDPParam,
            # set on both modules) and TP (the plan re-ties after sharding: tensor_parallel.py); named_parameters()
            # and state_dict() list it once, as tok_embeddings.weight.
            self.output.weight = self.tok_embeddings.weight
            self.register_state_dict_post_hook(_drop_tied_output)
            self.register_load_state_dict_pre_hook(_fill_tied_output)
        self.register_buffer("rope_cache", self.rope_table(), persistent=False)

    def rope_table(self) -> torch.Tensor:
        """The RoPE table on the default device (rope.py): head_dim wide. A family whose rotary part is narrower or
        scaled (DeepSeek-V3's MLA: qk_rope_head_dim, YaRN) overrides it."""
        return precompute_rope(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta)

    def _apply(self, fn, recurse: bool = True):
        """`to_empty`, `to`, `cuda` ... (all of them run this). A conversion that cannot change a Parameter in place
        (meta -> a device: `to_empty` of a plain model) gives each module a new Parameter of its own: the output
        then holds the embedding's new one again. (DTensor params, under FSDP2 or TP, are swapped in place and
        stay one.)"""
        out = super()._apply(fn, recurse)
        tied = self.tie_embeddings and self.output is not None and self.tok_embeddings is not None  # a pipeline part
        if tied and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight
        return out

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        *,
        layers: Sequence[str] | None = None,
        embed: bool = True,
        head: bool = True,
    ) -> torch.Tensor:
        """``tokens [B, L]`` (int64) -> logits ``[B, L, vocab_size]`` in the compute dtype.

        With a ``cache`` (generation), ``tokens`` continue the cached sequences: row ``b``'s positions start at
        ``cache.length - cache.pad[b]`` (its prompt is left-padded by ``pad[b]`` slots that no query sees).

        A pipeline stage (titan_dmuon/parallel/pipeline.py) runs a slice: the blocks named in ``layers`` (keys of
        ``self.layers``; all by default), the embedding only if ``embed`` (else ``tokens`` is the hidden state
        ``[B, L, dim]`` the previous stage sent), the final norm and the head only if ``head`` (else the hidden
        state goes out)."""
        end = tokens.shape[1] if cache is None else cache.length + tokens.shape[1]
        if end > self.args.max_seq_len:
            raise ValueError(f"sequence length {end} exceeds max_seq_len {self.args.max_seq_len}")
        blocks = self.layers.values() if layers is None else [self.layers[k] for k in layers]
        h = self.tok_embeddings(tokens) if embed else tokens
        h = run_blocks(blocks, h, self.rope_cache, tokens.shape[1], cache)
        return self.output(self.norm(h)) if head else h

    def param_inits(self) -> dict[str, ParamInit]:
        """Every parameter's initial distribution by FQN (a function of the shapes only: no values read).

        Untied (torchtitan's): the embedding N(0, 1) and the output trunc_normal(dim^-0.5, cut at 3 std). Tied: the
        one matrix N(0, 0.02), Hugging Face's initializer_range. A tied matrix of std s gives the input token's own
        row a lead of about dim * s in the first logits (the final norm's output is mostly that embedding, scaled to
        unit RMS): 0.02 keeps it below the untied output std's sqrt(dim) up to dim 2500, and on Qwen3's tiny and
        debug flavors the first steps' losses measured lower with it. The blocks' own are theirs
        (`TransformerBlock.param_inits`)."""
        std = self.args.dim**-0.5
        inits = {"norm.weight": constant(1.0)}
        if self.tie_embeddings:
            inits["tok_embeddings.weight"] = normal(0.02)
        else:
            inits["tok_embeddings.weight"] = normal(1.0)
            inits["output.weight"] = trunc_normal(std, a=-3.0 * std, b=3.0 * std)
        # a pipeline stage's part of the model lacks some of these (None): it initializes what it holds
        present = {n for n, _ in self.named_parameters()}
        inits = {k: v for k, v in inits.items() if k in present}
        for i, layer in self.layers.items():
            inits.update({f"layers.{i}.{k}": v for k, v in layer.param_inits().items()})
        return inits

    def init_buffers(self, device: torch.device | str) -> None:
        """Compute the buffers on `device`: the RoPE table, and the MoE layers' aux-free biases and metric sums
        (zeros); they hold no parameters, so every rank computes all."""
        with torch.device(device):
            self.rope_cache = self.rope_table()
            for moe in moe_layers(self):
                moe.init_buffers()

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)initialize an unsharded, materialized model in place (after ``to_empty``): the buffers, and every
        parameter from ``param_inits`` with the seed of ``torch.manual_seed`` (``torch.initial_seed()``), so
        ``manual_seed(s); init_weights()`` gives the weights a sharded run with seed ``s`` starts from."""
        self.init_buffers(buffer_device if buffer_device is not None else self.rope_cache.device)
        init_params(self, self.param_inits(), torch.initial_seed())

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Global parameter count, a tied matrix once (DTensor ``numel`` is global, so this holds after TP/FSDP
        too), every expert counted. ``exclude_embedding`` leaves the embedding table out (a tied model's output
        head with it)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.tok_embeddings.weight.numel() if exclude_embedding else n

    def num_inactive_params(self) -> int:
        """The expert params a token does not use: (E - top_k) / E of every MoE layer's experts."""
        layers = moe_layers(self)
        if not layers:
            return 0
        experts = sum(p.numel() for moe in layers for p in moe.experts.parameters())
        return experts * (layers[0].num_experts - layers[0].top_k) // layers[0].num_experts

    def num_active_params(self) -> int:
        """The params one token uses (the embedding included): all but the unselected experts."""
        return self.num_params() - self.num_inactive_params()

    def num_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (torchtitan/PaLM convention): 6 * the matmul params a token uses (the blocks'
        with only top_k of each MoE layer's experts and the router, and the output head's, tied or not: the
        embedding lookup is no matmul) plus the attention scores' and values' (`attention_flops_per_token`)."""
        matmul = self.num_params(exclude_embedding=True) + (self.output.weight.numel() if self.tie_embeddings else 0)
        matmul -= self.num_inactive_params()
        return 6 * matmul + self.attention_flops_per_token(seq_len)

    def attention_flops_per_token(self, seq_len: int) -> int:
        """The score and value products' training FLOPs per token: 6 * layers * heads * (q·k width + value width) *
        seq_len, i.e. 12 * layers * heads * head_dim * seq_len when keys and values are head_dim wide. A family with
        other widths (MLA) overrides it."""
        a = self.args
        return 12 * a.n_layers * a.n_heads * a.head_dim * seq_len


def get_nparams_and_flops(model: Decoder, seq_len: int) -> tuple[int, int]:
    """``(total params, training FLOPs per token)`` for MFU reporting."""
    return model.num_params(), model.num_flops_per_token(seq_len)


__all__ = ["Decoder", "DecoderArgs", "get_nparams_and_flops"]
