"""DMuon's sharded checkpoint state through torch.distributed.checkpoint (DCP) on real gloo ranks
(docs/dmuon.md, "Checkpoints"): a save on 4 ranks of 1D FSDP writes each dedicated matrix and its momentum once,
from its owner, and no rank's state holds a full copy of a matrix it does not own; the checkpoint loads onto 2
ranks 1D, HSDP 2x2, dp2 x tp2 (FSDP and DDP), torch DDP and one process with the weights, Muon momentum, AdamW moments,
steps and hyper-parameters as saved (against full tensors gathered by the full getters of the saving run), and
one more step after the load equals one more step of the uninterrupted run."""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_distributed
from tests.dmuon_harness import build_muon, shard_blocks
from tests.reference import assert_rel_close
from tests.tiny_models import TinyLlama, apply_llama_tp, proj_predicate, seq_batch

D, FF, HEADS, LAYERS, B, T = 32, 64, 4, 4, 2, 8  # 4 blocks: every rank of the saving run owns one
SAVE_WORLD, SAVE_STEPS = 4, 3  # the global batch is SAVE_WORLD chunks of B sequences, whatever the layout
LR_FACTOR = 0.5  # the saving run scales every group's lr before saving: the loaded groups must carry it

pytestmark = pytest.mark.slow


def _build(layout: str, shape: tuple[int, ...]):
    """(model, optimizer, DP rank, DP size) for `layout`: "fsdp" (1D), "hsdp" (replicate, shard), "dp_tp",
    "torch_ddp" (dedicate_params_ddp + torch's DistributedDataParallel)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from titan_dmuon import dmuon

    torch.manual_seed(0)
    model = TinyLlama(D, FF, HEADS, LAYERS)
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("shard",))
        dmuon.dedicate_params(model, mesh, proj_predicate)
        shard_blocks(model, mesh)
        dp_rank, dp_size = mesh.get_local_rank(), mesh.size()
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        dmuon.dedicate_params(model, mesh["shard"], proj_predicate, replicate_mesh=mesh["replicate"])
        shard_blocks(model, mesh)
        dp_rank, dp_size = dist.get_rank(), dist.get_world_size()
    elif layout == "dp_tp":
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
        apply_llama_tp(model, mesh["tp"])
        dmuon.dedicate_params(model, mesh["dp"], proj_predicate)
        shard_blocks(model, mesh["dp"])
        dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh.size(0)
    elif layout == "ddp_tp":
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
        apply_llama_tp(model, mesh["tp"])
        dmuon.dedicate_params_ddp_tp(model, mesh["dp"], proj_predicate)
        dmuon.replicate_tp(model, mesh["dp"])
        dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh.size(0)
    elif layout == "torch_ddp":
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp",))
        dmuon.dedicate_params_ddp(model, mesh, proj_predicate)
        model = DistributedDataParallel(model, process_group=mesh.get_group())
        dp_rank, dp_size = mesh.get_local_rank(), mesh.size()
    else:
        raise ValueError(layout)
    return model, build_muon(model, replicate_async=True), dp_rank, dp_size


def _step(model, opt, step: int, dp_rank: int, dp_size: int) -> None:
    """One training step on this DP rank's part of the global batch (SAVE_WORLD chunks, split evenly)."""
    per = SAVE_WORLD // dp_size
    x = torch.cat([seq_batch(step, c, B, T, D) for c in range(dp_rank * per, (dp_rank + 1) * per)])
    model(x).backward()
    opt.step()
    opt.zero_grad()


def _sharded(model, opt) -> dict:
    from titan_dmuon import dmuon

    return {
        "model": dmuon.get_model_state_dict(model, full_state_dict=False),
        "optimizer": dmuon.get_optimizer_state_dict(model, opt, full_state_dict=False),
    }


def _full(model, opt) -> tuple[dict, dict]:
    """The full dicts on rank 0 (CPU), `{}` elsewhere: what the comparisons read."""
    from titan_dmuon import dmuon

    return (
        dmuon.get_model_state_dict(model, rank0_only=True, cpu_offload=True),
        dmuon.get_optimizer_state_dict(model, opt, rank0_only=True, cpu_offload=True),
    )


def _assert_equal_full(got: tuple[dict, dict], want: tuple[dict, dict]) -> None:
    """Full (model, optimizer) dicts bitwise equal: weights, every state tensor, the param groups."""
    (got_model, got_opt), (model_sd, opt_sd) = got, want
    assert set(got_model) == set(model_sd)
    for k, v in model_sd.items():
        assert torch.equal(got_model[k], v), k
    if not opt_sd:
        assert got_opt == {}
        return
    assert set(got_opt["state"]) == set(opt_sd["state"])
    for fqn, entry in opt_sd["state"].items():
        assert set(got_opt["state"][fqn]) == set(entry), fqn
        for key, v in entry.items():
            assert torch.equal(torch.as_tensor(got_opt["state"][fqn][key]), torch.as_tensor(v)), (fqn, key)
    assert got_opt["param_groups"] == opt_sd["param_groups"]


