"""The MoE families through the trainer on every expert layout, against a single-process reference written here.

Each run is the trainer itself (`Trainer.train_step`, in process on real gloo ranks) on the qwen3 `tinymodel_moe`
flavor: 4 ranks as FSDP 4, EP 2 x FSDP 2 (also with full activation checkpointing), EP 2 inside HSDP 2 x 2
(replicate 2 x shard 2) and EP 2 x TP 2, with dmuon, and EP 2 x FSDP 2 and EP 4 with muon_naive; and on the
deepseek_v3 `tinymodel` flavor (multi-head latent attention, a dense first layer, DeepSeekMoE's sigmoid
group-limited router and its shared expert): 1 process, FSDP 4, EP 2 x FSDP 2 and EP 2 x TP 2 with dmuon, and
EP 2 x FSDP 2 and EP 2 x TP 2 with muon_naive. Every DP rank trains on its own token batch of each step.

The reference is one process, one plain model (the same initial weights, read from rank 0), the DP ranks'
batches as micro-batches (each loss / n_dp, the MoE auxiliary loss scaled alike), `torch.optim.Muon` with its
Newton-Schulz in fp32 on every 2D Muon matrix and on **each expert's matrix as a parameter of its own**, and
`torch.optim.AdamW` on the rest; the Muon matrices are the family's `MUON_PARAMS` (the trainer's default), whose
selection `test_reference_selects_the_families_matrices` pins by name. Losses must agree within 1e-5, the grad
norms and every weight within 5e-5, after 8 steps.

`test_an_expert_that_gets_no_token_finishes_and_matches` forces expert 0 of every MoE layer out of every top-k
(its selection bias, the auxiliary-loss-free balancing buffer, at -1e9): it gets no token on any rank, its grad is
zero, and its update is the reference's (momentum of zeros: no step beyond weight decay).
"""

from __future__ import annotations

import importlib
import re

import pytest
import torch
import torch.nn as nn

from tests._dist import run_distributed
from tests.reference import ExpertSlices, fp32_torch_muon
from titan_dmuon.components.moe import moe_layers, moe_stats, update_moe_bias

STEPS, B, T, VOCAB, RTOL, DEADLINE = 8, 2, 16, 258, 5e-5, 300
LOSS_RTOL = 1e-5  # the losses (fp32 Newton-Schulz everywhere); the grad norms and weights within RTOL
HP = {
    "optimizer.muon.lr": 0.02,
    "optimizer.muon.momentum": 0.95,
    "optimizer.muon.nesterov": True,
    "optimizer.muon.weight_decay": 0.1,
    "optimizer.muon.adjust_lr_fn": "match_rms_adamw",
    "optimizer.adamw.lr": 3e-3,
    # AdamW's eps well above the grads' float noise, so that its weights can be compared: an update lr*g/(|g|+eps)
    # moves by up to lr*noise/eps where |g| is near eps, and summation order alone leaves ~1e-8 of noise on an
    # embedding grad (measured: 1e-8 and 1e-6 gave one element 6e-5 of max|W| apart after one step on ep2 x tp2)
    "optimizer.adamw.eps": 1e-4,
    "optimizer.adamw.weight_decay": 0.1,
}
BETAS = (0.9, 0.95)
# model -> (family, flavor)
MODELS = {"qwen3": ("qwen3", "tinymodel_moe"), "deepseek_v3": ("deepseek_v3", "tinymodel")}
LAYOUTS = {
    "1proc": [],
    "fsdp4": [],
    "ep2_fsdp2": ["--parallelism.expert_parallel_degree", "2"],
    "ep2_hsdp2x2": ["--parallelism.expert_parallel_degree", "2", "--parallelism.data_parallel_replicate_degree", "2"],
    "ep2_tp2": ["--parallelism.expert_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"],
    # every block recomputed in backward: the all-to-all and the experts' own DMuon group run again there
    "ep2_fsdp2_full_ac": ["--parallelism.expert_parallel_degree", "2", "--activation_checkpoint.mode", "full"],
}


def _argv(dump, model: str, *extra: str) -> list[str]:
    family, flavor = MODELS[model]
    argv = ["--config", "train_configs/debug_model.toml", "--model.name", family, "--model.flavor", flavor]
    argv += ["--training.seq_len", str(T), "--training.local_batch_size", str(B), "--training.steps", str(STEPS)]
    argv += ["--training.max_norm", "0", "--lr_scheduler.warmup_steps", "0", "--lr_scheduler.decay_ratio", "0"]
    argv += ["--optimizer.muon.ns_coefficients", "muon", "--optimizer.muon.ns_dtype", "float32"]
    argv += ["--optimizer.adamw.betas", str(BETAS[0]), str(BETAS[1])]
    argv += ["--metrics.enable_tensorboard", "false", "--comm.heartbeat_seconds", "0", "--job.dump_folder", str(dump)]
    for key, value in HP.items():
        argv += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return [*argv, *extra]


