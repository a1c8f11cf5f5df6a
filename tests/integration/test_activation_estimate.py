"""The planner's activation estimates (titan_dmuon/models/common/memory.py) against the bytes a real forward leaves
for its backward (tests/activation_memory.py: every storage an op made that is still alive, de-duplicated; the same
count as `saved_tensors_hooks` where no AC hides the saved tensors and none dies with the forward), in bf16 as on a
GPU, for one block and for the head (final norm, output, loss), for every AC mode, on one rank and on TP 2 with
sequence parallelism, with and without loss parallelism. Each within 10%; `-s` prints the table.

The block's input and the head's are made inside the counted region from a leaf (as the previous layer's output
is), so a block that keeps its input (every checkpointed one) is charged for it.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests._dist import run_distributed
from tests.activation_memory import held_bytes, module_storages, saved_tensor_bytes

TOLERANCE = 0.10
# (family, flavor, ModelArgs overrides): Llama-3's tinymodel, multi-head attention; Qwen3's tinymodel: grouped-query
# attention (kv heads repeated for SDPA), q/k norms, attention twice as wide as dim; Qwen3-MoE's debugmodel_moe
# DeepSeek-V3's debugmodel: multi-head latent attention (models/common/mla.py) with and without the query latent, and
# every block dense (no experts) or every block a DeepSeekMoE (sigmoid group-limited router, a shared expert). Its
# heads are made as wide as their values (non-rotary 16 + rotary 16 = v 32): torch's CPU SDPA takes the fused kernel
# only then (else the math path, which keeps the fp32 L x L probabilities, as no GPU kernel does); wkv_b's output
# (non-rotary 16 + v 32 per head) stays wider than v, so v kept as its view is still told apart.
_MLA = {"qk_nope_head_dim": 16}
FLAVORS = {
    "tinymodel": ("llama3", "tinymodel", {}),
    "qwen3-tinymodel": ("qwen3", "tinymodel", {}),
    "qwen3-debugmodel_moe": ("qwen3", "debugmodel_moe", {}),  # every block an MoE (models/common/moe.py)
    "deepseek_v3-moe": ("deepseek_v3", "debugmodel", {**_MLA, "first_k_dense_replace": 0}),
    "deepseek_v3-moe-no_q_lora": ("deepseek_v3", "debugmodel", {**_MLA, "first_k_dense_replace": 0, "q_lora_rank": 0}),
    "deepseek_v3-dense": ("deepseek_v3", "debugmodel", {**_MLA, "num_experts": 0}),
    "deepseek_v3-dense-no_q_lora": ("deepseek_v3", "debugmodel", {**_MLA, "num_experts": 0, "q_lora_rank": 0}),
}
# One rank: every kind of attention and feed-forward (llama3 and qwen3 share the core: the GQA llama3 debugmodel adds no
# code path the qwen3 tinymodel does not walk; the four DeepSeek-V3 blocks each run their matmuls in another order,
# which op-level AC keeps every other one of). TP 2: the kinds whose layout TP changes: q/k norms, the MoE, MLA (its
# latents whole on every rank) with the shared experts (over the gathered sequence), MLA without a query latent.
ONE_RANK = [
    "tinymodel",
    "qwen3-tinymodel",
    "qwen3-debugmodel_moe",
    "deepseek_v3-moe",
    "deepseek_v3-moe-no_q_lora",
    "deepseek_v3-dense",
    "deepseek_v3-dense-no_q_lora",
]
TP2 = ["qwen3-tinymodel", "qwen3-debugmodel_moe", "deepseek_v3-moe", "deepseek_v3-dense-no_q_lora"]
# DeepSeekMoE's router saves tensors for autograd nodes that die with outputs the forward drops (the group-limited
# selection's, and the normalized scores' of the auxiliary loss, which is off): the saved-tensor hooks saw them
# packed, the graph no longer holds them
HOOKS_SEE_FREED = {"deepseek_v3-moe", "deepseek_v3-moe-no_q_lora"}
VOCAB, B, T = 2048, 2, 64
# (activation_checkpoint.mode, selective_ac_option): the block kinds every mode is made of
AC = [("none", "2"), ("full", "2"), ("selective", "op")]


def _spec(model):
    """The ModelSpec of the family `model` belongs to (titan_dmuon.models.<family>.model)."""
    from titan_dmuon.components.model import get_model_spec

    return get_model_spec(type(model).__module__.split(".")[2])


def _model(name: str):
    from titan_dmuon.components.model import get_model_spec

    family, flavor, overrides = FLAVORS[name]
    torch.manual_seed(0)
    build = get_model_spec(family).build
    model = build(flavor, vocab_size=VOCAB, device="cpu", max_seq_len=T, **overrides).to(torch.bfloat16)
    model.init_buffers("cpu")  # the RoPE table stays fp32, as under FSDP2's mixed precision
    return model


def _measure(model, mode: str, option: str, tp_mesh=None, loss_parallel: bool = True) -> dict[str, float]:
    """Bytes per token kept by block 0 (checkpointed as `mode`/`option` say) and by the head."""
    from titan_dmuon.components.model import cross_entropy_loss
    from titan_dmuon.parallel.parallelize import apply_ac

    spec = _spec(model)
    if tp_mesh is not None:
        spec.apply_tp(model, tp_mesh, loss_parallel=loss_parallel)
    apply_ac(spec.blocks(model)[:1], mode, option)
    tp = 1 if tp_mesh is None else tp_mesh.size()
    local_t = T // tp  # sequence parallelism: each TP rank holds a slice of the sequence between blocks
    gen = torch.Generator().manual_seed(1)
    leaf = torch.randn(B, local_t, model.args.dim, generator=gen).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, VOCAB, (B, T), generator=gen)
    exclude = module_storages(model) | {labels.untyped_storage()._cdata}
    block = model.layers["0"]

    def block_forward():
        return block(leaf * 1.0, model.rope_cache).float().sum()

    def head_forward():
        logits = model.output(model.norm(leaf * 1.0))
        if tp_mesh is not None and loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel as lp

            with lp():
                return cross_entropy_loss(logits, labels).full_tensor()
        return cross_entropy_loss(logits, labels)

    _, block_bytes = held_bytes(block_forward, exclude)
    _, head_bytes = held_bytes(head_forward, exclude)
    out = {"block": block_bytes / (B * T), "head": head_bytes / (B * T) + 8}  # + the labels (int64) it keeps
    if mode == "none":
        _, saved = saved_tensor_bytes(block_forward, exclude)
        out["block_saved_hooks"] = saved / (B * T)
    return out


def _estimate(model, mode: str, option: str, tp: int, loss_parallel: bool = True) -> dict[str, float]:
    est = _spec(model).activation_estimate(
        model, batch=B, seq_len=T, dtype_bytes=2, tp=tp, ac_mode=mode, ac_option=option, loss_parallel=loss_parallel
    )
    kept = est.block if mode == "none" else est.checkpointed_block
    return {"block": kept / (B * T), "head": est.head / (B * T)}


def _check(rows: list[tuple[str, dict, dict]]) -> None:
    print(f"\n{'case':<52} {'term':<6} {'counted B/token':>16} {'estimate':>10} {'error':>7}")
    bad = []
    for case, got, want in rows:
        for term in ("block", "head"):
            err = want[term] / got[term] - 1
            print(f"{case:<52} {term:<6} {got[term]:>16.1f} {want[term]:>10.1f} {100 * err:>6.1f}%")
            if abs(err) > TOLERANCE:
                bad.append((case, term, got[term], want[term]))
    assert not bad, f"estimate off by more than {TOLERANCE:.0%}: {bad}"


@pytest.mark.slow
@pytest.mark.parametrize("flavor", ONE_RANK)
def test_estimate_matches_what_autograd_keeps_on_one_rank(flavor):
    rows = []
    for mode, option in AC:
        model = _model(flavor)
        got = _measure(model, mode, option)
        if mode == "none":  # the counter agrees with autograd's own saved-tensor hooks where they see everything
            if flavor in HOOKS_SEE_FREED:
                assert got["block_saved_hooks"] > got["block"]
            else:
                assert got["block_saved_hooks"] == got["block"]
        rows.append((f"{flavor} AC {mode}/{option} tp1", got, _estimate(model, mode, option, 1)))
    _check(rows)


def _tp_rank(rank: int, world: int, flavor: str) -> list:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    rows = []
    for mode, option in AC:
        for lp in (True, False):
            model = _model(flavor)
            got = _measure(model, mode, option, mesh, loss_parallel=lp)
            case = f"{flavor} AC {mode}/{option} tp2 loss_parallel={lp}"
            rows.append((case, got, _estimate(model, mode, option, 2, lp)))
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("flavor", TP2)
def test_estimate_matches_what_autograd_keeps_under_tp2(flavor):
    """TP 2 with sequence parallelism, with and without loss parallelism: rank 0's bytes (the ranks are alike)."""
    rows = run_distributed(functools.partial(_tp_rank, flavor=flavor), 2, timeout=240)[0]
    _check(rows)
