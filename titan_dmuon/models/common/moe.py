"""The mixture-of-experts feed-forward, without parallelism code: Qwen3-MoE's (`transformers`'
Qwen3MoeSparseMoeBlock computes the same), and the pieces another MoE family reuses.

`MoE` routes each token to `top_k` of `num_experts` SwiGLU experts (`Router`: softmax in fp32, top-k, the top-k
weights renormalized when `norm_topk_prob`) and sums the experts' outputs weighted by the routing weights. The
experts' weights are 3-D parameters (`GroupedExperts.w1 w2 w3`, one slice per expert), so expert parallelism can
shard them on dim 0 and run them as one grouped matmul.

The tokens reach the experts through a dispatcher (a plain attribute, `MoE.dispatcher`):

    rows, local_counts = dispatcher.dispatch(rows, counts)   # rows [n, dim] sorted by global expert id,
                                                             # counts int64 [E] -> this rank's experts' rows,
                                                             # sorted by local expert, counts int64 [E_local]
    out = dispatcher.combine(experts(rows, local_counts))    # back in the order dispatch got them

`LocalDispatcher` (the identity) is the default; titan_dmuon/parallel/expert_parallel.py swaps in one that
exchanges the rows over an expert-parallel mesh, on which the experts' params are DTensors Shard(0).

Load balancing, two ways (both per MoE layer):
  * the auxiliary loss `E * sum_e f_e P_e` (Switch Transformer's; f_e: the share of (token, slot) pairs routed to
    expert e per token, P_e: the mean router probability of e). Its gradient is injected inside the graph
    (`_AddAuxLoss` on the MoE output), so it reaches the router under any activation checkpointing (reentrant
    checkpointing runs the first forward under no_grad and recomputes in backward: a loss kept in an attribute
    would miss the graph). The objective is CE + aux_loss_coef * mean over the MoE layers of aux.
  * auxiliary-loss-free balancing (DeepSeek-V3's): a per-expert bias added to the router scores for the top-k
    selection only (never to the weights), moved after each optimizer step by `rate * sign(mean load - load)`
    (`MoE.update_bias`, `update_moe_bias`).

`MoE` is a `MoELayer` (titan_dmuon/components/moe.py): the protocol through which the trainer, expert parallelism,
the optimizer components, the planner and the metrics find and drive it.

A family keeps the rule for which of its layers are sparse (Qwen3-MoE: `decoder_sparse_step`, `mlp_only_layers`).
DeepSeekMoE (DeepSeek-V3's, HF's DeepseekV3MoE) is the same layer with the router's sigmoid, group-limited rule
(`Router(score_func="sigmoid", n_group=, topk_group=, route_scale=)`) and `shared_experts`, a dense SwiGLU every
token goes through, its output added to the routed experts' (`shared_hidden_dim`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titan_dmuon.components.initialization import ParamInit, trunc_normal
from titan_dmuon.components.moe import MoELayer

from .feed_forward import FeedForward


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A param's local tensor: `.to_local()` of a DTensor (expert parallelism shards the experts on dim 0, so the
    local tensor holds this rank's experts only), the tensor itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


def _recomputing() -> bool:
    """True while autograd's engine runs (an activation-checkpoint recompute in backward): the forward's side
    effects (the metric counters) must not count twice."""
    return torch._C._current_graph_task_id() != -1


class Fp32Linear(nn.Linear):
    """A Linear computed in fp32 whatever its input's and weight's dtype (DeepSeek-V3's router: transformers keeps
    its gate in fp32; a bf16 score moves by about as much as the selection bias's step, and changes which experts
    some tokens get). A module, so the TP plan's hooks on it still run."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class Router(nn.Module):
    """Top-k router: `gate` logits, scores over the experts in fp32, the top-k experts, their weights.

    Two scoring rules:
      * ``"softmax"`` (HF's Qwen3MoeTopKRouter): the scores are the softmax probabilities; with `norm_topk_prob`
        the top-k weights are renormalized to sum 1.
      * ``"sigmoid"`` (DeepSeek-V3's, HF's DeepseekV3TopkRouter): each expert's score is sigmoid(logit) on its
        own; with ``n_group > 1`` the experts form groups, each group scored by the sum of its two best (biased)
        scores, and only the ``topk_group`` best groups' experts may be chosen (group-limited routing); the top-k
        weights are renormalized when `norm_topk_prob` and multiplied by ``route_scale`` (HF's
        routed_scaling_factor). The probabilities the auxiliary loss sees are the scores normalized to sum 1.

    The persistent fp32 buffer `expert_bias` [E] (aux-loss-free balancing; HF's e_score_correction_bias; zero unless
    `MoE.update_bias` moved it or a checkpoint set it) is added to the scores for the selection only: the weights
    stay the selected experts' scores. It is a buffer of every MoE (saved in checkpoints, set to zero by the
    model's `init_buffers`), so a flavor's state dict does not depend on its bias update rate."""

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        *,
        score_func: str = "softmax",
        n_group: int = 1,
        topk_group: int = 1,
        route_scale: float = 1.0,
    ):
        super().__init__()
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
        if num_experts % n_group or not 0 < topk_group <= n_group:
            raise ValueError(f"{num_experts} experts in {n_group} groups, {topk_group} chosen: they must divide")
        if n_group > 1 and (top_k > topk_group * (num_experts // n_group) or num_experts // n_group < 2):
            raise ValueError(
                f"{num_experts} experts in {n_group} groups of which {topk_group} are chosen: a group scores its two "
                f"best experts, and the chosen groups must hold top_k ({top_k})"
            )
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.score_func, self.n_group, self.topk_group, self.route_scale = score_func, n_group, topk_group, route_scale
        # sigmoid scores (DeepSeek-V3) from fp32 logits, as transformers computes them; softmax (Qwen3) as HF's
        self.gate = (Fp32Linear if score_func == "sigmoid" else nn.Linear)(dim, num_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32), persistent=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [n, dim]`` -> (probs fp32 [n, E], weights [n, top_k] in x's dtype, expert ids int64 [n, top_k])."""
        logits = self.gate(x)
        if self.score_func == "softmax":
            scores = probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        else:
            scores = torch.sigmoid(logits)  # fp32 (Fp32Linear)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        choice = scores + self.expert_bias.float()
        if self.n_group > 1:  # only the experts of the topk_group groups with the best two-expert sums
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            best = grouped.topk(2, dim=-1).values.sum(dim=-1)
            chosen = best.topk(self.topk_group, dim=-1).indices
            keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, chosen, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), -math.inf).view(-1, self.num_experts)
        _, ids = torch.topk(choice, self.top_k, dim=-1)
        top = scores.gather(-1, ids)
        if self.norm_topk_prob:
            denominator = top.sum(dim=-1, keepdim=True)
            top = top / (denominator if self.score_func == "softmax" else denominator + 1e-20)
        if self.route_scale != 1.0:
            top = top * self.route_scale
        return probs, top.to(logits.dtype if self.score_func == "softmax" else x.dtype), ids


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Where `torch._grouped_mm` runs the experts: CUDA, bf16, compute capability >= 9.0, every row stride a
    multiple of 16 bytes (dim and hidden multiples of 8)."""
    if not (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16):
        return False
    if any(w.dtype != torch.bfloat16 for w in weights) or torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    return all(w.shape[-1] * w.element_size() % 16 == 0 and w.shape[-2] * w.element_size() % 16 == 0 for w in weights)


class _ZeroEmptyGroups(torch.autograd.Function):
    """Identity on an expert stack whose backward zeroes the grads of the experts without rows: some grouped-GEMM
    kernels leave garbage (or NaN) in the weight grad of a zero-size group, and an expert with no token is common
    (128 experts, small micro-batches). A device mask, no host sync."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(counts)
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (counts,) = ctx.saved_tensors
        return grad.masked_fill((counts == 0).view(-1, *([1] * (grad.dim() - 1))), 0), None


def experts_grouped_mm(
    x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    """SwiGLU experts as three grouped matmuls (rows of expert e: offsets[e-1]..offsets[e]); no host sync. The
    weight grads of experts without rows are zero whatever the kernel leaves there (`_ZeroEmptyGroups`)."""
    w1, w2, w3 = (_ZeroEmptyGroups.apply(w, counts) for w in (w1, w2, w3))
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs))
    h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)


