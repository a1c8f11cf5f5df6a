"""QK-clip (MuonClip) through the trainer on every layout, against a single-process reference written here.

Each run is the trainer itself (`Trainer.train_step`, in process on real gloo ranks) with
`optimizer.muon.qk_clip_tau` low enough that heads are clipped on most steps: llama3 `tinymodel_gqa` (grouped-query
attention: 4 query heads over 2 kv heads) and qwen3 `tinymodel` (QK-norm, GQA) on 1 process, FSDP 4, HSDP 2 x 2 and
dp 2 x tp 2 with dmuon; qwen3 `tinymodel_moe` on EP 2 x FSDP 2; deepseek_v3 `tinymodel` (multi-head latent
attention, an MoE layer) on FSDP 4, EP 2 x FSDP 2 and EP 2 x TP 2 with dmuon and on EP 2 x TP 2 with muon_naive;
muon_naive (the clip on FSDP2/TP shards, a step post-hook) on dp 2 x tp 2.

The reference is one process, one plain model (the same initial weights, read from rank 0), the DP ranks' batches
as micro-batches, `torch.optim.Muon` with its Newton-Schulz in fp32 (each expert's matrix a parameter of its own)
plus `torch.optim.AdamW`, and the clip by the Kimi K2 paper's formula on logits this file computes itself: every
call of scaled_dot_product_attention is intercepted and its q·k^T/sqrt(d) (causal) taken per head, S_h the max over
the step's micro-batches, gamma_h = min(1, tau / S_h); then, after the optimizer step, each query head's rows of wq
times gamma_h (GQA: the shared key heads stay), or under a QK-norm the query norm's gain (shared by every head)
times the layer's smallest gamma, or under MLA (the Kimi K2 paper's MuonClip) a head's non-rotary query rows and its
key rows of wkv_b times sqrt(gamma_h), its rotary query rows times gamma_h, its value rows of wkv_b and the shared
rotary key (wkv_a) left alone. Losses, the logged max logits and clipped-head counts, and every weight after 8 steps
must agree within 5e-5. The MLA model's Muon matrices are its family's (MLA's projections, the dense and shared
SwiGLUs, each routed expert's matrix), the others' every attention and feed-forward matrix.
"""

from __future__ import annotations

import importlib
import re
from unittest import mock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests._dist import run_distributed
from tests.reference import ExpertSlices, fp32_torch_muon
from titan_dmuon.components.moe import moe_layers, moe_stats, update_moe_bias

STEPS, B, T, VOCAB, RTOL, DEADLINE = 8, 2, 16, 258, 5e-5, 300
HP = {
    "optimizer.muon.lr": 0.05,
    "optimizer.muon.momentum": 0.95,
    "optimizer.muon.weight_decay": 0.1,
    "optimizer.muon.adjust_lr_fn": "match_rms_adamw",
    # AdamW's eps well above the grads' float noise (tests/distributed/test_moe_layouts.py says why; 1e-4 there,
    # 1e-3 here for AdamW lrs up to 0.1: measured 2e-4 apart on dp2 x tp2 with 1e-4)
    "optimizer.adamw.eps": 1e-3,
    "optimizer.adamw.weight_decay": 0.1,
}
BETAS = (0.9, 0.95)
# (family, flavor, tau, AdamW lr, steps with a clipped head at least). Without a QK-norm the tiny model's logits start
# near 0.1 and Muon grows them: tau under that clips heads on (nearly) every step. With one (qwen3) they start near 3.7
# and only the norms' gains (AdamW's) scale them; the layer's one gain takes its worst head's factor, so a clip lowers
# every head and the next steps start under tau: on this data they climb back over it on 3 to 5 of the 8 steps
# (measured for taus from 0.5 to 3.5 and AdamW lrs from 1e-2 to 0.2), so the bar is 3. MLA's (deepseek_v3 tinymodel)
# start near 0.05 and grow to 0.2 in 8 unclipped steps: tau 0.05 clips 1 to all 8 heads on every step (1 process).
MODELS = {
    "llama3": ("llama3", "tinymodel_gqa", 0.06, 3e-3, STEPS - 2),
    "llama3_mha": ("llama3", "tinymodel", 0.06, 3e-3, STEPS - 2),
    "qwen3": ("qwen3", "tinymodel", 3.0, 3e-2, 3),
    "moe": ("qwen3", "tinymodel_moe", 3.0, 1e-1, 3),
    "mla": ("deepseek_v3", "tinymodel", 0.05, 3e-3, STEPS - 2),
}
# the Muon matrices: the family's own (the trainer's default) for MLA, every attention / feed-forward matrix otherwise
BLOCK_MATRICES = r"^layers\.\d+\.(attention|feed_forward)\.\w+\.weight$"
LAYOUTS = {
    "1proc": (1, []),
    "fsdp4": (4, []),
    "hsdp2x2": (4, ["--parallelism.data_parallel_replicate_degree", "2"]),
    "dp2_tp2": (4, ["--parallelism.tensor_parallel_degree", "2"]),
}


