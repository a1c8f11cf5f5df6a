import math

import pytest
import torch

from titan_dmuon.components.lr_scheduler import build_lr_scheduler, lr_factor, resolve_phases
from titan_dmuon.config import LRScheduler


def factors(cfg, total, steps):
    warmup, decay = resolve_phases(cfg, total)
    return [
        lr_factor(
            s,
            warmup_steps=warmup,
            decay_steps=decay,
            total_steps=total,
            decay_type=cfg.decay_type,
            min_lr_factor=cfg.min_lr_factor,
        )
        for s in steps
    ]


def test_warmup_stable_decay_linear():
    # 20 steps: warmup 4 (steps 0-3), stable 4-14, decay 15-19 (decay_ratio 0.25 -> 5 steps)
    cfg = LRScheduler(warmup_steps=4, decay_ratio=0.25, decay_type="linear", min_lr_factor=0.1)
    assert resolve_phases(cfg, 20) == (4, 5)
    got = factors(cfg, 20, [0, 1, 3, 4, 14, 15, 19, 20, 50])
    want = [0.2, 0.4, 0.8, 1.0, 1.0, 0.1 + 0.9 * 5 / 6, 0.1 + 0.9 * 1 / 6, 0.1, 0.1]
    assert got == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize(
    "decay_type,want",
    [
        ("linear", [1.0, 0.75, 0.5, 0.25, 0.0]),
        ("cosine", [1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4)), 0.0]),
        ("sqrt", [1.0, 0.5, 1 - math.sqrt(0.5), 1 - math.sqrt(0.75), 0.0]),
    ],
)
def test_decay_types(decay_type, want):
    # 10 steps, no warmup, decay over the last 3: progress 1/4, 2/4, 3/4 at steps 7, 8, 9
    cfg = LRScheduler(warmup_steps=0, decay_ratio=0.3, decay_type=decay_type, min_lr_factor=0.0)
    assert factors(cfg, 10, [6, 7, 8, 9, 10]) == pytest.approx(want, abs=1e-12)


def test_min_lr_factor_and_default_decay_over_all_after_warmup():
    cfg = LRScheduler(warmup_steps=2, decay_ratio=None, decay_type="cosine", min_lr_factor=0.2)
    assert resolve_phases(cfg, 10) == (2, 8)
    got = factors(cfg, 10, [0, 1, 2, 9, 10])
    shape = lambda p: 0.5 * (1 + math.cos(math.pi * p))  # noqa: E731
    want = [1 / 3, 2 / 3, 0.2 + 0.8 * shape(1 / 9), 0.2 + 0.8 * shape(8 / 9), 0.2]
    assert got == pytest.approx(want, abs=1e-12)
    assert min(factors(cfg, 10, range(100))) == pytest.approx(0.2)


def test_phases_are_clamped():
    assert resolve_phases(LRScheduler(warmup_steps=50, decay_ratio=0.5), 10) == (10, 0)
    assert resolve_phases(LRScheduler(warmup_steps=6, decay_ratio=0.5), 10) == (6, 4)
    assert resolve_phases(LRScheduler(warmup_steps=0, decay_ratio=0.0), 10) == (0, 0)
    # no decay: stays at 1 to the end
    assert factors(LRScheduler(warmup_steps=0, decay_ratio=0.0), 10, [0, 9, 20]) == [1.0, 1.0, 1.0]


def test_scheduler_scales_every_param_group():
    muon_w, adamw_w = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [muon_w], "lr": 0.02}, {"params": [adamw_w], "lr": 1e-3}])
    cfg = LRScheduler(warmup_steps=3, decay_ratio=0.25, decay_type="linear", min_lr_factor=0.0)
    sched = build_lr_scheduler(opt, cfg, total_steps=8)  # warmup 0-2, stable 3-5, decay 6-7
    seen = []
    for _ in range(9):
        seen.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    f = [0.25, 0.5, 0.75, 1, 1, 1, 2 / 3, 1 / 3, 0.0]
    assert [s[0] for s in seen] == pytest.approx([0.02 * x for x in f], abs=1e-15)
    assert [s[1] for s in seen] == pytest.approx([1e-3 * x for x in f], abs=1e-15)
    # the state round trips (checkpoint resume)
    opt2 = torch.optim.SGD([{"params": [muon_w], "lr": 0.02}, {"params": [adamw_w], "lr": 1e-3}])
    sched2 = build_lr_scheduler(opt2, cfg, total_steps=8)
    sched2.load_state_dict(sched.state_dict())
    assert sched2.last_epoch == sched.last_epoch == 9
    assert sched2.get_last_lr() == pytest.approx(sched.get_last_lr())
