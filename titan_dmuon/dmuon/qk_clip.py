"""QK-clip (MuonClip): bound each attention head's largest pre-softmax logit by rescaling its query and key weights
after the optimizer step (docs/dmuon.md, "QK-clip").

S_h is the largest logit q·k/sqrt(d) of head h over a step's training forwards (every micro-batch, every causal
position, every data-parallel rank); gamma_h = min(1, tau / S_h). After the step a head with gamma_h < 1 has its
logits scaled by gamma_h for the same inputs:

* multi-head attention (a key head per query head): the query head's and the key head's rows each by sqrt(gamma_h);
* grouped-query attention (a key head shared by several query heads): the query head's rows by gamma_h, the shared
  key head left alone (each query head takes its own factor, as MLA's shared rotary key is left alone);
* a QK-norm (an RMSNorm over head_dim on q and k, Qwen3): the norm removes any scale of the projection's rows, so
  the logit's scale lives in the norms' gains, one vector shared by every head of the layer; they take the layer's
  smallest gamma (by the rules above: sqrt on both gains, or all of it on the query gain under GQA);
* multi-head latent attention (MLA, DeepSeek-V3's): a head's logit is its non-rotary part (its query rows times its
  key rows of the shared up-projection) plus its rotary part (its rotary query rows times one rotary key every head
  shares). The non-rotary query and key rows take sqrt(gamma_h) each, the rotary query rows gamma_h, the shared
  rotary key stays (the Kimi K2 paper's rule): the layer says so with `QKHeads.q_rows` / `k_rows`.

A model reports its attention layers by giving each one a `qk_heads()` method (a `QKHeads`) and a `max_logit`
attribute, None until the clip turns measuring on: the clip then sets it to a [local heads] fp32 tensor of -inf,
and the layer's training forward folds `max_logit_per_head(q, k)` into it (`report_max_logit`). One MAX all-reduce
of a [layers x heads] fp32 grid per step gives every rank every head's S (data-parallel ranks saw other tokens,
tensor-parallel ranks hold other heads, pipeline stages other layers: each fills its own entries).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from .trace import QK_CLIP, phase

MAX_LOGIT_CHUNK_ELEMENTS = 1 << 24
"""Logits computed at once by `max_logit_per_head` (64 MiB of fp32): the queries go in chunks of this many."""


@dataclass(frozen=True)
class QKHeads:
    """One attention layer as the clip sees it (its `qk_heads()`); names are relative to the layer module."""

    q: str
    """The query param: the projection whose rows [h*head_dim, (h+1)*head_dim) are query head h, or with
    `shared_gain` the query norm's gain (a [head_dim] vector every head shares)."""
    k: str
    """The key param, alike (kv head g's rows; or the key norm's gain)."""
    n_heads: int
    """Query heads of the whole layer (before tensor parallelism)."""
    n_kv_heads: int
    """Key/value heads of the whole layer; fewer than n_heads is grouped-query attention."""
    head_dim: int
    n_local_heads: int
    """The query heads this rank computes (n_heads / tp under tensor parallelism): the length of `max_logit`."""
    head_offset: int = 0
    """This rank's first query head among the layer's (tensor parallelism)."""
    shared_gain: bool = False
    """q and k are per-head-dim norm gains shared by every head (a QK-norm): the whole layer takes its smallest
    factor."""
    q_rows: tuple[tuple[int, float], ...] = ()
    """A query head's rows in `q` as runs of (rows, power): the run is scaled by gamma_h ** power (MLA: its
    non-rotary rows by sqrt(gamma), its rotary rows by gamma). Empty: head_dim rows, power 1/2, or 1 under GQA."""
    k_rows: tuple[tuple[int, float], ...] = ()
    """A key head's rows in `k`, alike (power 0: rows the clip leaves, MLA's value rows in the shared up-projection).
    Empty: head_dim rows, power 1/2; none under GQA."""

    @property
    def grouped(self) -> bool:
        return self.n_kv_heads < self.n_heads


