"""The TP gather from the backward (docs/dmuon.md, "The TP gather") on 4 gloo ranks, against a single-process
torch.optim.Muon + AdamW reference that shares no DMuon code.

Each run trains a TinyLlama (every projection TP-sharded) with what users write around a step: 2 accumulated
micro-batches (on even steps the first under `dmuon.no_sync`, on odd steps both backwards reduce, so the second
replaces the first one's gather), `dmuon.clip_grad_norm_` at a max norm that clips every step, a learning rate that
changes every step, and a resume in the middle through DCP into a fresh model and optimizer whose `tp_gather` may
differ from the saving run's (a checkpoint of the "step" path, momentum on the shards, loads into the "backward"
path, momentum whole on the TP owner, and back). Losses, global grad norms, weights and the momentum after every
step match the reference at 5e-5 (fp32 NS) on dp2 x tp2, replicate2 x shard1 x tp2 and DDP + TP.

What a wrong gather would show: a gather of the first micro-batch's partial sum (the loss and weights drift from
step 1), a clip factor lost on the TP owner (the update is the same after NS, but the momentum, which integrates
unnormalized grads, is not), a momentum left on the shards or saved in another layout (the resumed run drifts).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from tests._dist import rank_device, run_distributed
from tests.distributed.test_dmuon_per_head import BLOCKS
from tests.distributed.test_dmuon_per_head import OPTIONS as PER_HEAD
from tests.dmuon_harness import HP, assert_matches_reference, build_muon, owner_momentum, shard_blocks
from tests.dmuon_tp_harness import FF, HEADS, LAYERS, B, D, T
from tests.reference import assert_rel_close, fp32_torch_muon, momentum_buffers, reference_optimizers
from tests.tiny_models import TinyLlama, apply_llama_tp, proj_predicate, seq_batch
from tests.unit.dmuon.test_per_head import PerHeadReference

STEPS, ACCUM, RESUME_AT, SKIPPED, RTOL, DEADLINE = 6, 2, 3, 1, 5e-5, 300
MAX_NORM = 0.02  # below every step's global grad norm here: each step clips (checked on the reference)
LAYOUTS = {"dp_tp": (2, 2), "3d": (2, 1, 2), "ddp_tp": (2, 2)}
# The trace's model: a group's reduce completes (and its gathers are issued) once two later groups have reduced
# (docs/dmuon.md, "The TP gather"), and the first block, whose input needs no grad, reduces in the end-of-backward
# callback: the gathers of the first three blocks are issued at the end of the backward, the others' before the
# backward of the blocks below them.
TRACE_LAYERS = 6


def lr_factor(step: int) -> float:
    return 1.0 / (1 + step)


def reference(dp_size: int, per_head: bool) -> dict:
    """One process, the DP ranks' micro-batches concatenated, each micro-batch's loss divided by ACCUM; step
    SKIPPED is left out after its backward (the loop's guard, e.g. against a non-finite loss: zero_grad, no step);
    `per_head`: torch.optim.Muon on every head block of BLOCKS as a parameter of its own."""
    torch.manual_seed(0)
    model = TinyLlama(D, FF, HEADS, LAYERS)
    if per_head:
        ref = PerHeadReference(model, proj_predicate, BLOCKS, **HP)
        muon, adamw = ref.muon, ref.adamw
    else:
        muon, adamw = reference_optimizers(model, proj_predicate, **HP)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lr_factor) for o in (muon, adamw)]
    losses, norms, momentum = [], [], []
    with fp32_torch_muon():
        for step in range(STEPS):
            loss = 0.0
            for m in range(ACCUM):
                x = torch.cat([seq_batch(step * ACCUM + m, r, B, T, D) for r in range(dp_size)])
                micro = model(x) / ACCUM
                micro.backward()
                loss += micro.item()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
            if step != SKIPPED:
                if per_head:
                    ref.step()
                else:
                    muon.step()
                    adamw.step()
                for sched in schedules:
                    sched.step()
            momentum.append(ref.momentum() if per_head else momentum_buffers(model, muon))
            model.zero_grad()
            losses.append(loss)
    return dict(losses=losses, norms=norms, momentum=momentum, sd={k: v.clone() for k, v in model.state_dict().items()})


def _build(
    layout: str,
    shape: tuple[int, ...],
    tp_gather: str,
    layers: int = LAYERS,
    per_head: bool = False,
    replicate_async: bool = True,
):
    """(model, optimizer, lr schedule, this rank's DP coordinate) of `layout`, TP applied first; `per_head`: the
    head blocks of BLOCKS."""
    from torch.distributed.device_mesh import init_device_mesh

    from titan_dmuon import dmuon

    torch.manual_seed(0)
    device = rank_device()
    model = TinyLlama(D, FF, HEADS, layers).to(device)
    blocks = {"head_blocks": BLOCKS} if per_head else {}
    if layout == "3d":
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard", "tp"))
        apply_llama_tp(model, mesh["tp"])
        dmuon.dedicate_params(model, mesh["shard"], proj_predicate, replicate_mesh=mesh["replicate"], **blocks)
        dp_mesh = mesh["replicate", "shard"]
        shard_blocks(model, dp_mesh)
    else:
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("dp", "tp"))
        apply_llama_tp(model, mesh["tp"])
        dp_mesh = mesh["dp"]
        if layout == "dp_tp":
            dmuon.dedicate_params(model, dp_mesh, proj_predicate, **blocks)
            shard_blocks(model, dp_mesh)
        else:
            dmuon.dedicate_params_ddp_tp(model, dp_mesh, proj_predicate, **blocks)
            dmuon.replicate_tp(model, dp_mesh)
    opt = build_muon(model, PER_HEAD if per_head else None, tp_gather=tp_gather, replicate_async=replicate_async)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    coord = dp_mesh.get_coordinate()
    dp_rank = coord[0] if len(coord) == 1 else coord[0] * dp_mesh.size(1) + coord[1]
    return model, opt, sched, dp_rank


def gather_train(
    rank: int,
    world_size: int,
    layout: str,
    shape: tuple[int, ...],
    modes: tuple[str, str],
    path: str,
    per_head: bool = False,
    replicate_async: bool = True,
):
    """Steps 0..RESUME_AT on `tp_gather=modes[0]`, a DCP save, then a fresh model and optimizer on `modes[1]` loads
    it and trains the remaining steps; step SKIPPED is left out after its backward (zero_grad, no step). Per
    step: the loss, the global grad norm, this rank's owner momentum."""
    import torch.distributed.checkpoint as dcp

    from titan_dmuon import dmuon

    kwargs = dict(per_head=per_head, replicate_async=replicate_async)
    model, opt, sched, dp_rank = _build(layout, shape, modes[0], **kwargs)
    st = model._dmuon_state
    gather_path = sorted(dp.fqn for dp in st.dparams if dp.is_owner and dp.tp_full_momentum)
    losses, norms, momentum, gathered_in_backward = [], [], [], []
    for step in range(STEPS):
        if step == RESUME_AT + 1:
            sd = {
                "model": dmuon.get_model_state_dict(model, full_state_dict=False),
                "optimizer": dmuon.get_optimizer_state_dict(model, opt, full_state_dict=False),
                "sched": sched.state_dict(),
            }
            dcp.save(sd, checkpoint_id=path)
            del model, opt, sched, sd
            model, opt, sched, dp_rank = _build(layout, shape, modes[1], **kwargs)
            st = model._dmuon_state
            gather_path = gather_path or sorted(dp.fqn for dp in st.dparams if dp.is_owner and dp.tp_full_momentum)
            sd = {
                "model": dmuon.get_model_state_dict(model, full_state_dict=False),
                "optimizer": dmuon.get_optimizer_state_dict(model, opt, full_state_dict=False),
                "sched": sched.state_dict(),
            }
            dcp.load(sd, checkpoint_id=path)
            dmuon.set_model_state_dict(model, sd["model"], full_state_dict=False)
            dmuon.set_optimizer_state_dict(model, opt, sd["optimizer"], full_state_dict=False)
            sched.load_state_dict(sd["sched"])
        loss = torch.zeros(())
        for m in range(ACCUM):
            first_no_sync = step % 2 == 0 and m < ACCUM - 1
            with dmuon.no_sync(model) if first_no_sync else contextlib.nullcontext():
                micro = model(seq_batch(step * ACCUM + m, dp_rank, B, T, D).to(rank_device())) / ACCUM
                micro.backward()
            loss += micro.detach().cpu()
        # the gathers the backward issued: on every DP owner of a TP matrix on the gather path of the "backward" mode
        gathered_in_backward.append(sorted(dp.fqn for dp in st.dparams if dp._tp_gather is not None))
        norms.append(dmuon.clip_grad_norm_(model, opt, max_norm=MAX_NORM).item())
        if step != SKIPPED:
            opt.step()
            sched.step()
        momentum.append(owner_momentum(model, opt))
        opt.zero_grad()
        dist.all_reduce(loss)
        losses.append(loss.item() / world_size)
    return dict(
        losses=losses,
        norms=norms,
        momentum=momentum,
        gathered=gathered_in_backward,
        gather_path=gather_path,
        sd=dmuon.get_model_state_dict(model),
    )


@pytest.fixture(scope="module")
def references() -> dict[bool, dict]:
    refs = {per_head: reference(2, per_head) for per_head in (False, True)}
    for ref in refs.values():
        assert min(ref["norms"]) > MAX_NORM * 1.5, ref["norms"]  # every step clips
    return refs


# (layout, the saving run's tp_gather, the resumed run's, per-head): the old path's checkpoint into the new path
# and back; per-head blocks on dp2 x tp2 (gate's cross its TP shards: gather, NS per block; the others are local)
CASES = [
    ("dp_tp", ("step", "backward"), False),
    ("3d", ("backward", "step"), False),
    ("ddp_tp", ("backward", "backward"), False),
    ("dp_tp", ("backward", "backward"), True),
]


def _check_parity(results: list[dict], ref: dict, what: str) -> None:
    """`assert_matches_reference` at RTOL, and the full state dict of every rank, not only rank 0's."""
    assert_matches_reference(results, ref, RTOL)
    for r in results[1:]:
        for k, v in ref["sd"].items():
            assert_rel_close(r["sd"][k], v, RTOL, f"{what} {k}")


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout,modes,per_head", CASES, ids=[f"{c[0]}-{c[1][0]}-to-{c[1][1]}{'-per_head' * c[2]}" for c in CASES]
)
def test_tp_gather_matches_torch_muon_with_accumulation_clip_and_resume(layout, modes, per_head, references, tmp_path):
    results = run_distributed(
        gather_train, 4, layout, LAYOUTS[layout], modes, str(tmp_path / "ckpt"), per_head, timeout=DEADLINE
    )
    _check_parity(results, references[per_head], layout)
    for r in results:
        mode_of = [modes[0] if step <= RESUME_AT else modes[1] for step in range(STEPS)]
        for step, mode in enumerate(mode_of):
            # the TP matrices on the gather path: their DP owners gathered them from the backward, or not at all
            want = r["gather_path"] if mode == "backward" else []
            assert r["gathered"][step] == want, (step, mode)
        assert r["gather_path"], "this rank owns no TP matrix on the gather path: the layout does not test it"


@pytest.mark.slow
def test_async_tp_tail_is_bitwise_the_synchronous_publish(tmp_path):
    """The deferred TP tail (scatter wait, update, publish in the next forward) against `replicate_async=False`
    (all of it inside `step()`, as the design's synchronous publish) on replicate2 x shard1 x tp2 with per-head
    blocks, accumulation, clipping, a skipped step and a resume: losses, weights and momentum bitwise equal."""
    runs = [
        run_distributed(
            gather_train,
            4,
            "3d",
            LAYOUTS["3d"],
            ("backward", "backward"),
            str(tmp_path / f"ckpt{a}"),
            True,
            a,
            timeout=DEADLINE,
        )
        for a in (True, False)
    ]
    for async_rank, sync_rank in zip(*runs, strict=True):
        assert async_rank["losses"] == sync_rank["losses"]
        assert async_rank["norms"] == sync_rank["norms"]
        for k, v in sync_rank["sd"].items():
            assert torch.equal(async_rank["sd"][k], v), k
        for a, b in zip(async_rank["momentum"], sync_rank["momentum"], strict=True):
            assert a.keys() == b.keys()
            for k in a:
                assert torch.equal(a[k][3], b[k][3]), k


def traced_step(rank: int, world_size: int, tp_gather: str, folder: str) -> dict:
    """Two dp2 x tp2 steps of a TRACE_LAYERS-block TinyLlama (one accumulated micro-batch under no_sync, then the
    last one), the second under torch.profiler with each backward call in a "test/backward" range and the step in
    "test/step"; its chrome trace, one file per rank."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from titan_dmuon import dmuon

    model, opt, _, dp_rank = _build("dp_tp", LAYOUTS["dp_tp"], tp_gather, layers=TRACE_LAYERS)
    st = model._dmuon_state

    def step(key: int) -> None:
        for m in range(ACCUM):
            with dmuon.no_sync(model) if m < ACCUM - 1 else contextlib.nullcontext():
                loss = model(seq_batch(key * ACCUM + m, dp_rank, B, T, D).to(rank_device())) / ACCUM
                with record_function("test/backward"):
                    loss.backward()
        dmuon.clip_grad_norm_(model, opt, max_norm=MAX_NORM)
        with record_function("test/step"):
            opt.step()
        opt.zero_grad()

    step(0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(1)
    path = f"{folder}/rank{rank}.json"
    prof.export_chrome_trace(path)
    owned = [dp.fqn for dp in st.dparams if dp.is_owner and dp.tp_group is not None]
    late = [f for f in owned if int(f.split(".")[1]) >= TRACE_LAYERS // 2]  # the blocks the backward reaches first
    return dict(path=path, tp_owned=len(owned), early_in_backward=len(late))


def _ranges(path: str, name: str) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every complete event called `name` in a chrome trace."""
    import json

    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == name and e.get("ph") == "X")


