"""Per-head Muon (docs/dmuon.md, "Per-head Muon") on one process: the owner's update of a matrix with head blocks
equals torch.optim.Muon run on each head block as a parameter of its own (momentum, NS and the block-shape lr
scaling), blocks batched within and across matrices, chunked or not; muon_naive's NaiveMuon takes the same step;
with per_head off the recorded blocks change nothing (bitwise); the LPT counts a blocked matrix as blocks x the NS
cost of a block; the TP rule; and the errors for bad blocks and per_head without blocks.

`PerHeadReference` (torch.optim.Muon on block parameters + AdamW, NS in fp32 via tests/reference.py) shares no code
with titan_dmuon; tests/distributed/test_dmuon_per_head.py uses it for the layout parity tests too.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from tests.dmuon_harness import HP  # the parity tests' hyper-parameters
from tests.ns_reference import MUON_ABC
from tests.reference import assert_rel_close, fp32_torch_muon


class PerHeadReference:
    """torch.optim.Muon on the `predicate` matrices, each matrix named in `blocks` ({fqn: (dim, size)}) split into
    its head blocks, each block a parameter of its own (its own momentum, NS and lr scaling); torch.optim.AdamW on
    the other params. `step()` hands each block its slice of the matrix's grad, steps both optimizers and writes
    the blocks back into the matrix. Run it inside `tests.reference.fp32_torch_muon()` (fp32 NS)."""

    def __init__(
        self,
        model: nn.Module,
        predicate: Callable[[str, nn.Parameter], bool],
        blocks: Mapping[str, tuple[int, int]],
        *,
        lr: float,
        momentum: float,
        weight_decay: float,
        adamw_lr: float,
        adamw_betas: tuple[float, float],
        adamw_eps: float,
        adamw_weight_decay: float,
        nesterov: bool = True,
        adjust_lr_fn: str = "original",
        ns_steps: int = 5,
        **_ignored,
    ):
        self.split: list[tuple[str, nn.Parameter, list[nn.Parameter], int]] = []
        muon_params, adamw_params = [], []
        for name, p in model.named_parameters():
            if not predicate(name, p):
                adamw_params.append(p)
            elif name in blocks:
                dim, size = blocks[name]
                parts = [nn.Parameter(t.detach().clone()) for t in p.detach().split(size, dim=dim)]
                self.split.append((name, p, parts, dim))
                muon_params += parts
            else:
                muon_params.append(p)
        self.muon = torch.optim.Muon(
            muon_params,
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            ns_coefficients=MUON_ABC,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
        )
        self.adamw = torch.optim.AdamW(
            adamw_params, lr=adamw_lr, betas=adamw_betas, eps=adamw_eps, weight_decay=adamw_weight_decay
        )
        self.model = model

    @torch.no_grad()
    def step(self) -> None:
        for _, p, parts, dim in self.split:
            for part, g in zip(parts, p.grad.split(parts[0].shape[dim], dim=dim), strict=True):
                part.grad = g.clone()
            p.grad = None  # the matrix itself is not a parameter of either optimizer
        self.muon.step()
        self.adamw.step()
        for _, p, parts, dim in self.split:
            p.copy_(torch.cat([part.detach() for part in parts], dim=dim))

    def zero_grad(self) -> None:
        self.muon.zero_grad()
        self.adamw.zero_grad()
        self.model.zero_grad()

    def momentum(self) -> dict[str, torch.Tensor]:
        """Every Muon matrix's momentum by FQN (a split one's block buffers reassembled)."""
        names = {p: n for n, p in self.model.named_parameters()}
        out = {names[p]: s["momentum_buffer"].clone() for p, s in self.muon.state.items() if p in names}
        for name, _, parts, dim in self.split:
            out[name] = torch.cat([self.muon.state[part]["momentum_buffer"] for part in parts], dim=dim)
        return out


# ---- one owner on one rank ------------------------------------------------------------------------------------
DIM, HD, HEADS, KV_HEADS, FF = 8, 4, 3, 2, 16
ROWS = {"wq.weight": (0, HD), "wk.weight": (0, HD)}
COLS = {"wo.weight": (1, HD)}


class Heads(nn.Module):
    """wq (12x8: 3 heads of 4 rows), wk (8x8: 2 heads), wo (8x12: 3 heads of 4 columns), an FFN matrix (16x8, no
    heads) and a gain (AdamW). The loss is linear in the weights, so each step's grads are the given matrices."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.wq = nn.Linear(DIM, HEADS * HD, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * HD, bias=False)
        self.wo = nn.Linear(HEADS * HD, DIM, bias=False)
        self.ffn = nn.Linear(DIM, FF, bias=False)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 5))

    def forward(self, grads: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum((p * grads[n]).sum() for n, p in self.named_parameters())


def is_matrix(name: str, p: nn.Parameter) -> bool:
    return p.ndim == 2


def grads_for(model: nn.Module, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def dedicated(blocks: Mapping[str, tuple[int, int]] | None):
    """(a plain copy taken first, the model with its matrices dedicated on one rank, blocks recorded)."""
    from torch.distributed.device_mesh import init_device_mesh

    from titan_dmuon import dmuon
    from titan_dmuon.dmuon.state import state_of

    model = Heads()
    plain = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (1,))
    dmuon.dedicate_params(model, mesh, is_matrix, hook_boundary_predicate=lambda m: m is model, head_blocks=blocks)
    assert state_of(model, "test").head_blocks == dict(blocks or {})
    return plain, model


def run_dmuon(model, opt, steps: int):
    """Per step: the full weights and the matrices' momentum by FQN, and the NS calls."""
    from titan_dmuon import dmuon

    names = {p: n for n, p in model.named_parameters()}
    out = []
    for step in range(steps):
        model(grads_for(model, step)).backward()
        opt.step()
        opt.zero_grad()
        bufs = {names[p]: s["momentum_buffer"].clone() for p, s in opt.state.items() if "momentum_buffer" in s}
        out.append((dmuon.get_model_state_dict(model), bufs, opt.last_step_stats.get("ns_calls")))
    return out


def run_reference(plain, blocks, steps: int, **kwargs):
    ref = PerHeadReference(plain, is_matrix, blocks, **HP, **kwargs)
    out = []
    with fp32_torch_muon():
        for step in range(steps):
            plain(grads_for(plain, step)).backward()
            ref.step()
            ref.zero_grad()
            out.append(({k: v.detach().clone() for k, v in plain.state_dict().items()}, ref.momentum()))
    return out


def assert_same(got, want, rtol: float = 1e-5) -> None:
    for step, ((sd, bufs, *_), (ref_sd, ref_bufs)) in enumerate(zip(got, want, strict=True)):
        assert set(sd) == set(ref_sd) and set(bufs) == set(ref_bufs)
        for k, v in ref_sd.items():
            assert_rel_close(sd[k], v, rtol, f"step {step} {k}")
        for k, v in ref_bufs.items():
            assert_rel_close(bufs[k], v, rtol, f"step {step} momentum {k}")


@pytest.mark.parametrize("ns_max_batch_elements", [2**26, 70], ids=["one-batch", "chunks-of-2-blocks"])
@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("wo", [False, True], ids=["qk", "qk+wo"])
def test_owner_update_is_torch_muon_per_head_block(one_rank, wo, adjust_lr_fn, ns_max_batch_elements):
    """wq's 3 and wk's 2 row blocks (4x8) and wo's 3 column blocks (8x4, the same shape transposed) are batched
    together (in chunks of 2 blocks: a matrix's blocks split over chunks); each equals torch.optim.Muon on that
    block alone, its lr scaled by the block's shape (original: sqrt(max(1, 8/4)) for wo's tall blocks)."""
    from titan_dmuon import dmuon

    blocks = {**ROWS, **COLS}  # every block recorded; per_head_wo decides whether wo's are used
    plain, model = dedicated(blocks)
    opt = dmuon.Muon(
        model,
        **HP,
        ns_coefficients="muon",
        adjust_lr_fn=adjust_lr_fn,
        ns_dtype=torch.float32,
        per_head=True,
        per_head_wo=wo,
        ns_max_batch_elements=ns_max_batch_elements,
    )
    got = run_dmuon(model, opt, 3)
    assert_same(got, run_reference(plain, {**ROWS, **(COLS if wo else {})}, 3, adjust_lr_fn=adjust_lr_fn))
    assert {calls for *_, calls in got} == {4.0}  # one per matrix, whatever its blocks


def test_ddp_takes_head_blocks(one_rank):
    """dedicate_params_ddp records head blocks the same way (DDP keeps the live params: the owner updates them)."""
    from torch.distributed.device_mesh import init_device_mesh

    from titan_dmuon import dmuon

    model = Heads()
    plain = copy.deepcopy(model)
    blocks = {**ROWS, **COLS}
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    dmuon.dedicate_params_ddp(model, mesh, is_matrix, hook_boundary_predicate=lambda m: m is model, head_blocks=blocks)
    dmuon.replicate(model, mesh)
    opt = dmuon.Muon(model, **HP, ns_coefficients="muon", ns_dtype=torch.float32, per_head=True, per_head_wo=True)
    assert_same(run_dmuon(model, opt, 2), run_reference(plain, blocks, 2))


def test_per_head_differs_from_whole_matrix(one_rank):
    """The check above is not vacuous: the whole-matrix reference is far from the per-head update."""
    from titan_dmuon import dmuon

    plain, model = dedicated({**ROWS, **COLS})
    opt = dmuon.Muon(model, **HP, ns_coefficients="muon", ns_dtype=torch.float32, per_head=True, per_head_wo=True)
    got = run_dmuon(model, opt, 1)[0][0]
    whole = run_reference(plain, {}, 1)[0][0]
    for k in ("wq.weight", "wk.weight", "wo.weight"):
        assert (got[k] - whole[k]).norm() > 1e-3 * whole[k].norm(), k
    assert torch.allclose(got["ffn.weight"], whole["ffn.weight"], rtol=1e-5, atol=1e-7)


def test_recorded_blocks_without_per_head_are_bitwise_the_plain_update(one_rank):
    from titan_dmuon import dmuon

    kw = dict(**HP, ns_coefficients="muon", ns_dtype=torch.float32)
    _, plain = dedicated(None)
    _, blocked = dedicated({**ROWS, **COLS})
    a = run_dmuon(plain, dmuon.Muon(plain, **kw), 2)
    b = run_dmuon(blocked, dmuon.Muon(blocked, **kw), 2)
    whole = {"wq.weight": (0, HEADS * HD), "wk.weight": (0, KV_HEADS * HD), "wo.weight": (1, HEADS * HD)}
    _, one_block = dedicated(whole)  # one block per matrix: the matrix itself
    c = run_dmuon(one_block, dmuon.Muon(one_block, **kw, per_head=True, per_head_wo=True), 2)
    for (sa, ma, _), (sb, mb, _), (sc, mc, _) in zip(a, b, c, strict=True):
        assert all(torch.equal(sa[k], sb[k]) and torch.equal(sa[k], sc[k]) for k in sa)
        assert all(torch.equal(ma[k], mb[k]) and torch.equal(ma[k], mc[k]) for k in ma)


def test_naive_muon_takes_the_same_per_head_step(one_rank):
    """muon_naive's NaiveMuon (the baseline) with per_head: the same reference."""
    from titan_dmuon.components.optimizer import NaiveMuon

    model = Heads()
    plain = copy.deepcopy(model)
    params = dict(model.named_parameters())
    blocks = {**ROWS, **COLS}
    opt = NaiveMuon(
        [p for n, p in params.items() if p.ndim == 2],
        [params["gain"]],
        head_blocks={params[n]: b for n, b in blocks.items()},
        **HP,
        ns_coefficients="muon",
        ns_dtype=torch.float32,
        per_head=True,
        per_head_wo=True,
    )
    got = []
    names = {p: n for n, p in params.items()}
    for step in range(3):
        model(grads_for(model, step)).backward()
        opt.step()
        opt.zero_grad()
        bufs = {names[p]: s["momentum_buffer"].clone() for p, s in opt.state.items() if "momentum_buffer" in s}
        got.append(({k: v.detach().clone() for k, v in model.state_dict().items()}, bufs))
    assert_same(got, run_reference(plain, blocks, 3))
    with pytest.raises(ValueError, match="per_head is set but NaiveMuon got no head_blocks"):
        NaiveMuon([params["wq.weight"]], [], per_head=True)


# ---- the LPT cost model ---------------------------------------------------------------------------------------
def test_lpt_cost_counts_blocks():
    from titan_dmuon.dmuon.partition import (
        PartitionItem,
        compute_balanced_assignment,
        item_cost,
        ns_cost,
        slot_loads,
    )

    # ns_cost(s×l) = 5·s²·(2l + s): a 4096² wq split into 32 heads of 128 rows costs 32·5·128²·(2·4096 + 128)
    wq = PartitionItem("wq", (4096, 4096), "layers.0", head_blocks=(0, 128))
    assert item_cost(wq) == 32 * 5 * 128**2 * (2 * 4096 + 128)
    wo = PartitionItem("wo", (4096, 4096), "layers.0", head_blocks=(1, 128))
    assert item_cost(wo) == item_cost(wq)
    assert item_cost(PartitionItem("w1", (4096, 4096), "layers.0")) == ns_cost((4096, 4096)) == 5 * 4096**2 * 3 * 4096
    # The assignment follows the blocked cost: whole, `a` (64x64) is the largest unit and takes a slot alone; in 8
    # heads of 8 rows (8·5·8²·136 = 348,160) it is the smallest and shares the lighter slot with `c`.
    items = [
        PartitionItem("b", (48, 64), "l1", mergeable=False),  # 5·48²·176 = 2,027,520
        PartitionItem("c", (32, 64), "l2", mergeable=False),  # 5·32²·160 = 819,200
    ]
    whole = [PartitionItem("a", (64, 64), "l0", mergeable=False), *items]
    blocked = [PartitionItem("a", (64, 64), "l0", mergeable=False, head_blocks=(0, 8)), *items]
    assert item_cost(blocked[0]) == 348_160
    assert compute_balanced_assignment(whole, 2) == {"a": 0, "b": 1, "c": 1}
    assert compute_balanced_assignment(blocked, 2) == {"b": 0, "c": 1, "a": 1}
    assert slot_loads(blocked, {"b": 0, "c": 1, "a": 1}, 2) == [2_027_520, 819_200 + 348_160]


# ---- the TP rule ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shard_dim,local,blocks,local_ns",
    [
        (0, (16, 32), (0, 8), True),  # wq colwise by whole heads: each TP rank orthogonalizes its 2 heads
        (1, (32, 16), (1, 8), True),  # wo rowwise by whole heads
        (0, (16, 32), (0, 16), True),  # one head per TP rank
        (0, (16, 32), (0, 32), False),  # a head straddles the two TP shards
        (0, (32, 16), (1, 8), False),  # blocks on the other dim than the shard's
        (None, (32, 32), (0, 8), False),  # not TP-sharded: the owner's whole-matrix path (no TP at all)
    ],
)
def test_heads_are_local_only_when_they_lie_whole_in_a_tp_shard(shard_dim, local, blocks, local_ns):
    from titan_dmuon.dmuon.tp import heads_are_local

    dp = SimpleNamespace(tp_group=None if shard_dim is None else object(), shard_dim=shard_dim, _orig_size=local)
    assert heads_are_local(dp, blocks) is local_ns


