"""A tinymodel Llama-3 with an optimizer component (dmuon, muon_naive, adamw) built the trainer's way on a 1-rank
gloo group, and the trainer's training step, for the optimizer-component tests
(tests/unit/framework/test_optimizer_components.py, tests/unit/dmuon/test_checkpoint_components.py)."""

from __future__ import annotations

import torch

from titan_dmuon.components.model import get_model_spec
from titan_dmuon.components.optimizer import OptimizerComponent, build_optimizer_component
from titan_dmuon.config import JobConfig
from titan_dmuon.parallel import ParallelDims, parallelize

VOCAB, SEQ, BATCH = 64, 16, 4


def tiny_cfg(name: str, **muon) -> JobConfig:
    cfg = JobConfig()
    cfg.optimizer.name = name
    cfg.model.flavor = "tinymodel"
    cfg.training.seq_len = SEQ
    cfg.optimizer.muon.ns_dtype = "float32"  # fp32 NS on every device (the default is bf16 on native-bf16 CPUs)
    for key, value in muon.items():
        setattr(cfg.optimizer.muon, key, value)
    return cfg


def build_tiny(cfg: JobConfig, dims: ParallelDims) -> tuple[torch.nn.Module, OptimizerComponent]:
    spec = get_model_spec(cfg.model.name)
    model = spec.build(cfg.model.flavor, vocab_size=VOCAB, max_seq_len=SEQ)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights(buffer_device=torch.device("cpu"))
    component = build_optimizer_component(cfg, spec)
    parallelize(model, dims, dims.build_mesh("cpu"), cfg, spec, component)
    component.build()
    component.attach_qk_clip()  # the trainer's order (titan_dmuon/components/optimizer/base.py)
    return model, component


def tiny_batch(step: int) -> torch.Tensor:
    """Two batches in turn: random tokens the model can only learn by memorizing them (the loss falls)."""
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step % 2))


def train_step(model, component: OptimizerComponent, step: int, max_norm: float = 1.0) -> tuple[float, float]:
    """Two micro-batches (the first under no_sync), clip, step: as the trainer does."""
    spec = component.spec
    component.optimizer.zero_grad()
    total = 0.0
    for i, half in enumerate(tiny_batch(step).chunk(2)):
        with component.no_sync() if i == 0 else torch.enable_grad():
            loss = spec.loss_fn(model(half[:, :-1]), half[:, 1:]) / 2
            loss.backward()
        total += loss.item()
    norm = component.clip_grad_norm_(max_norm).item()
    component.optimizer.step()
    return total, norm