@pytest.mark.slow
@pytest.mark.parametrize("tp_gather", ["backward", "step"])
def test_trace_shows_every_tp_gather_issued_inside_the_last_backward(tp_gather, tmp_path):
    """The gathers of a dp2 x tp2 step, from the chrome trace of each rank: with "backward" every one is issued
    inside the last backward of the step (the one that reduces), and those of the upper half of the blocks (the
    first the backward reaches) before autograd nodes that follow them, so they overlap the rest of the backward;
    with "step" they are issued inside `step()`."""
    from titan_dmuon.dmuon import trace

    results = run_distributed(traced_step, 4, tp_gather, str(tmp_path), timeout=DEADLINE)
    for rank, r in enumerate(results):
        backwards = _ranges(r["path"], "test/backward")
        (step,) = _ranges(r["path"], "test/step")
        gathers = _ranges(r["path"], trace.TP_GATHER)
        assert r["tp_owned"] > 0 and len(gathers) == r["tp_owned"], (rank, r["tp_owned"], gathers)
        assert len(backwards) == ACCUM
        last = backwards[-1]
        if tp_gather == "step":
            assert all(step[0] <= s and e <= step[1] for s, e in gathers), (rank, gathers, step)
            continue
        assert all(last[0] <= s and e <= last[1] for s, e in gathers), (rank, gathers, last)
        nodes = [s for s, _ in _ranges_prefix(r["path"], "autograd::engine::evaluate_function") if s < last[1]]
        overlapped = [g for g in gathers if any(n > g[1] for n in nodes)]
        assert r["early_in_backward"] > 0 and len(overlapped) >= r["early_in_backward"], (rank, len(overlapped), r)
        waits = _ranges(r["path"], trace.TP_GATHER_WAIT)
        assert waits and all(step[0] <= s for s, _ in waits), (rank, waits, step)  # consumed by the step


def _ranges_prefix(path: str, prefix: str) -> list[tuple[float, float]]:
    """`_ranges` of every complete event whose name starts with `prefix`."""
    import json

    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if str(e.get("name", "")).startswith(prefix) and e.get("ph") == "X"
    )