def _argv(dump, model: str, *extra: str) -> list[str]:
    family, flavor, tau, adamw_lr, _ = MODELS[model]
    argv = ["--config", "train_configs/debug_model.toml", "--model.name", family, "--model.flavor", flavor]
    argv += ["--training.seq_len", str(T), "--training.local_batch_size", str(B), "--training.steps", str(STEPS)]
    argv += ["--training.max_norm", "0", "--lr_scheduler.warmup_steps", "0", "--lr_scheduler.decay_ratio", "0"]
    argv += ["--optimizer.muon.ns_coefficients", "muon", "--optimizer.muon.ns_dtype", "float32"]
    if family != "deepseek_v3":
        argv += ["--optimizer.muon_params", BLOCK_MATRICES]
    argv += ["--optimizer.adamw.betas", str(BETAS[0]), str(BETAS[1])]
    argv += ["--metrics.enable_tensorboard", "false", "--comm.heartbeat_seconds", "0", "--job.dump_folder", str(dump)]
    for key, value in HP.items():
        argv += [f"--{key}", str(value)]
    argv += ["--optimizer.muon.qk_clip_tau", str(tau), "--optimizer.adamw.lr", str(adamw_lr)]
    return [*argv, *extra]


def _batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    tokens = torch.randint(0, VOCAB, (B, T + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _full(model: nn.Module, dmuon_model: bool) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    from titan_dmuon import dmuon

    if dmuon_model:
        return dmuon.get_model_state_dict(model)
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()
    }


def _rank(rank: int, world: int, dump: str, model: str, extra: list[str]) -> dict:
    from titan_dmuon.config import parse_args
    from titan_dmuon.trainer import Trainer

    trainer = Trainer(parse_args(_argv(f"{dump}/r{rank}", model, *extra)))
    try:
        model, component = trainer.model, trainer.optimizer_component
        owners = component.name == "dmuon"
        sd0 = _full(model, owners)
        losses, max_logits, clipped = [], [], []
        for step in range(STEPS):
            loss, _, _ = trainer.train_step(iter([_batch(step, trainer.dp_rank)]))
            losses.append(loss)
            stats = component.step_stats()  # every rank: it may gather
            max_logits.append([stats[f"attn/max_logit/layers.{i}.attention"] for i in range(model.args.n_layers)])
            clipped.append(stats["attn/clipped_heads"])
        sd = _full(model, owners)
        keep = rank == 0
        return {
            "sd0": sd0 if keep else None,
            "sd": sd if keep else None,
            "losses": losses,
            "max_logits": max_logits,
            "clipped": clipped,
            "n_dp": trainer.dp_world_size,
        }
    finally:
        trainer.close()


# ------------------------------------------------------------------------------------------- the reference
class _Logits:
    """Every scaled_dot_product_attention call's per-head max causal logit, q·k^T/sqrt(d) in fp32, in call order."""

    def __init__(self):
        self.calls: list[torch.Tensor] = []
        self._sdpa = F.scaled_dot_product_attention

    def __call__(self, q, k, v, *args, **kwargs):
        scale = kwargs.get("scale") or q.shape[-1] ** -0.5  # MLA passes its softmax scale
        logits = (q.detach().float() @ k.detach().float().transpose(-1, -2)) * scale  # [B, H, L, L]
        causal = torch.ones(logits.shape[-2:], dtype=torch.bool).tril()
        self.calls.append(logits.masked_fill(~causal, float("-inf")).amax(dim=(0, 2, 3)))
        return self._sdpa(q, k, v, *args, **kwargs)


def _clip(model: nn.Module, s: torch.Tensor, tau: float) -> None:
    """The paper's clip with this project's GQA and QK-norm rules (the module docstring), S [layers, heads]."""
    gamma = torch.clamp(tau / s, max=1.0)
    with torch.no_grad():
        for layer, block in enumerate(model.layers.values()):
            att = block.attention
            g = gamma[layer]
            if hasattr(att, "wkv_b"):  # MLA: each head's rows, [non-rotary | rotary] queries, [non-rotary | value] keys
                a = model.args
                nope, rope, heads = a.qk_nope_head_dim, a.qk_rope_head_dim, a.n_heads
                q = (att.wq if a.q_lora_rank == 0 else att.wq_b).weight.view(heads, nope + rope, -1)
                q[:, :nope].mul_(g.sqrt().view(-1, 1, 1))
                q[:, nope:].mul_(g.view(-1, 1, 1))
                att.wkv_b.weight.view(heads, nope + a.v_head_dim, -1)[:, :nope].mul_(g.sqrt().view(-1, 1, 1))
            elif att.n_kv_heads < att.n_heads:  # GQA: the query side takes all of it, the shared keys stay
                if att.q_norm is not None:
                    att.q_norm.weight.mul_(g.min())
                else:
                    att.wq.weight.view(att.n_heads, att.head_dim, -1).mul_(g.view(-1, 1, 1))
            else:  # multi-head, no QK-norm here: the paper's sqrt(gamma) on each of a head's q and k rows
                assert att.q_norm is None
                for w in (att.wq.weight, att.wk.weight):
                    w.view(att.n_heads, att.head_dim, -1).mul_(g.sqrt().view(-1, 1, 1))


def reference(model_name: str, sd0: dict[str, torch.Tensor], n_dp: int, clip: bool = True) -> dict:
    family, flavor, tau, adamw_lr, _ = MODELS[model_name]
    module = importlib.import_module(f"titan_dmuon.models.{family}")
    tau = tau if clip else float("inf")
    model = module.build_model(flavor, vocab_size=VOCAB, max_seq_len=T, device="cpu")
    model.init_buffers("cpu")
    model.load_state_dict(sd0)
    for m in moe_layers(model):
        m.aux_loss_scale = 1.0 / n_dp
    regex = re.compile(module.MUON_PARAMS if family == "deepseek_v3" else BLOCK_MATRICES)
    named = dict(model.named_parameters())
    matrices = [p for n, p in named.items() if regex.search(n) and p.ndim == 2]
    experts = ExpertSlices(named, regex.search)
    others = [p for n, p in named.items() if not (regex.search(n) and p.ndim in (2, 3))]  # the q/k norms too
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
        lr=adamw_lr,
        betas=BETAS,
        eps=HP["optimizer.adamw.eps"],
        weight_decay=HP["optimizer.adamw.weight_decay"],
    )
    n_layers = len(model.layers)
    losses, max_logits, clipped = [], [], []
    logits = _Logits()
    with fp32_torch_muon(), mock.patch.object(F, "scaled_dot_product_attention", logits):
        for step in range(STEPS):
            total, logits.calls = 0.0, []
            for r in range(n_dp):
                inputs, labels = _batch(step, r)
                loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1).float(), labels.flatten())
                loss = loss / n_dp
                loss.backward()
                total += loss.item()
            assert len(logits.calls) == n_dp * n_layers
            s = torch.stack(logits.calls).view(n_dp, n_layers, -1).amax(dim=0)  # [layers, heads]
            experts.take_grads()
            muon.step()
            adamw.step()
            muon.zero_grad()
            adamw.zero_grad()
            experts.write_back()
            _clip(model, s, tau)
            if moe_layers(model):
                update_moe_bias(model, moe_stats(model)["tokens_per_expert"].to(torch.float64))
            losses.append(total)
            max_logits.append(s.amax(dim=1).tolist())
            clipped.append(float((s > tau).sum()))
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "max_logits": max_logits, "clipped": clipped, "sd": sd}