# ---- errors ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "blocks,match",
    [
        ({"nope.weight": (0, 4)}, r"head_blocks names 'nope.weight', which is not a dedicated matrix"),
        ({"gain": (0, 5)}, r"head_blocks names 'gain', which is not a dedicated matrix"),
        ({"wq.weight": (0, 5)}, r"head_blocks\['wq.weight'\] = \(0, 5\): the block size must be a positive integer "),
        ({"wo.weight": (1, 8)}, r"dividing dim 1 of the matrix, which has 12 entries \(shape \(8, 12\)\)"),
        ({"wq.weight": (0, 0)}, r"must be a positive integer"),
        ({"wq.weight": (2, 4)}, r"dim must be 0 \(row blocks\) or 1 \(column blocks\)"),
        ({"wq.weight": 4}, r"must be a pair \(dim, size\)"),
    ],
)
def test_bad_head_blocks_raise(one_rank, blocks, match):
    with pytest.raises(ValueError, match=match):
        dedicated(blocks)


def test_per_head_without_blocks_raises(one_rank):
    from titan_dmuon import dmuon

    _, model = dedicated(None)
    with pytest.raises(dmuon.OptionError, match=r"per_head is set but no head blocks were recorded .*head_blocks="):
        dmuon.Muon(model, per_head=True)
    with pytest.raises(dmuon.OptionError, match=r"per_head_wo needs per_head=True"):
        dmuon.MuonOptions(per_head_wo=True)
    with pytest.raises(dmuon.OptionError, match=r"per_head must be True or False"):
        dmuon.MuonOptions(per_head=1)
