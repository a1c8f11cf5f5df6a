"""DeepSeek-V3's tensor-parallel plan (titan_dmuon/models/common/tensor_parallel.py: `mla_attention_plan` and the
shared experts' SwiGLU) on 2 real gloo ranks against one unsharded process on the same weights and tokens: the loss
and every parameter's full gradient.

The plan keeps MLA's down projections (`wq_a`, `wkv_a`) and norms (`q_norm`, `kv_norm`) whole on every TP rank, fed
the gathered sequence, while the heads are split: their grads are right only if the column-parallel inputs sum
their grads over TP once and the shared rotary key (`rope_key`) once. A missing sum leaves each rank its own heads'
share of those grads; a doubled one twice the grad. Both show here as a plain grad that differs from the unsharded
one (or between the ranks).

Variants (one spawn, process start-up is most of the time): the `tinymodel` flavor with its query latent and without
(`q_lora_rank=0`), dense only (`first_k_dense_replace=2`) and with its MoE layer (each TP rank routes its own
sequence chunk: the routed experts stay whole on every rank with their own tokens' grads, summed here over TP as the
optimizer does; the auxiliary loss on); the training plan (sequence and loss parallel, as the trainer applies it)
and generation's (neither).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests._dist import run_distributed

pytestmark = pytest.mark.slow

VOCAB, B, T = 96, 2, 8
# (name, ModelArgs overrides, sequence_parallel = loss_parallel)
VARIANTS = [
    ("q_lora_dense", {"first_k_dense_replace": 2}, True),
    ("no_q_lora_dense", {"first_k_dense_replace": 2, "q_lora_rank": 0}, True),
    ("q_lora_moe", {"aux_loss_coef": 0.05}, True),
    ("no_q_lora_moe", {"q_lora_rank": 0}, True),
    ("q_lora_moe_no_sp", {}, False),
]


def _model(overrides: dict):
    from titan_dmuon.models.deepseek_v3 import build_model

    torch.manual_seed(0)
    model = build_model("tinymodel", vocab_size=VOCAB, max_seq_len=T, device="cpu", **overrides)
    model.init_buffers("cpu")
    with torch.no_grad():  # init logits are ~1e-2: larger q/k weights make the attention (and its grads) non-trivial
        for block in model.layers.values():
            for name, p in block.attention.named_parameters():
                if name.startswith(("wq", "wkv")):
                    p.mul_(8.0)
    return model


def _variant(rank: int, world: int, overrides: dict, parallel: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from titan_dmuon.models.deepseek_v3 import SPEC

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    ref = _model(overrides)
    model = copy.deepcopy(ref)
    SPEC.apply_tp(model, mesh, sequence_parallel=parallel, loss_parallel=parallel)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (B, T + 1), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    logits = model(inputs)
    assert isinstance(logits, DTensor) == parallel
    with loss_parallel() if parallel else torch.enable_grad():
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
    loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
    want = F.cross_entropy(ref(inputs).flatten(0, 1).float(), labels.flatten())
    want.backward()

    refs = dict(ref.named_parameters())
    got, plain = {}, {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
        if ".experts." in name and parallel:  # each rank's own sequence chunk: the grad is the sum over TP
            torch.distributed.all_reduce(grad, group=mesh.get_group())
        if not isinstance(p, DTensor):
            plain[name] = p.grad.clone()
        got[name] = grad
    # a plain param's grad must be the same on every TP rank (experts excepted: each rank its own tokens')
    same = {}
    for name, grad in plain.items():
        if ".experts." in name and parallel:
            continue
        other = grad.clone()
        torch.distributed.broadcast(other, src=0, group=mesh.get_group())
        same[name] = bool(torch.equal(other, grad))
    placements = {n: str(p.placements) for n, p in model.named_parameters() if isinstance(p, DTensor)}
    return {
        "loss": (loss.item(), want.item()),
        "grads": got,
        "want": {n: p.grad for n, p in refs.items()},
        "plain": sorted(plain),
        "same": same,
        "placements": placements,
    }


def _variants(rank: int, world: int) -> list[dict]:
    return [_variant(rank, world, overrides, parallel) for _, overrides, parallel in VARIANTS]


def test_mla_tp_loss_and_every_grad_match_one_process() -> None:
    results = run_distributed(_variants, 2, timeout=240)
    for i, (name, overrides, _) in enumerate(VARIANTS):
        for rank in range(2):
            out = results[rank][i]
            got, want = out["loss"]
            assert got == pytest.approx(want, rel=1e-5), (name, rank)
            assert out["grads"].keys() == out["want"].keys(), name
            for p, grad in out["want"].items():
                assert grad is not None and grad.abs().max() > 0, (name, p)  # every param takes part
                torch.testing.assert_close(out["grads"][p], grad, rtol=1e-4, atol=1e-6, msg=f"{name} rank {rank} {p}")
            assert all(out["same"].values()), (name, rank, out["same"])
            # the plan as documented: the down projections and their norms plain, the heads' projections sharded
            attn = "layers.0.attention"
            downs = ["wkv_a", "kv_norm"] + (["wq_a", "q_norm"] if overrides.get("q_lora_rank", 32) else [])
            assert {f"{attn}.{w}.weight" for w in downs} <= set(out["plain"]), (name, out["plain"])
            q = "wq_b" if overrides.get("q_lora_rank", 32) else "wq"
            for w, placement in ((q, "Shard(dim=0)"), ("wkv_b", "Shard(dim=0)"), ("wo", "Shard(dim=1)")):
                assert out["placements"][f"{attn}.{w}.weight"] == f"({placement},)", (name, w)
            if "first_k_dense_replace" not in overrides:
                shared = "layers.1.feed_forward.shared_experts"
                assert out["placements"][f"{shared}.w1.weight"] == "(Shard(dim=0),)", name
                assert out["placements"][f"{shared}.w2.weight"] == "(Shard(dim=1),)", name
