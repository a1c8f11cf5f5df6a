"""The MoE auxiliary loss under gradient accumulation, through the trainer (titan_dmuon/trainer.py sets
`aux_loss_scale = 1 / gradient_accumulation_steps` on every MoE module; the layer injects the aux loss's gradient in
the graph, so nothing else scales it).

One optimizer step of the qwen3 `tinymodel_moe` flavor over a batch of `B` sequences, cut into `accum` micro-batches
of `B / accum` (the trainer's `train_step` on 1 gloo rank; the optimizer step replaced by a read of the grads). The
reference is written out here on a plain copy of the same initial weights with the injection off: each micro-batch's
objective is the cross-entropy plus `COEF` x the mean over MoE layers of `transformers`' `load_balancing_loss_func`
on that layer's router logits (read by hooks), as Hugging Face's Trainer accumulates Qwen3-MoE (each micro-batch's
loss, aux included, divided by the accumulation steps). Every grad must agree to fp32 rounding.

`COEF` is 1 (the flavors' 0.001 would hide the aux term in the CE's gradient): an aux gradient left unscaled (x accum)
moved the grads by 0.42 (accumulation 2) and 1.3 (4) of their largest element; the trainer's agree to 5e-7. The
accumulated grads are not those of one micro-batch of all `B` sequences: the aux loss is not linear in the batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests._dist import run_distributed
from titan_dmuon.components.moe import moe_layers

B, T, VOCAB, COEF, DEADLINE = 4, 16, 258, 1.0, 240


def _argv(dump: str, accum: int) -> list[str]:
    argv = ["--config", "train_configs/debug_model.toml", "--model.name", "qwen3", "--model.flavor", "tinymodel_moe"]
    argv += ["--training.seq_len", str(T), "--training.local_batch_size", str(B // accum)]
    argv += ["--training.gradient_accumulation_steps", str(accum), "--training.steps", "1", "--training.max_norm", "0"]
    argv += ["--training.mixed_precision_param", "float32", "--training.mixed_precision_reduce", "float32"]
    argv += ["--optimizer.name", "adamw", "--metrics.enable_tensorboard", "false", "--comm.heartbeat_seconds", "0"]
    return [*argv, "--job.dump_folder", dump]


def _micro_batches(accum: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(0, VOCAB, (B, T + 1), generator=torch.Generator().manual_seed(3))
    return [(x[:, :-1], x[:, 1:]) for x in tokens.chunk(accum)]


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _rank(rank: int, world: int, dump: str, accum: int) -> dict:
    from titan_dmuon.config import parse_args
    from titan_dmuon.trainer import Trainer

    trainer = Trainer(parse_args(_argv(dump, accum)))
    try:
        model = trainer.model
        assert model.tok_embeddings.weight.shape[0] == VOCAB
        moes = moe_layers(model)
        assert moes
        for m in moes:
            m.aux_loss_coef = COEF
        sd0 = {k: _full(v) for k, v in model.state_dict().items()}
        grads: dict[str, torch.Tensor] = {}

        def read_grads(*args, **kwargs) -> None:  # instead of the optimizer step
            grads.update({n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None})

        trainer.optimizer.step = read_grads
        loss, _, ntokens = trainer.train_step(iter(_micro_batches(accum)))
        assert ntokens == B * T
        return {"sd0": sd0, "grads": grads, "loss": loss}
    finally:
        trainer.close()


def _reference(sd0: dict[str, torch.Tensor], accum: int) -> tuple[dict[str, torch.Tensor], float]:
    """The grads of mean over micro-batches of (CE + COEF * mean over MoE layers of HF's aux loss), and the CE."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from titan_dmuon.models.qwen3 import build_model

    model = build_model("tinymodel_moe", vocab_size=VOCAB, max_seq_len=T, device="cpu")
    model.load_state_dict(sd0)
    moes = moe_layers(model)
    gate_logits: list[torch.Tensor] = []
    for m in moes:
        m.aux_loss_coef = 0.0  # nothing injected: the aux loss is written out below
        assert not m.router.expert_bias.any()  # HF's selection: no aux-free bias
        m.router.gate.register_forward_hook(lambda mod, args, out: gate_logits.append(out))
    ce_total = 0.0
    for inputs, labels in _micro_batches(accum):
        gate_logits.clear()
        ce = F.cross_entropy(model(inputs).flatten(0, 1).float(), labels.flatten())
        auxes = [
            load_balancing_loss_func((g,), num_experts=m.num_experts, top_k=m.top_k)
            for g, m in zip(gate_logits, moes, strict=True)
        ]
        ((ce + COEF * torch.stack(auxes).mean()) / accum).backward()
        ce_total += ce.item() / accum
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, ce_total


@pytest.mark.parametrize("accum", [2, 4])
def test_accumulated_moe_grads_equal_the_written_out_objective(accum, tmp_path) -> None:
    pytest.importorskip("transformers")  # imported here, not by the ranks (which unpickle this module)
    (got,) = run_distributed(_rank, 1, str(tmp_path), accum, timeout=DEADLINE)
    want, ce = _reference(got["sd0"], accum)
    assert got["loss"] == pytest.approx(ce, rel=1e-5)  # the logged loss is the CE's (the aux is a metric of its own)
    assert set(got["grads"]) == set(want)
    for name, g in want.items():
        err = float((got["grads"][name] - g).abs().max()) / float(g.abs().max())
        assert err < 1e-4, f"{name}: max error {err:.3g} of the grad's max |g| (accumulation {accum})"
