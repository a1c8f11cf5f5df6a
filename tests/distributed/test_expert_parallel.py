"""Expert parallelism (titan_dmuon/parallel/expert_parallel.py) on real gloo ranks: a tiny MoE defined here (router
Linear + softmax + top-k, 3-D expert weights, sorted rows -> dispatcher -> experts -> combine) with its experts
sharded by `apply_ep` matches a single-process per-token reference that holds the full weights: outputs (1e-6),
the grads of the tokens and the router on each rank and of each rank's expert slices (the reference's expert
grads summed over every rank's tokens; 1e-5). Routings built by hand where an expert, a peer rank or a whole rank
gets no rows finish and match; activation checkpointing and no_grad change nothing; `apply_ep` on the meta device;
`all_to_all_bytes` against the bytes the all-to-alls carry in a uniform routing."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from tests._dist import run_distributed
from titan_dmuon.components.moe import MoELayer
from titan_dmuon.parallel.expert_parallel import AllToAllDispatcher, all_to_all_bytes, apply_ep

DIM, HIDDEN, E, TOP_K, TOKENS = 8, 12, 8, 2, 6
OUT_TOL, GRAD_TOL, DEADLINE = 1e-6, 1e-5, 120
BYTES_TOKENS = 8  # BYTES_TOKENS * TOP_K rows: E * 2, two rows per expert
WEIGHTS = ("w1", "w3", "w2")


# ------------------------------------------------------------------------------------------------ the tiny MoE
def full_weights(num_experts: int = E) -> dict[str, torch.Tensor]:
    """The router's and all experts' weights, the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(0)
    return dict(
        router=torch.randn(num_experts, DIM, generator=g) * 0.5,
        w1=torch.randn(num_experts, HIDDEN, DIM, generator=g) * 0.3,
        w3=torch.randn(num_experts, HIDDEN, DIM, generator=g) * 0.3,
        w2=torch.randn(num_experts, DIM, HIDDEN, generator=g) * 0.3,
    )