def _holdings(model, sd: dict) -> dict:
    """What this rank's sharded dict holds: the dedicated keys (model and momentum) and, for every other
    tensor, whether it is a DTensor smaller than the full tensor."""
    from torch.distributed.tensor import DTensor

    from titan_dmuon.dmuon.param import local_of
    from titan_dmuon.dmuon.state import state_of

    st = state_of(model, "tests")
    dedicated = {dp.fqn: dp for dp in st.dparams}
    out = dict(model=set(), momentum=set(), full_elsewhere=[], column=set(), owner=set())
    for dp in st.dparams:
        if dp.in_owner_column:
            out["column"].add(dp.fqn)
        if dp.is_owner:
            out["owner"].add(dp.fqn)
    for fqn, v in sd["model"].items():
        if fqn in dedicated:  # the master: this rank's TP shard at most (a DTensor over the TP mesh under TP)
            out["model"].add(fqn)
            assert local_of(v).shape == dedicated[fqn]._orig_size and v.shape == dedicated[fqn].full_shape, fqn
        elif not isinstance(v, DTensor) or v.to_local().numel() >= v.numel():
            out["full_elsewhere"].append(fqn)
    for fqn, entry in sd["optimizer"]["state"].items():
        if fqn in dedicated:
            out["momentum"].add(fqn)
        else:
            for key, v in entry.items():
                if v.ndim > 0 and (not isinstance(v, DTensor) or v.to_local().numel() >= v.numel()):
                    out["full_elsewhere"].append(f"{fqn}.{key}")
    return out


def _save(rank: int, world_size: int, path: str, layout: str = "fsdp", shape: tuple[int, ...] = (SAVE_WORLD,)) -> dict:
    import torch.distributed.checkpoint as dcp

    from titan_dmuon import dmuon

    model, opt, dp_rank, dp_size = _build(layout, shape)
    for step in range(SAVE_STEPS):
        _step(model, opt, step, dp_rank, dp_size)
    for group in opt.param_groups:
        group["lr"] *= LR_FACTOR
    sd = _sharded(model, opt)
    holdings = _holdings(model, sd)
    dcp.save(sd, checkpoint_id=path)
    saved = _full(model, opt)
    # the options: rank0_only leaves other ranks' dicts empty; cpu_offload gives CPU tensors equal to the plain ones
    plain = dmuon.get_model_state_dict(model)
    if rank == 0:
        assert set(saved[0]) == set(plain) and all(torch.equal(saved[0][k], plain[k]) for k in plain)
        assert all(v.device.type == "cpu" for v in saved[0].values())
    else:
        assert saved == ({}, {})
    # and the setters take them back from rank 0 alone (broadcast_from_rank0)
    fresh, fresh_opt, _, _ = _build(layout, shape)
    dmuon.set_model_state_dict(fresh, saved[0], broadcast_from_rank0=True)
    dmuon.set_optimizer_state_dict(fresh, fresh_opt, saved[1], broadcast_from_rank0=True)
    _assert_equal_full(_full(fresh, fresh_opt), saved)
    _step(model, opt, SAVE_STEPS, dp_rank, dp_size)
    owned = [dp.fqn for dp in dmuon.get_owned_params(model)]
    return dict(holdings=holdings, saved=saved, after=_full(model, opt), owned=owned)


def _save_hsdp(rank: int, world_size: int, path: str) -> dict:
    import torch.distributed.checkpoint as dcp

    from titan_dmuon import dmuon

    model, opt, dp_rank, dp_size = _build("hsdp", (2, 2))
    for step in range(2):
        _step(model, opt, step, dp_rank, dp_size)
    sd = _sharded(model, opt)
    holdings = _holdings(model, sd)
    dcp.save(sd, checkpoint_id=path)
    return dict(holdings=holdings, owned=[dp.fqn for dp in dmuon.get_owned_params(model)])


def _load(rank: int, world_size: int, path: str, layout: str, shape: tuple[int, ...]) -> dict:
    import torch.distributed.checkpoint as dcp

    from titan_dmuon import dmuon

    model, opt, dp_rank, dp_size = _build(layout, shape)
    sd = _sharded(model, opt)  # a fresh optimizer: the template must hold every state tensor already
    dcp.load(sd, checkpoint_id=path)
    dmuon.set_model_state_dict(model, sd["model"], full_state_dict=False)
    dmuon.set_optimizer_state_dict(model, opt, sd["optimizer"], full_state_dict=False)
    holdings = _holdings(model, sd)
    loaded = _full(model, opt)
    _step(model, opt, SAVE_STEPS, dp_rank, dp_size)
    return dict(holdings=holdings, loaded=loaded, after=_full(model, opt), lrs=[g["lr"] for g in opt.param_groups])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "step-3")
    results = run_distributed(_save, SAVE_WORLD, path)
    return path, results