def max_logit_per_head(
    q: torch.Tensor, k: torch.Tensor, scale: float | None = None, chunk_elements: int = MAX_LOGIT_CHUNK_ELEMENTS
) -> torch.Tensor:
    """The largest causal logit of each query head: q [B, L, H, D], k [B, L, H_kv, D] (after RoPE, as attention sees
    them; each kv head serves H / H_kv query heads) -> [H] fp32, max over the batch, the query positions and the
    keys at or before each. In fp32, in tiles, never the whole [L, L] of a head: a slice of the (sequence, kv head)
    groups, whose q and k are copied to fp32 once (about `chunk_elements` elements), times a run of query positions
    against the keys up to its last one (one batched matmul of at most about `chunk_elements` logits; keys after a
    run's last query are not computed). Past `chunk_elements`, one group or one query row is the smallest tile."""
    b, length, heads, d = q.shape
    kv = k.shape[2]
    rep = heads // kv
    scale = d**-0.5 if scale is None else scale
    groups = max(1, chunk_elements // ((rep + 1) * length * d))  # (sequence, kv head) groups copied at once
    seqs, kvs = (max(1, min(b, groups // kv)), kv) if groups >= kv else (1, groups)
    pos = torch.arange(length, device=q.device)
    out = torch.full((heads,), -math.inf, dtype=torch.float32, device=q.device)
    q, k = q.detach(), k.detach()
    for b0 in range(0, b, seqs):
        for g0 in range(0, kv, kvs):
            n, g = min(seqs, b - b0), min(kvs, kv - g0)
            # [n*g, rep, L, D] and [n*g, L, D]: one fp32 copy each, laid out so that every tile below is a view
            qf = q[b0 : b0 + n, :, g0 * rep : (g0 + g) * rep].view(n, length, g, rep, d).permute(0, 2, 3, 1, 4)
            qf = _fp32_copy(qf).view(n * g, rep, length, d)
            kf = _fp32_copy(k[b0 : b0 + n, :, g0 : g0 + g].permute(0, 2, 1, 3)).view(n * g, length, d)
            rows = max(1, min(length, chunk_elements // (n * g * rep * length)))
            for start in range(0, length, rows):
                end = min(length, start + rows)
                tile = qf[:, :, start:end].reshape(n * g, rep * (end - start), d)
                logits = torch.bmm(tile, kf[:, :end].transpose(1, 2)).view(n * g, rep, end - start, end)
                logits.masked_fill_(pos[start:end, None] < pos[None, :end], -math.inf)  # keys after the query
                best = logits.amax(dim=(2, 3)).view(n, g * rep).amax(dim=0).mul_(scale)
                heads_of = slice(g0 * rep, (g0 + g) * rep)
                out[heads_of] = torch.maximum(out[heads_of], best)
    return out


def _fp32_copy(x: torch.Tensor) -> torch.Tensor:
    """`x` in fp32, contiguous in its (permuted) order: one copy."""
    return torch.empty(x.shape, dtype=torch.float32, device=x.device).copy_(x)


def report_max_logit(layer: nn.Module, q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> None:
    """What an attention layer's forward calls to report: fold this forward's per-head max logits into
    `layer.max_logit` (in place) when the clip measures (the attribute is a tensor) and autograd records (a
    training forward: validation and generation run without grad). ``scale`` is the layer's softmax scale (default
    head_dim^-0.5). A recompute (activation checkpointing) folds
    the same values in again, which leaves a max unchanged."""
    if layer.max_logit is None or not torch.is_grad_enabled():
        return
    m = max_logit_per_head(q, k, scale)
    if m.shape != layer.max_logit.shape:  # shapes only: no device sync
        raise ValueError(
            f"QK-clip: the layer computed {m.shape[0]} query heads but reports {layer.max_logit.shape[0]} "
            "(QKHeads.n_local_heads): under tensor parallelism its qk_heads() must count this rank's heads"
        )
    layer.max_logit.copy_(torch.maximum(layer.max_logit, m))


def _natural_key(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


class _Layer:
    """One reporting layer of this rank: its row in the grid and its q/k params."""

    def __init__(self, name: str, module: nn.Module, row: int):
        self.name, self.module, self.row = name, module, row
        self.heads: QKHeads = module.qk_heads()
        params = dict(module.named_parameters())
        self.q = params[self.heads.q]
        self.k = params[self.heads.k]


class QKClip:
    """The clip of one model (see the module docstring): `launch()` after the step's backwards (reads and resets the
    layers' max logits, starts the all-reduce), `wait()` (the factors), then `factor(param)` / `scale_params_`
    rescale the weights after their update. `tau` = math.inf measures without clipping (the max-logit metric).

    `group`: the ranks whose layers and data make up the model (default: every rank). Building it runs one
    all_gather_object of the layer names (the grid's rows: the union over pipeline stages)."""

    def __init__(self, model: nn.Module, tau: float, device: torch.device, group: dist.ProcessGroup | None = None):
        if not tau > 0:
            raise ValueError(f"qk_clip_tau must be > 0 (math.inf to measure only), got {tau!r}")
        self.tau, self.device, self.group = float(tau), torch.device(device), group
        mine = [(n, m) for n, m in model.named_modules() if callable(getattr(m, "qk_heads", None))]
        if not mine and not dist.is_initialized():
            raise ValueError("QK-clip: the model reports no attention layer (no module with a qk_heads() method)")
        names = [(n, m.qk_heads().n_heads) for n, m in mine]
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            gathered: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, names, group=group)
            every = dict(pair for rank_names in gathered for pair in rank_names)
        else:
            every = dict(names)
        if not every:
            raise ValueError("QK-clip: the model reports no attention layer (no module with a qk_heads() method)")
        self.layer_names = sorted(every, key=_natural_key)
        self.n_heads = torch.tensor([every[n] for n in self.layer_names])
        row_of = {n: i for i, n in enumerate(self.layer_names)}
        self.layers = [_Layer(n, m, row_of[n]) for n, m in mine]
        self._role: dict[int, tuple[_Layer, str]] = {}
        for layer in self.layers:
            self._role[id(layer.q)] = (layer, "q")
            self._role.setdefault(id(layer.k), (layer, "k"))
            layer.module.max_logit = torch.full((layer.heads.n_local_heads,), -math.inf, device=self.device)
        width = int(self.n_heads.max())
        self.grid = torch.full((len(self.layer_names), width), -math.inf, device=self.device)
        self._work = None
        self._gamma: torch.Tensor | None = None
        self.last_max_logits: torch.Tensor | None = None  # [layers]: the last step's S, max over each layer's heads
        self.last_clipped: torch.Tensor | None = None  # the heads clipped at the last step (a device scalar)

    def launch(self) -> None:
        """Read and reset every layer's max logits into the grid; start the MAX all-reduce (async)."""
        with phase(QK_CLIP):
            self.grid.fill_(-math.inf)
            for layer in self.layers:
                h = layer.heads
                self.grid[layer.row, h.head_offset : h.head_offset + h.n_local_heads] = layer.module.max_logit
                layer.module.max_logit.fill_(-math.inf)
            self._gamma = None
            if dist.is_initialized() and dist.get_world_size(self.group) > 1:
                self._work = dist.all_reduce(self.grid, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def wait(self) -> torch.Tensor:
        """The [layers, heads] factors gamma of the step `launch` read (1 where a head is within tau)."""
        if self._gamma is None:
            with phase(QK_CLIP):
                if self._work is not None:
                    self._work.wait()
                    self._work = None
                s = self.grid
                self._gamma = torch.where(s > self.tau, self.tau / s, torch.ones_like(s))
                self.last_max_logits = s.amax(dim=1)
                self.last_clipped = (s > self.tau).sum()
        return self._gamma

    def targets(self, param: torch.Tensor) -> bool:
        """Whether the clip may rescale `param` (some layer's q or k param)."""
        return id(param) in self._role

    def factor(self, param: torch.Tensor) -> torch.Tensor | None:
        """What `param` is multiplied by after its update: [rows, 1] per-row factors of the whole q/k projection,
        a 0-d factor of a shared norm gain, or None when it stays (a shared key under grouped-query attention, a param
        no layer reports, or measuring only)."""
        if self.tau == math.inf or id(param) not in self._role:
            return None
        layer, role = self._role[id(param)]
        h = layer.heads
        runs = h.q_rows if role == "q" else h.k_rows
        if role == "k" and h.grouped and not runs:
            return None
        gamma = self.wait()[layer.row, : h.n_heads]  # 1 for a head within tau: x * 1.0 is x, and no host sync
        power = 1.0 if h.grouped else 0.5
        if h.shared_gain:
            return gamma.min().pow(power)
        per_head = gamma if role == "q" else gamma.view(h.n_kv_heads, -1).amin(dim=1)
        if not runs:
            return per_head.pow(power).repeat_interleave(h.head_dim).unsqueeze(1)
        # [heads, rows per head]: each run of a head's rows at its power
        cols = [per_head.pow(p).unsqueeze(1).expand(-1, n) for n, p in runs]
        return torch.cat(cols, dim=1).reshape(-1, 1)

    def scale_(self, param: torch.Tensor, local: torch.Tensor, rows: slice | None = None) -> None:
        """Multiply `local` (`param`'s values this rank holds: rows `rows` of the whole matrix, all by default) by
        `param`'s factor."""
        f = self.factor(param)
        if f is None:
            return
        with phase(QK_CLIP), torch.no_grad():
            if f.dim() == 0:
                local.mul_(f.to(local.dtype))
            else:
                local.mul_((f if rows is None else f[rows]).to(local.dtype))

    def scale_params_(self, skip: set[int] = frozenset()) -> None:
        """Rescale every targeted param of this rank but those whose id is in `skip` (DMuon's dedicated matrices,
        scaled by their owners): a plain tensor in place, a DTensor (FSDP2, TP) on its local piece, cut from the
        factor by the param's own placements (no communication)."""
        for layer in self.layers:
            for param in {id(p): p for p in (layer.q, layer.k)}.values():
                if id(param) in skip:
                    continue
                f = self.factor(param)
                if f is None:
                    continue
                if not isinstance(param, DTensor):
                    self.scale_(param, param.data)
                elif f.dim() == 0:
                    self.scale_(param, param.to_local())
                else:  # a [rows, 1] factor placed as the param's rows are
                    # row shards (Shard(0), FSDP2's _StridedShard(0) over TP) cut the factor alike; others keep it whole
                    placements = [p if getattr(p, "dim", None) == 0 else Replicate() for p in param.placements]
                    cut = distribute_tensor(f, param.device_mesh, placements, src_data_rank=None).to_local()
                    with phase(QK_CLIP), torch.no_grad():
                        param.to_local().mul_(cut.to(param.dtype))

    def apply(self) -> None:
        """The whole clip for an optimizer without owners (plain, FSDP2 or TP params): launch, wait, rescale. Call it
        after the optimizer's step (a step post-hook)."""
        self.launch()
        self.wait()
        self.scale_params_()

    def stats(self) -> dict[str, float]:
        """The last step's figures: `attn/max_logit` (the largest over layers), one `attn/max_logit/<layer>` per
        layer, and `attn/clipped_heads` (none when measuring only). Reads the device (log steps only)."""
        if self.last_max_logits is None:
            return {}
        values = self.last_max_logits.tolist()
        out = {"attn/max_logit": max(values)}
        out.update({f"attn/max_logit/{name}": v for name, v in zip(self.layer_names, values, strict=True)})
        if self.tau != math.inf:
            out["attn/clipped_heads"] = float(self.last_clipped.item())
        return out


__all__ = ["QKClip", "QKHeads", "max_logit_per_head", "report_max_logit"]
