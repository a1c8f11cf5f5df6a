import logging
import math
import re

import pytest
import torch

from titan_dmuon.components.lr_scheduler import build_lr_scheduler, lr_factor, resolve_phases, schedule_change
from titan_dmuon.config import LRScheduler, parse_args


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


# ---- a resume with other schedule fields (the checkpoint keeps only the step) --------------------------------
# The debug config's schedule, written out: warmup 5, then linear decay to 0.1 over the other steps; Muon 0.01,
# AdamW 3e-3.
SAVED = ["--training.steps", "40", "--lr_scheduler.warmup_steps", "5", "--lr_scheduler.min_lr_factor", "0.1"]
SAVED += ["--optimizer.muon.lr", "0.01", "--optimizer.adamw.lr", "3e-3"]


def _lrs(line: str) -> dict[str, tuple[float, float]]:
    return {k: (float(a), float(b)) for k, a, b in re.findall(r"lr/(\w+) (\S+) -> ([^\s,]+)", line)}


def test_a_longer_run_names_the_fields_and_the_lr_before_and_after():
    """Resumed at step 40 of a 40-step run with --training.steps 50: step 40 trained at decay progress 35/36 of the
    40-step schedule; the line gives that lr and echoes the next step's (what the optimizer now holds)."""
    saved, current = parse_args(SAVED), parse_args([*SAVED, "--training.steps", "50"])
    after = {"muon": 0.01 * (0.1 + 0.9 * 10 / 46), "adamw": 3e-3 * (0.1 + 0.9 * 10 / 46)}  # progress 36/46
    line = schedule_change(saved, current, 40, after)
    assert line.startswith("lr schedule changed on resume: training.steps 40 -> 50; "), line
    assert "lr_scheduler." not in line and "optimizer." not in line.split(";")[0]
    got = _lrs(line)
    assert sorted(got) == ["adamw", "muon"]
    before = 0.1 + 0.9 * (1 - 35 / 36)  # 0.125: AdamW 3.75e-4
    for kind, base in (("muon", 0.01), ("adamw", 3e-3)):
        assert got[kind][0] == pytest.approx(base * before, rel=1e-3), (kind, line)
        assert got[kind][1] == pytest.approx(after[kind], rel=1e-3), (kind, line)
    assert "(step 40 under the saved schedule -> step 41 under this run's)" in line


def test_a_new_base_lr_and_schedule_field_are_named_and_the_before_uses_the_saved_values():
    saved = parse_args(SAVED)
    current = parse_args([*SAVED, "--optimizer.adamw.lr", "1e-3", "--lr_scheduler.decay_type", "cosine"])
    line = schedule_change(saved, current, 10, {"muon": 0.5, "adamw": 0.25})
    fields = line.split(";")[0]
    assert fields == (
        "lr schedule changed on resume: lr_scheduler.decay_type 'linear' -> 'cosine', optimizer.adamw.lr 0.003 -> 0.001"
    )
    # step 10 is 0-indexed step 9: decay progress (9 - 5 + 1) / 36, linear, from AdamW's saved 3e-3
    assert _lrs(line)["adamw"][0] == pytest.approx(3e-3 * (0.1 + 0.9 * (1 - 5 / 36)), rel=1e-3)


def test_no_line_when_no_schedule_field_changed():
    saved = parse_args(SAVED)
    assert schedule_change(saved, parse_args(SAVED), 40, {"muon": 1.0, "adamw": 1.0}) is None
    others = ["--training.seq_len", "64", "--optimizer.muon.momentum", "0.9", "--optimizer.adamw.weight_decay", "0"]
    assert schedule_change(saved, parse_args([*SAVED, *others]), 40, {"muon": 1.0, "adamw": 1.0}) is None
    # the `adamw` optimizer's groups: Muon's lr is no field of its schedule
    assert schedule_change(saved, parse_args([*SAVED, "--optimizer.muon.lr", "0.02"]), 40, {"adamw": 1.0}) is None


def test_the_saved_schedule_clamps_without_warning(caplog):
    """A saved 4-step run's warmup 5 was clamped (and said so) back then; the resume warns only of the change."""
    saved = parse_args([*SAVED, "--training.steps", "4"])
    with caplog.at_level(logging.WARNING, logger="titan_dmuon"):
        line = schedule_change(saved, parse_args([*SAVED, "--training.steps", "6"]), 4, {"adamw": 1.0})
    assert "clamping" not in caplog.text
    # warmup clamped to 4 steps: step 4 (0-indexed 3) trained at 4/5 of AdamW's 3e-3
    assert _lrs(line)["adamw"][0] == pytest.approx(3e-3 * 4 / 5, rel=1e-3)