def _writers(path: str) -> dict[str, set[int]]:
    """DCP key -> the ranks whose files hold (a chunk of) it (FileSystemWriter names rank i's files `__i_*`)."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(path).read_metadata()
    out: dict[str, set[int]] = {}
    for index, info in meta.storage_data.items():
        rank = int(re.match(r"__(\d+)_", os.path.basename(info.relative_path)).group(1))
        out.setdefault(index.fqn, set()).add(rank)
    return out


def test_save_writes_each_matrix_once_from_its_owner(saved):
    path, results = saved
    writers = _writers(path)
    owner_of = {fqn: rank for rank, r in enumerate(results) for fqn in r["owned"]}
    assert len(owner_of) == 7 * LAYERS and set(owner_of.values()) == set(range(SAVE_WORLD))  # every rank owns some
    for fqn, owner in owner_of.items():
        assert writers[f"model.{fqn}"] == {owner}, fqn
        assert writers[f"optimizer.state.{fqn}.momentum_buffer"] == {owner}, fqn
    for rank, r in enumerate(results):
        h = r["holdings"]
        mine = {fqn for fqn, o in owner_of.items() if o == rank}
        assert h["model"] == h["column"] == h["owner"] == mine, rank  # 1D: the column is the owner alone
        assert h["momentum"] == mine, rank
        assert h["full_elsewhere"] == [], rank


LOADS = {
    "fsdp_2": ("fsdp", (2,)),
    "hsdp_2x2": ("hsdp", (2, 2)),
    "dp2_tp2": ("dp_tp", (2, 2)),
    "ddp2_tp2": ("ddp_tp", (2, 2)),
    "torch_ddp_2": ("torch_ddp", (2,)),
    "one_process": ("fsdp", (1,)),
}


@pytest.mark.parametrize("name", list(LOADS))
def test_load_on_another_topology(saved, name):
    path, save_results = saved
    _check_load(save_results, path, *LOADS[name])


def test_tp_save_loads_on_one_process(tmp_path):
    """A dp2 x tp2 save (TP-sharded masters and momentum as DTensors over the TP mesh) loads whole on one process."""
    path = str(tmp_path / "tp")
    _check_load(run_distributed(_save, 4, path, "dp_tp", (2, 2)), path, "fsdp", (1,))


def _check_load(save_results: list[dict], path: str, layout: str, shape: tuple[int, ...]) -> None:
    """Load `path` on `layout`: the saved state back (bitwise), each rank's share only, and the next step equal to
    the saving run's."""
    world = 1
    for n in shape:
        world *= n
    results = run_distributed(_load, world, path, layout, shape)
    _assert_equal_full(results[0]["loaded"], save_results[0]["saved"])
    opt_sd = save_results[0]["saved"][1]
    for rank, r in enumerate(results):  # each rank asked for its share under the new ownership only
        h = r["holdings"]
        assert h["model"] == h["column"] and h["momentum"] == h["owner"], rank
        if layout not in ("torch_ddp", "ddp_tp") and world > 1:  # DDP's share: every (TP-local) replica
            assert h["full_elsewhere"] == [], rank
    assert all(r["lrs"] == [g["lr"] for g in opt_sd["param_groups"]] for r in results)
    # one more step after the load = one more step of the uninterrupted run
    want_model, want_opt = save_results[0]["after"]
    got_model, got_opt = results[0]["after"]
    for k, v in want_model.items():
        assert_rel_close(got_model[k], v, 1e-6, k)
    for fqn, entry in want_opt["state"].items():
        for key, v in entry.items():
            if v.ndim > 0:
                assert_rel_close(got_opt["state"][fqn][key], v, 1e-6, f"{fqn}.{key}")
            else:
                assert torch.equal(got_opt["state"][fqn][key], v), (fqn, key)


def test_hsdp_save_writes_each_matrix_once(tmp_path):
    """HSDP 2x2: every rank of an owner's shard column holds the matrix (DCP writes it once, from one of them),
    only the global owner holds its momentum."""
    path = str(tmp_path / "hsdp")
    results = run_distributed(_save_hsdp, 4, path)
    writers = _writers(path)
    owner_of = {fqn: rank for rank, r in enumerate(results) for fqn in r["owned"]}
    assert len(owner_of) == 7 * LAYERS and len(set(owner_of.values())) == 4
    holders: dict[str, set[int]] = {}
    for rank, r in enumerate(results):
        h = r["holdings"]
        assert h["momentum"] == h["owner"] == {fqn for fqn, o in owner_of.items() if o == rank}, rank
        assert h["model"] == h["column"] and h["full_elsewhere"] == [], rank
        for fqn in h["model"]:
            holders.setdefault(fqn, set()).add(rank)
    for fqn, owner in owner_of.items():
        assert len(holders[fqn]) == 2 and owner in holders[fqn], fqn  # the owner's column: one rank per row
        assert len(writers[f"model.{fqn}"]) == 1 and writers[f"model.{fqn}"] <= holders[fqn], fqn
        assert writers[f"optimizer.state.{fqn}.momentum_buffer"] == {owner}, fqn