def seeded(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def tokens(rank: int) -> torch.Tensor:
    return seeded(100 + rank, TOKENS, DIM)


def out_grad(rank: int, n: int) -> torch.Tensor:
    """The loss is (out * out_grad).sum(): a different upstream grad on every rank and row."""
    return seeded(200 + rank, n, DIM)


def local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


class TinyExperts(nn.Module):
    """w2_e(silu(w1_e x) * w3_e x) for rows sorted by local expert, counts[e] rows each; reads DTensors locally."""

    def __init__(self, w: dict[str, torch.Tensor]):
        super().__init__()
        for name in WEIGHTS:
            self.register_parameter(name, nn.Parameter(w[name].clone()))

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w3, w2 = (local(getattr(self, n)) for n in WEIGHTS)
        outs = [
            (F.silu(chunk @ w1[e].t()) * (chunk @ w3[e].t())) @ w2[e].t()
            for e, chunk in enumerate(rows.split(counts.tolist()))
        ]
        return torch.cat(outs)


class IdentityDispatcher:
    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rows, counts

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        return out


class TinyMoE(MoELayer):
    """An MoE layer of its own (the protocol of titan_dmuon/components/moe.py, not the model core's MoE): top-k
    routing; the (token, slot) rows sorted by expert go through dispatcher -> experts -> combine (under activation
    checkpointing when `checkpointed`), then are weighted and summed back into their tokens."""

    def __init__(self, w: dict[str, torch.Tensor]):
        super().__init__()
        self.router = nn.Linear(DIM, w["router"].shape[0], bias=False)
        with torch.no_grad():
            self.router.weight.copy_(w["router"])
        self.experts = TinyExperts(w)
        self.dispatcher = IdentityDispatcher()
        self.checkpointed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_w, top_i = F.softmax(self.router(x), dim=-1).topk(TOP_K, dim=-1)
        slots = top_i.reshape(-1)
        order = torch.argsort(slots, stable=True)
        rows = x[order // TOP_K]
        counts = torch.bincount(slots, minlength=self.router.out_features)
        if self.checkpointed:
            out = torch.utils.checkpoint.checkpoint(self.routed, rows, counts, use_reentrant=False)
        else:
            out = self.routed(rows, counts)
        out = out.index_select(0, torch.argsort(order))  # back to (token, slot) order
        return (out.view(x.shape[0], TOP_K, DIM) * top_w.unsqueeze(-1)).sum(1)

    def routed(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        rows, local_counts = self.dispatcher.dispatch(rows, counts)
        return self.dispatcher.combine(self.experts(rows, local_counts))


# ------------------------------------------------------------------------------------------------ references
def expert_ref(x: torch.Tensor, e: int, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """One row through expert e, as vectors."""
    return w["w2"][e] @ (F.silu(w["w1"][e] @ x) * (w["w3"][e] @ x))


def moe_ref(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per token: the softmax-weighted sum of its top-k experts, computed with the full weights."""
    top_w, top_i = F.softmax(x @ w["router"].t(), dim=-1).topk(TOP_K, dim=-1)
    return torch.stack(
        [sum(top_w[t, k] * expert_ref(x[t], int(top_i[t, k]), w) for k in range(TOP_K)) for t in range(len(x))]
    )


def reference(world: int, inputs: list[torch.Tensor], forward) -> list[dict]:
    """Per rank: `forward(rank, input, weights)`'s output and the grads of its input and the router; the expert
    grads summed over every rank's loss. `inputs[r]` is rank r's input."""
    total = {k: torch.zeros(v.shape) for k, v in full_weights().items() if k in WEIGHTS}
    per_rank = []
    for rank in range(world):
        w = {k: v.requires_grad_() for k, v in full_weights().items()}
        x = inputs[rank].clone().requires_grad_()
        out = forward(rank, x, w)
        if len(out):
            (out * out_grad(rank, len(out))).sum().backward()
        for k in WEIGHTS:
            total[k] += w[k].grad if w[k].grad is not None else 0
        x_grad = x.grad if x.grad is not None else torch.zeros_like(x)
        per_rank.append(dict(out=out.detach(), x_grad=x_grad, router_grad=w["router"].grad))
    return [dict(r, experts=total) for r in per_rank]


def moe_reference(world: int) -> list[dict]:
    return reference(world, [tokens(r) for r in range(world)], lambda rank, x, w: moe_ref(x, w))


def close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def check(results: list[dict], refs: list[dict], world: int, what: str = "") -> None:
    n_local = E // world
    for rank, (got, ref) in enumerate(zip(results, refs, strict=True)):
        where = f"{what} rank {rank}".strip()
        close(got["out"], ref["out"], OUT_TOL, f"{where} out")
        close(got["x_grad"], ref["x_grad"], GRAD_TOL, f"{where} input grad")
        if "router_grad" in got:
            close(got["router_grad"], ref["router_grad"], GRAD_TOL, f"{where} router grad")
        for k in WEIGHTS:
            close(got[k], ref["experts"][k][rank * n_local : (rank + 1) * n_local], GRAD_TOL, f"{where} {k} grad")


# ------------------------------------------------------------------------------------------------ rank jobs
def ep_mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))


def ep_moe(world: int) -> TinyMoE:
    model = TinyMoE(full_weights())
    assert apply_ep(model, ep_mesh(world)) == 1
    assert isinstance(model.dispatcher, AllToAllDispatcher)
    return model


def moe_step(model: TinyMoE, rank: int) -> dict:
    """One forward + backward on this rank's tokens; the output and the grads (expert grads: the local slice)."""
    model.zero_grad(set_to_none=True)
    x = tokens(rank).requires_grad_()
    out = model(x)
    (out * out_grad(rank, len(out))).sum().backward()
    grads = {k: local(getattr(model.experts, k).grad) for k in WEIGHTS}
    return dict(out=out.detach(), x_grad=x.grad, router_grad=model.router.weight.grad.clone(), **grads)


def moe_job(rank: int, world: int) -> dict:
    return moe_step(ep_moe(world), rank)


def checkpoint_job(rank: int, world: int) -> dict:
    """Plain, then checkpointed with a no_grad call on other tokens between forward and backward (it overwrites
    the dispatcher's route; the recompute must not care), then a no_grad forward."""
    model = ep_moe(world)
    calls, dispatch = [], model.dispatcher.dispatch
    model.dispatcher.dispatch = lambda *args: calls.append(len(args[0])) or dispatch(*args)
    plain = moe_step(model, rank)
    model.zero_grad(set_to_none=True)
    model.checkpointed = True
    x = tokens(rank).requires_grad_()
    out = model(x)
    with torch.no_grad():
        model(tokens(rank + world)[: rank + 1])
    (out * out_grad(rank, len(out))).sum().backward()
    ckpt = dict(
        out=out.detach(),
        x_grad=x.grad,
        router_grad=model.router.weight.grad,
        **{k: local(getattr(model.experts, k).grad) for k in WEIGHTS},
    )
    with torch.no_grad():
        no_grad_out = model(tokens(rank))
    return dict(plain=plain, ckpt=ckpt, no_grad_out=no_grad_out, dispatch_rows=calls)


def routing(scenario: str, rank: int, world: int) -> list[int]:
    """Each row's global expert id (sorted), built so that the scenario's empty sends happen."""
    n_local = E // world
    if scenario == "empty_experts":  # expert e gets nothing from rank r when (e + r) % 3 == 0; the last expert nothing
        return [e for e in range(E - 1) if (e + rank) % 3 for _ in range(1 + (e + rank) % 2)]
    if scenario == "empty_peer":  # rank r sends nothing to rank r + 1
        skip = (rank + 1) % world
        return [e for e in range(E) if e // n_local != skip for _ in range(1 + e % 2)]
    if scenario == "empty_rank":  # rank 0 sends nothing at all, and nobody sends anything to rank 1
        return [] if rank == 0 else [e for e in range(E) if e // n_local != 1 for _ in range(2)]
    raise ValueError(scenario)


SCENARIOS = ("empty_experts", "empty_peer", "empty_rank")


def scenario_rows(scenario: str, rank: int, world: int) -> torch.Tensor:
    return seeded(300 + rank + 10 * SCENARIOS.index(scenario), len(routing(scenario, rank, world)), DIM)


def rows_job(rank: int, world: int, scenarios: tuple[str, ...]) -> dict:
    """Rows with hand-made routings straight through dispatch -> experts -> combine, one after another on the same
    dispatcher."""
    model = ep_moe(world)
    results = {}
    for scenario in scenarios:
        model.zero_grad(set_to_none=True)
        eids = torch.tensor(routing(scenario, rank, world), dtype=torch.int64)
        rows = scenario_rows(scenario, rank, world).requires_grad_()
        out = model.routed(rows, torch.bincount(eids, minlength=E))
        (out * out_grad(rank, len(out))).sum().backward()
        grads = {k: local(getattr(model.experts, k).grad) for k in WEIGHTS}
        results[scenario] = dict(out=out.detach(), x_grad=rows.grad, **grads)
    return results


def rows_reference(scenario: str, world: int) -> list[dict]:
    """Each row through the expert its routing names, with the full weights."""

    def forward(rank: int, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        eids = routing(scenario, rank, world)
        if not eids:
            return x.detach().clone()
        return torch.stack([expert_ref(x[i], e, w) for i, e in enumerate(eids)])

    return reference(world, [scenario_rows(scenario, r, world) for r in range(world)], forward)


def bytes_job(rank: int, world: int, layers: int) -> dict:
    """A uniform routing (every expert gets BYTES_TOKENS * TOP_K / E rows of every rank) through `layers` MoEs,
    forward and backward, counting the bytes each row all-to-all sends to the other ranks."""
    sent = []
    original = dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        if input.is_floating_point():  # the rows, not the int64 counts
            me, n = dist.get_rank(group), dist.get_world_size(group)
            splits = input_split_sizes or [input.shape[0] // n] * n
            row_bytes = input[0].numel() * input.element_size() if len(input) else 0
            sent.append(sum(s for peer, s in enumerate(splits) if peer != me) * row_bytes)
        return original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    dist.all_to_all_single = counting
    try:
        models = [ep_moe(world) for _ in range(layers)]
        rows = seeded(400 + rank, BYTES_TOKENS * TOP_K, DIM).requires_grad_()
        counts = torch.full((E,), BYTES_TOKENS * TOP_K // E, dtype=torch.int64)
        out = rows
        for model in models:
            out = model.routed(out, counts)
        out.sum().backward()
    finally:
        dist.all_to_all_single = original
    return dict(sent=sum(sent), calls=len(sent))


def apply_ep_job(rank: int, world: int) -> dict:
    """apply_ep on a meta model with two MoE layers and a look-alike that is no MoELayer (left alone); off meta, the
    local slices of the full weights; a number of experts the EP degree does not divide, and an MoE layer without
    expert stacks (both refused, before anything changes)."""
    mesh = ep_mesh(world)
    model = nn.ModuleDict(
        dict(
            a=TinyMoE(full_weights()),
            b=TinyMoE(full_weights()),
            no_dispatcher=nn.Module(),
        )
    )
    model["no_dispatcher"].experts = TinyExperts(full_weights())
    model["b"].experts.w2.requires_grad_(False)
    model.to("meta")
    changed = apply_ep(model, mesh)
    params = {
        f"{m}.{k}": dict(
            dtensor=isinstance(p, DTensor),
            parameter=isinstance(p, nn.Parameter),
            placements=tuple(getattr(p, "placements", ())),
            local_shape=tuple(local(p).shape),
            meta=local(p).is_meta,
            requires_grad=p.requires_grad,
        )
        for m in ("a", "b", "no_dispatcher")
        for k, p in model[m].experts._parameters.items()
    }
    dispatchers = {m: type(model[m].dispatcher).__name__ for m in ("a", "b")}
    flat = nn.ModuleDict(dict(ok=TinyMoE(full_weights()), not_3d=TinyMoE(full_weights()))).to("meta")
    flat["not_3d"].experts = nn.Linear(DIM, DIM, device="meta")
    try:
        apply_ep(flat, mesh)
        flat_error = None
    except ValueError as e:
        flat_error = str(e)
    flat_untouched = type(flat["ok"].dispatcher).__name__ == "IdentityDispatcher"

    real = TinyMoE(full_weights())
    apply_ep(real, mesh)
    n_local = E // world
    slices_ok = all(
        torch.equal(local(getattr(real.experts, k)).detach(), full_weights()[k][rank * n_local : (rank + 1) * n_local])
        for k in WEIGHTS
    )
    odd = E // world * world - 1  # not divisible by the EP degree
    bad = nn.ModuleDict(dict(layer=TinyMoE(full_weights(odd)))).to("meta")
    try:
        apply_ep(bad, mesh)
        error = None
    except ValueError as e:
        error = str(e)
    # DMuon must be told which ranks hold the same experts: without expert_mesh it refuses the split stacks
    from torch.distributed.device_mesh import init_device_mesh

    from titan_dmuon import dmuon

    mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "ep"))
    split = TinyMoE(full_weights()).to("meta")
    apply_ep(split, mesh2["ep"])
    try:
        dmuon.dedicate_params(split, mesh2["dp"], lambda n, p: p.ndim == 3)
        dmuon_error = None
    except ValueError as e:
        dmuon_error = str(e)
    return dict(
        changed=changed,
        params=params,
        dispatchers=dispatchers,
        flat_error=flat_error,
        flat_untouched=flat_untouched,
        slices_ok=slices_ok,
        error=error,
        odd=odd,
        dmuon_error=dmuon_error,
    )


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_moe_matches_reference(world):
    """(a) outputs and (b) grads of an EP MoE equal the full-weight per-token reference on each rank's tokens."""
    results = run_distributed(moe_job, world, timeout=DEADLINE)
    check(results, moe_reference(world), world)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_empty_routings(world):
    """(c) an expert with no row from some rank, a rank that sends nothing to a peer, a rank with no rows at all
    and one that receives none: no hang, and outputs and grads match."""
    results = run_distributed(rows_job, world, SCENARIOS, timeout=DEADLINE)
    for scenario in SCENARIOS:
        check([r[scenario] for r in results], rows_reference(scenario, world), world, scenario)
    assert len(results[0]["empty_rank"]["out"]) == 0


@pytest.mark.slow
def test_checkpoint_and_no_grad():
    """(d) activation checkpointing around dispatch -> experts -> combine (its recompute after the dispatcher's
    state was overwritten) leaves outputs and grads unchanged; no_grad gives the same output."""
    world = 2
    results = run_distributed(checkpoint_job, world, timeout=DEADLINE)
    for r in results:
        for k, v in r["plain"].items():
            close(r["ckpt"][k], v, 0, f"checkpointed {k}")
        close(r["no_grad_out"], r["plain"]["out"], 0, "no_grad out")
    # plain, checkpointed forward, no_grad on other tokens, the recompute in backward, no_grad: the recompute ran
    for rank, r in enumerate(results):
        rows = TOKENS * TOP_K
        assert r["dispatch_rows"] == [rows, rows, (rank + 1) * TOP_K, rows, rows], r["dispatch_rows"]
    check([r["ckpt"] for r in results], moe_reference(world), world)


@pytest.mark.slow
def test_apply_ep_meta():
    """(e) on meta: 3-D expert params -> DTensor Shard(0) params of local shape [E/ep, ...] (requires_grad kept),
    dispatchers replaced; look-alikes untouched; off meta each rank holds its slice; non-divisible E raises."""
    world = 2
    results = run_distributed(apply_ep_job, world, timeout=DEADLINE)
    full = full_weights()
    for r in results:
        assert r["changed"] == 2
        assert r["dispatchers"] == dict(a="AllToAllDispatcher", b="AllToAllDispatcher")
        assert r["flat_error"] == "not_3d: an MoE layer whose experts hold no 3-D expert stack", r["flat_error"]
        assert r["flat_untouched"], "every layer is checked before any is changed"
        for name, info in r["params"].items():
            module, k = name.split(".")
            if module == "no_dispatcher":
                assert not info["dtensor"] and info["local_shape"] == tuple(full[k].shape), name
                continue
            assert info["dtensor"] and info["parameter"] and info["meta"], name
            assert info["placements"] == (Shard(0),), name
            assert info["local_shape"] == (E // world, *full[k].shape[1:]), name
            assert info["requires_grad"] == (name != "b.w2"), name
        assert r["slices_ok"]
        assert r["error"] is not None, "a non-divisible number of experts must raise"
        for part in ("layer", f"{r['odd']} experts", f"expert-parallel degree {world}"):
            assert part in r["error"], r["error"]
        assert r["dmuon_error"] is not None and "pass expert_mesh=" in r["dmuon_error"], r["dmuon_error"]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_bytes(world):
    """(f) the formula against the bytes the row all-to-alls carry to other ranks (forward and backward) when
    every rank sends exactly BYTES_TOKENS * TOP_K / ep rows to each rank."""
    layers = 2
    results = run_distributed(bytes_job, world, layers, timeout=DEADLINE)
    expected = all_to_all_bytes(BYTES_TOKENS, TOP_K, DIM, world, 4, layers)  # fp32 rows
    for r in results:
        assert r["calls"] == 4 * layers
        assert r["sent"] == pytest.approx(expected, rel=1e-12)


def test_all_to_all_bytes_formula():
    assert all_to_all_bytes(1024, 2, 64, 1, 2, 3) == 0.0
    assert all_to_all_bytes(1024, 2, 64, 4, 2, 3) == pytest.approx(4 * 3 * 1024 * 2 * 64 * 2 * 3 / 4)
    with pytest.raises(ValueError):
        all_to_all_bytes(1, 1, 1, 0, 1, 1)