def _batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    tokens = torch.randint(0, VOCAB, (B, T + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _block_expert_zero(model: nn.Module) -> None:
    """Expert 0 of every MoE layer never selected: its selection bias far below the others."""
    for m in moe_layers(model):
        bias = m.router.expert_bias
        bias = bias.to_local() if hasattr(bias, "to_local") else bias
        bias[0] = -1e9


def _rank(rank: int, world: int, dump: str, model: str, extra: list[str], empty: bool, steps: int = STEPS) -> dict:
    from titan_dmuon import dmuon
    from titan_dmuon.config import parse_args
    from titan_dmuon.trainer import Trainer

    trainer = Trainer(parse_args(_argv(f"{dump}/r{rank}", model, *extra)))
    try:
        model = trainer.model
        if empty:
            _block_expert_zero(model)
        full = trainer.optimizer_component.name == "dmuon"
        sd0 = dmuon.get_model_state_dict(model) if full else _full_fsdp(model)
        losses, norms = [], []
        for step in range(steps):
            loss, norm, _ = trainer.train_step(iter([_batch(step, trainer.dp_rank)]))
            losses.append(loss)
            norms.append(norm)
        sd = dmuon.get_model_state_dict(model) if full else _full_fsdp(model)
        keep = rank == 0
        return {
            "sd0": sd0 if keep else None,
            "sd": sd if keep else None,
            "losses": losses,
            "norms": norms,
            "n_dp": trainer.dp_world_size,
        }
    finally:
        trainer.close()


def _full_fsdp(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()
    }


# ------------------------------------------------------------------------------------------- the reference
def _family(model: str):
    family, flavor = MODELS[model]
    return importlib.import_module(f"titan_dmuon.models.{family}"), flavor


def _selection(model: str) -> tuple[nn.Module, list[str], list[str], list[str]]:
    """The reference's model and the names it gives Muon as matrices, as expert stacks, and AdamW: the family's
    Muon regex (the trainer's default) on the plain model."""
    family, flavor = _family(model)
    net = family.build_model(flavor, vocab_size=VOCAB, max_seq_len=T, device="cpu")
    net.init_buffers("cpu")
    regex = re.compile(family.MUON_PARAMS)
    names = [n for n, _ in net.named_parameters()]
    shapes = dict(net.named_parameters())
    matrices = [n for n in names if regex.search(n) and shapes[n].ndim == 2]
    stacks = [n for n in names if regex.search(n) and shapes[n].ndim == 3]
    others = [n for n in names if not regex.search(n)]
    return net, matrices, stacks, others


def reference(model_name: str, sd0: dict[str, torch.Tensor], n_dp: int, empty: bool, steps: int = STEPS) -> dict:
    family, _ = _family(model_name)
    model, matrix_names, stack_names, other_names = _selection(model_name)
    model.init_buffers("cpu")
    model.load_state_dict(sd0)
    if empty:
        _block_expert_zero(model)
    for m in moe_layers(model):
        m.aux_loss_scale = 1.0 / n_dp
    named = dict(model.named_parameters())
    matrices = [named[n] for n in matrix_names]
    experts = ExpertSlices(named, set(stack_names).__contains__)
    others = [named[n] for n in other_names]
    muon = torch.optim.Muon(
        matrices + experts.params,
        lr=HP["optimizer.muon.lr"],
        momentum=HP["optimizer.muon.momentum"],
        nesterov=True,
        weight_decay=HP["optimizer.muon.weight_decay"],
        adjust_lr_fn="match_rms_adamw",
    )
    adamw = torch.optim.AdamW(
        others,
        lr=HP["optimizer.adamw.lr"],
        betas=BETAS,
        eps=HP["optimizer.adamw.eps"],
        weight_decay=HP["optimizer.adamw.weight_decay"],
    )
    losses, norms = [], []
    with fp32_torch_muon():
        for step in range(steps):
            total = 0.0
            for r in range(n_dp):
                inputs, labels = _batch(step, r)
                loss = family.SPEC.loss_fn(model(inputs), labels) / n_dp
                loss.backward()
                total += loss.item()
            norms.append(float(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]).norm()))
            experts.take_grads()
            muon.step()
            adamw.step()
            muon.zero_grad()
            adamw.zero_grad()
            experts.write_back()
            counts = moe_stats(model)["tokens_per_expert"]
            update_moe_bias(model, counts.to(torch.float64))
            losses.append(total)
    return {"losses": losses, "norms": norms, "sd": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _check(results: list[dict], model: str, empty: bool = False) -> None:
    ref = reference(model, results[0]["sd0"], results[0]["n_dp"], empty)
    for got in results:
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=LOSS_RTOL, atol=0)
        # the grad norm sees a grad's scale, which AdamW's and Muon's updates do not
        torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(ref["norms"]), rtol=RTOL, atol=0)
    sd = results[0]["sd"]
    assert set(sd) == set(ref["sd"]), set(sd) ^ set(ref["sd"])
    for k, want in ref["sd"].items():
        if not want.is_floating_point():
            continue
        err = float((sd[k].float() - want.float()).abs().max()) / max(float(want.abs().max()), 1e-12)
        assert err < RTOL, (k, err)
    return ref