def _check(results: list[dict], model: str) -> None:
    ref = reference(model, results[0]["sd0"], results[0]["n_dp"])
    assert sum(c > 0 for c in ref["clipped"]) >= MODELS[model][4], ref["clipped"]  # steps that clipped a head
    for got in results:
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=0)
        torch.testing.assert_close(torch.tensor(got["max_logits"]), torch.tensor(ref["max_logits"]), rtol=RTOL, atol=0)
        assert got["clipped"] == ref["clipped"]
    sd = results[0]["sd"]
    assert set(sd) == set(ref["sd"]), set(sd) ^ set(ref["sd"])
    for k, want in ref["sd"].items():
        if not want.is_floating_point():
            continue
        err = float((sd[k].float() - want.float()).abs().max()) / max(float(want.abs().max()), 1e-12)
        assert err < RTOL, (k, err)
    # the clip matters at this tolerance: the reference without it ends far from the run
    unclipped = reference(model, results[0]["sd0"], results[0]["n_dp"], clip=False)["sd"]
    q = "q_norm" if MODELS[model][0] == "qwen3" else "wq"  # the query weights the clip scales (MLA: wq_b)
    scale = {k: float(sd[k].abs().max()) for k in sd}
    far = [k for k in sd if q in k and float((sd[k] - unclipped[k]).abs().max()) > 100 * RTOL * scale[k]]
    assert far, f"no {q} weight tells the clipped run from the unclipped one"


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama3", "qwen3"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dmuon_clip_matches_reference(model, layout, tmp_path) -> None:
    nproc, extra = LAYOUTS[layout]
    results = run_distributed(_rank, nproc, str(tmp_path), model, extra, timeout=DEADLINE)
    _check(results, model)


