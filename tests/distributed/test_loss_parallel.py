"""Loss parallelism under TP (`parallelism.disable_loss_parallel`, default off = loss parallel on).

With loss parallel the Llama-3 TP plan leaves the logits a DTensor sharded on the vocab dim and the trainer's
`_loss` runs the cross-entropy inside torch's `loss_parallel()`; without it the logits come back replicated.
The Trainer itself runs on dp2 x tp2 (4 gloo ranks), both ways on the same mesh, data and seed: the losses,
the grads of the first step (AdamW: FSDP2/TP DTensor grads, gathered whole), the validation loss and the
weights after the steps agree to 1e-5 relative (DMuon and AdamW).
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed
from tests.train_runs import tiny_train_argv

STEPS = 3
RTOL = 1e-5


def _argv(dump: str, optimizer: str, disable: bool) -> list[str]:
    return tiny_train_argv(
        dump,
        *("--optimizer.name", optimizer, "--training.local_batch_size", "2", "--training.steps", str(STEPS)),
        # accumulation (no_sync and loss parallel together) and op-level selective AC, the same on both sides
        *("--training.gradient_accumulation_steps", "2"),
        *("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"),
        *("--parallelism.tensor_parallel_degree", "2", "--parallelism.disable_loss_parallel", str(disable).lower()),
        *("--validation.enable", "true", "--validation.steps", "1"),
        seed=42,
    )


def _train(dump: str, optimizer: str, disable: bool) -> dict:
    """Build the Trainer, check the model's output layout, train STEPS steps (grads gathered after the first),
    validate, and return the full weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    from titan_dmuon import dmuon
    from titan_dmuon.config import parse_args
    from titan_dmuon.trainer import Trainer

    trainer = Trainer(parse_args(_argv(dump, optimizer, disable)))
    try:
        assert trainer.loss_parallel is not disable
        data_iter = iter(trainer.dataloader)
        inputs = torch.randint(0, 258, (2, 32), generator=torch.Generator().manual_seed(0))  # the same on all ranks
        with torch.no_grad():
            out = trainer.model(inputs)
        if disable:
            assert not isinstance(out, DTensor) and out.shape[-1] == 258
            layout = "plain"
        else:  # the flag must really shard the logits over the vocabulary on the TP mesh
            assert isinstance(out, DTensor), type(out)
            (p,) = out.placements
            assert out.device_mesh.mesh_dim_names == ("tp",) and p.is_shard() and p.dim % out.ndim == out.ndim - 1
            assert out.to_local().shape[-1] == 258 // 2 and out.shape[-1] == 258
            layout = "vocab-sharded"
        losses, norms, grads = [], [], {}
        for step in range(STEPS):
            loss, norm, _ = trainer.train_step(data_iter)
            losses.append(loss)
            norms.append(norm)
            if step == 0 and optimizer == "adamw":  # this step's grads, still on the params before zero_grad
                grads = {n: p.grad.full_tensor() for n, p in trainer.model.named_parameters()}
        val = trainer.validator.validate()["loss/validation"]
        if optimizer == "dmuon":
            weights = dmuon.get_model_state_dict(trainer.model)
        else:
            weights = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
        return {"layout": layout, "losses": losses, "norms": norms, "val": val, "grads": grads, "weights": weights}
    finally:
        trainer.close()


def _both(rank: int, world_size: int, dump: str) -> dict | None:
    out = {
        (opt, disable): _train(f"{dump}/{opt}-{disable}", opt, disable)
        for opt in ("dmuon", "adamw")
        for disable in (False, True)
    }
    return out if rank == 0 else None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.slow
def test_loss_parallel_matches_replicated_logits_dp2_tp2(tmp_path) -> None:
    (got, *_) = run_distributed(_both, 4, str(tmp_path), timeout=600)
    report = {}
    for opt in ("dmuon", "adamw"):
        lp, ref = got[(opt, False)], got[(opt, True)]
        assert (lp["layout"], ref["layout"]) == ("vocab-sharded", "plain")
        for key in ("losses", "norms"):
            rel = max(abs(a - b) / abs(b) for a, b in zip(lp[key], ref[key], strict=True))
            assert rel <= RTOL, (opt, key, lp[key], ref[key])
            report[f"{opt} {key}"] = rel
        assert abs(lp["val"] - ref["val"]) <= RTOL * abs(ref["val"]), (opt, lp["val"], ref["val"])
        assert sorted(lp["weights"]) == sorted(ref["weights"])
        report[f"{opt} weights"] = max(_rel(lp["weights"][k], ref["weights"][k]) for k in ref["weights"])
        assert report[f"{opt} weights"] <= RTOL, opt
    lp, ref = got[("adamw", False)]["grads"], got[("adamw", True)]["grads"]
    assert sorted(lp) == sorted(ref) and "output.weight" in ref
    for name in ref:
        torch.testing.assert_close(lp[name], ref[name], rtol=RTOL, atol=1e-7, msg=name)
    report["adamw grads"] = max(_rel(lp[k], ref[k]) for k in ref)
    print("max relative differences, loss parallel vs not:", report)


def _plain_logits(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from titan_dmuon.models.llama3 import apply_tp, build_model

    torch.manual_seed(0)
    ref = build_model("tinymodel", vocab_size=66, device="cpu", max_seq_len=8)
    tokens = torch.randint(0, 66, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(tokens)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    for sequence_parallel in (True, False):
        torch.manual_seed(0)
        model = build_model("tinymodel", vocab_size=66, device="cpu", max_seq_len=8)
        apply_tp(model, mesh, sequence_parallel=sequence_parallel, loss_parallel=False)
        with torch.no_grad():
            out = model(tokens)
        assert type(out) is torch.Tensor and not isinstance(out, DTensor)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_apply_tp_without_loss_parallel_returns_replicated_plain_logits() -> None:
    run_distributed(_plain_logits, 2, timeout=120)