def experts_loop(
    x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    """SwiGLU experts one at a time over ``torch.split(x, counts)``, skipping experts without rows. With no row
    at all it still runs expert 0 on the empty input, so the output stays in the graph of x and the weights
    (an expert-parallel combine's backward must run on every rank)."""
    pieces = torch.split(x, counts.tolist())
    busy = [e for e, p in enumerate(pieces) if p.shape[0]] or [0]
    outs = [(F.silu(pieces[e] @ w1[e].T) * (pieces[e] @ w3[e].T)) @ w2[e].T for e in busy]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts as 3-D params: `w1` [E, hidden, dim] (HF gate_proj), `w3` [E, hidden, dim]
    (up_proj), `w2` [E, dim, hidden] (down_proj); expert e computes w2[e] (silu(w1[e] x) * w3[e] x)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x [n, dim]`` rows sorted by local expert, ``counts`` int64 [E_local] rows per expert (summing to n)
        -> ``[n, dim]``. The weights are the local tensors (this rank's experts under expert parallelism)."""
        w1, w2, w3 = (local_tensor(p) for p in (self.w1, self.w2, self.w3))
        if counts.shape[0] != w1.shape[0]:
            raise ValueError(f"{counts.shape[0]} expert counts for {w1.shape[0]} local experts")
        if grouped_mm_supported(x, w1, w2, w3):
            return experts_grouped_mm(x, counts, w1, w2, w3)
        return experts_loop(x, counts, w1, w2, w3)


class LocalDispatcher:
    """The identity dispatcher (every expert on this rank). See the module docstring for the protocol an
    expert-parallel dispatcher implements."""

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rows, counts

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        return out


class _AddAuxLoss(torch.autograd.Function):
    """Returns `out` unchanged; in backward, gives `aux` the gradient `grad_scale` (d objective / d aux), so the
    auxiliary loss is part of the objective without being returned."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, grad_scale: float) -> torch.Tensor:
        ctx.grad_scale = grad_scale
        ctx.aux_meta = (aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        dtype, device = ctx.aux_meta
        grad_aux = torch.full((), ctx.grad_scale, dtype=dtype, device=device) if ctx.needs_input_grad[1] else None
        return grad_out, grad_aux, None


class MoE(MoELayer):
    """The sparse feed-forward: `router`, `experts`, optionally `shared_experts` (a `FeedForward` every token goes
    through, added to the routed output), and `dispatcher` (a plain attribute, `LocalDispatcher` by default).

    Plain attributes the trainer / the TP plan set:
      * `aux_loss_scale` (default 1.0): multiplies the aux loss's gradient (the trainer sets
        1 / gradient_accumulation_steps, as it scales the CE loss);
      * `aux_group` (default None): the process group holding the rest of the sequence (TP with sequence
        parallelism, set by tensor_parallel.py's apply_tp): the routed counts are summed over it, so the aux loss
        of the group's whole sequence is the sum of the ranks' shares.
    Each forward in training mode (not an activation-checkpoint recompute) adds, detached and on the device, to
    running sums that `read_stats` reads and resets: `tokens_per_expert` (non-persistent buffer, int64 [E], from
    this rank's global expert ids, before dispatch), `aux_loss_sum` (non-persistent buffer, fp32 scalar: the aux
    losses of the TP group's sequence) and `aux_loss_count` (the forwards, a plain int).
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        *,
        norm_topk_prob: bool = True,
        aux_loss_coef: float = 0.0,
        n_moe_layers: int = 1,
        bias_update_rate: float = 0.0,
        score_func: str = "softmax",
        n_group: int = 1,
        topk_group: int = 1,
        route_scale: float = 1.0,
        shared_hidden_dim: int = 0,
    ):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k ({top_k}) must be in [1, num_experts ({num_experts})]")
        self.num_experts, self.top_k = num_experts, top_k
        self.aux_loss_coef, self.n_moe_layers, self.bias_update_rate = aux_loss_coef, n_moe_layers, bias_update_rate
        self.router = Router(
            dim,
            num_experts,
            top_k,
            norm_topk_prob,
            score_func=score_func,
            n_group=n_group,
            topk_group=topk_group,
            route_scale=route_scale,
        )
        self.experts = GroupedExperts(dim, hidden_dim, num_experts)
        # DeepSeekMoE's shared experts: one SwiGLU every token goes through beside its routed experts
        self.shared_experts = FeedForward(dim, shared_hidden_dim) if shared_hidden_dim > 0 else None
        self.dispatcher = LocalDispatcher()
        self.aux_loss_scale = 1.0
        self.aux_group: dist.ProcessGroup | None = None
        # the metrics' running sums since the last read_stats: buffers (not state), so they move with the module
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("aux_loss_sum", torch.zeros((), dtype=torch.float32), persistent=False)
        self.aux_loss_count = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, T, dim]`` -> ``[B, T, dim]``: each token's experts' outputs, weighted by its routing weights."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs, weights, ids = self.router(flat)
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs by expert id, token order within
        # rows per expert (a static-shape scatter, which compile traces, rather than bincount)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
        rows, local_counts = self.dispatcher.dispatch(flat[order // self.top_k], counts)
        out = self.dispatcher.combine(self.experts(rows, local_counts))
        # back to (token, slot) order, then each token's weighted sum over its slots: a gather and a sum rather
        # than an index_add_ into the tokens (which would keep its weighted source for backward, and accumulates
        # in no fixed order on GPU)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        out = out[inverse].view(flat.shape[0], self.top_k, -1)
        y = (out * weights.unsqueeze(-1)).sum(dim=1).to(flat.dtype)
        aux, aux_value = self._aux_loss(probs, counts)
        self._record(counts, aux_value)
        if self.aux_loss_coef > 0:
            grad_scale = self.aux_loss_coef * self.aux_loss_scale / self.n_moe_layers
            y = _AddAuxLoss.apply(y, aux, grad_scale)
        y = y.view(shape)
        return y if self.shared_experts is None else y + self.shared_experts(x)

    def _aux_loss(self, probs: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's share of the aux loss, with grad; the whole sequence's aux value, detached).

        aux = E * sum_e f_e P_e with f_e = pairs routed to e / tokens and P_e = mean probability of e over the
        tokens: the per-layer form of HF's `load_balancing_loss_func` (which pools the counts and probabilities
        of every layer before the product). Under `aux_group` the counts, the probability sums and the token
        count are summed over the group (no grad) and each rank's share is E * sum_e f_e * (its probability sum
        of e) / tokens: the shares sum to the aux of the group's whole sequence."""
        e = self.num_experts
        psum = probs.sum(dim=0)
        stats = torch.cat([counts.float(), psum.detach(), psum.new_full((1,), probs.shape[0])])
        if self.aux_group is not None:
            dist.all_reduce(stats, group=self.aux_group)
        f = stats[:e] / stats[-1]
        aux = e * (f * psum).sum() / stats[-1]
        return aux, e * (f * stats[e:-1]).sum() / stats[-1]

    @torch.compiler.disable  # host-side bookkeeping (a Python counter, the recompute check): not traced
    @torch.no_grad()
    def _record(self, counts: torch.Tensor, aux_value: torch.Tensor) -> None:
        """Add one forward to the metric sums: in training mode only, and not in a checkpoint's recompute."""
        if not self.training or _recomputing():
            return
        self.tokens_per_expert += counts
        self.aux_loss_sum += aux_value
        self.aux_loss_count += 1

    @torch.no_grad()
    def read_stats(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(tokens per expert int64 [E], the sum of the aux losses fp32 scalar, the training forwards) since the
        last call (zeros when no training forward ran), and reset the running sums."""
        stats = self.tokens_per_expert.clone(), self.aux_loss_sum.float().clone(), self.aux_loss_count
        self.reset_stats()
        return stats

    def init_buffers(self) -> None:
        """The buffers, on the default device: the aux-free bias (zero) and the metric sums (see the class
        docstring); the model's `init_buffers` calls it after materialization."""
        self.router.expert_bias = torch.zeros(self.num_experts, dtype=torch.float32)
        self.tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.int64)
        self.aux_loss_sum = torch.zeros((), dtype=torch.float32)
        self.aux_loss_count = 0

    @torch.no_grad()
    def reset_stats(self) -> None:
        self.tokens_per_expert.zero_()
        self.aux_loss_sum.zero_()
        self.aux_loss_count = 0

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor) -> None:
        """Aux-loss-free balancing step: `expert_bias += rate * sign(mean(counts) - counts)`, raising the bias of
        the experts that got fewer tokens than the mean. `counts` [E] must be the same on every rank (the caller
        all-reduces them first, e.g. `update_bias(global_counts)`), so the bias stays the same everywhere. A no-op
        when `bias_update_rate` is 0."""
        if self.bias_update_rate == 0:
            return
        bias = self.router.expert_bias
        load = counts.to(device=bias.device, dtype=torch.float32)
        bias.add_(torch.sign(load.mean() - load), alpha=self.bias_update_rate)

    def param_inits(self, out: ParamInit) -> dict[str, ParamInit]:
        """As the dense FeedForward's matrices (FQNs relative to this module): the router's gate and the w1 stack
        trunc_normal(0.02), the w2 and w3 stacks `out` (the block's depth-scaled std)."""
        shared = {} if self.shared_experts is None else self.shared_experts.param_inits(out)
        return {
            "router.gate.weight": trunc_normal(0.02),
            "experts.w1": trunc_normal(0.02),
            "experts.w2": out,
            "experts.w3": out,
            **{f"shared_experts.{k}": v for k, v in shared.items()},
        }


__all__ = [
    "Fp32Linear",
    "GroupedExperts",
    "LocalDispatcher",
    "MoE",
    "Router",
    "experts_grouped_mm",
    "experts_loop",
    "grouped_mm_supported",
    "local_tensor",
]