@pytest.mark.slow
def test_dmuon_clip_moe_ep2_matches_reference(tmp_path) -> None:
    extra = ["--parallelism.expert_parallel_degree", "2"]
    results = run_distributed(_rank, 4, str(tmp_path), "moe", extra, timeout=DEADLINE)
    _check(results, "moe")


@pytest.mark.slow
def test_muon_naive_clip_on_tp_shards_matches_reference(tmp_path) -> None:
    """muon_naive keeps wq an FSDP2 x TP DTensor: the post-step clip scales each rank's rows of it in place."""
    extra = ["--optimizer.name", "muon_naive", "--parallelism.tensor_parallel_degree", "2"]
    results = run_distributed(_rank, 4, str(tmp_path), "llama3", extra, timeout=DEADLINE)
    _check(results, "llama3")


@pytest.mark.slow
def test_dmuon_clip_multi_head_dp2_tp2_matches_reference(tmp_path) -> None:
    """Multi-head attention (the Llama tinymodel): each TP rank of an owner column scales its rows of wq and wk by
    sqrt(gamma)."""
    extra = ["--parallelism.tensor_parallel_degree", "2"]
    results = run_distributed(_rank, 4, str(tmp_path), "llama3_mha", extra, timeout=DEADLINE)
    _check(results, "llama3_mha")


MLA_LAYOUTS = {
    "fsdp4": ["--parallelism.expert_parallel_degree", "1"],
    "ep2_fsdp2": ["--parallelism.expert_parallel_degree", "2"],
    "ep2_tp2": ["--parallelism.expert_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"],
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(MLA_LAYOUTS))
def test_dmuon_clip_mla_matches_reference(layout, tmp_path) -> None:
    """MLA: the owner of a query projection (wq_b) scales each head's non-rotary rows by sqrt(gamma) and its rotary
    rows by gamma, the owner of wkv_b the non-rotary key rows; under TP each TP rank of the owner column its own heads'
    rows. The down projections (wq_a, wkv_a), whole on every TP rank, stay."""
    results = run_distributed(_rank, 4, str(tmp_path), "mla", MLA_LAYOUTS[layout], timeout=DEADLINE)
    _check(results, "mla")


@pytest.mark.slow
def test_muon_naive_clip_mla_on_ep2_tp2_matches_reference(tmp_path) -> None:
    """muon_naive keeps wq_b and wkv_b FSDP2 x TP DTensors: the post-step clip scales each rank's rows of them."""
    extra = [*MLA_LAYOUTS["ep2_tp2"], "--optimizer.name", "muon_naive"]
    results = run_distributed(_rank, 4, str(tmp_path), "mla", extra, timeout=DEADLINE)
    _check(results, "mla")