def test_reference_selects_the_families_matrices() -> None:
    """The reference's Muon/AdamW split, by name: every block matrix (DeepSeek-V3: MLA's down and up projections and
    wo, the dense and the shared SwiGLU) a 2D Muon matrix, the routed experts' stacks one matrix per expert, the
    router's gate, the norms, the embedding and the output on AdamW."""
    _, matrices, stacks, others = _selection("deepseek_v3")
    mla = [f"layers.{i}.attention.{w}.weight" for i in (0, 1) for w in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo")]
    dense = [f"layers.0.feed_forward.{w}.weight" for w in ("w1", "w2", "w3")]
    shared = [f"layers.1.feed_forward.shared_experts.{w}.weight" for w in ("w1", "w2", "w3")]
    assert sorted(matrices) == sorted(mla + dense + shared)
    assert sorted(stacks) == [f"layers.1.feed_forward.experts.{w}" for w in ("w1", "w2", "w3")]
    norms = [f"layers.{i}.{n}.weight" for i in (0, 1) for n in ("attention_norm", "ffn_norm")]
    norms += [f"layers.{i}.attention.{n}.weight" for i in (0, 1) for n in ("q_norm", "kv_norm")]
    gate = ["layers.1.feed_forward.router.gate.weight"]
    assert sorted(others) == sorted(["tok_embeddings.weight", "norm.weight", "output.weight", *norms, *gate])
    _, matrices, stacks, others = _selection("qwen3")
    assert all(".attention." in n or ".feed_forward." in n for n in matrices)
    assert stacks and all(".feed_forward.experts." in n for n in stacks)
    assert "layers.0.feed_forward.router.gate.weight" in others


# (model, layout): every layout on qwen3; on deepseek_v3 one process, FSDP, EP x FSDP and EP x TP
DMUON_CASES = [("qwen3", layout) for layout in LAYOUTS if layout != "1proc"]
DMUON_CASES += [("deepseek_v3", layout) for layout in ("1proc", "fsdp4", "ep2_fsdp2", "ep2_tp2")]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "layout"), DMUON_CASES, ids=[f"{m}-{la}" for m, la in DMUON_CASES])
def test_dmuon_layout_matches_reference(model, layout, tmp_path) -> None:
    nproc = 1 if layout == "1proc" else 4
    results = run_distributed(_rank, nproc, str(tmp_path), model, LAYOUTS[layout], False, timeout=DEADLINE)
    _check(results, model)


NAIVE_CASES = [("qwen3", "ep2_fsdp2"), ("qwen3", "ep4_fsdp1"), ("deepseek_v3", "ep2_fsdp2"), ("deepseek_v3", "ep2_tp2")]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "layout"), NAIVE_CASES, ids=[f"{m}-{la}" for m, la in NAIVE_CASES])
def test_muon_naive_matches_reference(model, layout, tmp_path) -> None:
    """FSDP2 units for the expert stacks over the expert-DP ranks (2, and 1: every shard rank an EP rank)."""
    extra = {"ep2_fsdp2": LAYOUTS["ep2_fsdp2"], "ep4_fsdp1": ["--parallelism.expert_parallel_degree", "4"]}
    extra["ep2_tp2"] = LAYOUTS["ep2_tp2"]
    results = run_distributed(
        _rank, 4, str(tmp_path), model, [*extra[layout], "--optimizer.name", "muon_naive"], False, timeout=DEADLINE
    )
    _check(results, model)


@pytest.mark.slow
def test_an_expert_that_gets_no_token_finishes_and_matches(tmp_path) -> None:
    results = run_distributed(_rank, 4, str(tmp_path), "qwen3", LAYOUTS["ep2_fsdp2"], True, timeout=DEADLINE)
    ref = _check(results, "qwen3", empty=True)
    assert ref is not None
