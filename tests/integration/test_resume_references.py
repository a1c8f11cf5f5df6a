"""Saving and resuming against references that do not run the checkpoint code (titan_dmuon/components/checkpoint/).

test_checkpoint.py compares a resumed run with a straight run that also saved: a save that changes the live
state (rounds the optimizer state, re-seeds or advances a generator, advances the data loader) before it
captures it changes both runs alike, and the comparison cannot see it. Here the references never save:

  never     a run with checkpoints disabled (nothing of the checkpoint code runs)
  saves     the same run, saving at step SAVE_AT (and at the last step), in the same process, no resume
  resumed   a fresh Trainer that loads `saves`' step-SAVE_AT checkpoint and trains on to STEPS

Each layout's three runs are one spawned job (tests/_dist.py); each test holds them to a reference of its own:

  optimizer  `saves` and `resumed` equal `never` bitwise: every loss and grad norm, the final weights and the
             final optimizer state (Muon momentum, AdamW moments and steps, param groups). The step-SAVE_AT
             checkpoint, read with DCP's own reader, holds what SAVE_AT steps of torch.optim.Muon (its
             Newton-Schulz in fp32, tests/reference.py) + torch.optim.AdamW give on the same model, data, clipping
             and schedule, trained here: every weight, momentum buffer, AdamW moment and step, and each param
             group's lr and the schedule's position
  RNG        after every step the test draws from torch's, Python's and NumPy's global generators, as a model
             with dropout or user code would. The draws equal those of a torch.Generator seeded with
             training.seed (the trainer's rule: torch.manual_seed(seed), and nothing else in a step draws from
             it; the data loader's iterators draw their base seeds from a generator of their own) and of
             random.Random / numpy RandomState seeded as the test seeded the process; the checkpoint's
             rng states equal those generators' states after SAVE_AT draws; the resumed run (whose Python and
             NumPy generators the test scrambles first) continues the very same streams
  data       the corpus is one small text file (one unit, so every row reads its paragraphs in file order, over
             and over); every step's inputs equal the windows cut from that token stream, computed here from the
             file (BOS bytes EOS per paragraph, stride seq_len), and the saved and final positions ([unit pass,
             paragraph, token]) equal the ones counted from the paragraph lengths
"""

from __future__ import annotations

import functools
import random
import re
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests._dist import run_distributed
from tests.train_runs import HPARAMS, MUON_PARAMS, flag, read_checkpoint

pytestmark = pytest.mark.slow

STEPS, SAVE_AT, SEQ, GLOBAL_BATCH, SEED = 8, 4, 32, 8, 42
PY_SEED, NP_SEED = 1234, 5678  # per rank: + rank
BOS, EOS = 256, 257  # the byte tokenizer's
LAYOUTS = {"1proc": 1, "fsdp2": 2}  # ranks
# Every hyper-parameter, passed to train.py and to the reference (none taken from debug_model.toml's defaults): the
# optimizers' of tests/integration/test_train_reference.py (HPARAMS, tests/train_runs.py), and a schedule and model
# settings of this module's own.
HP = {
    **{key: value for key, value in HPARAMS.items() if key.startswith("optimizer.")},
    "lr_scheduler.warmup_steps": 2,  # then decay over the other STEPS - 2 steps (decay_ratio unset), linearly
    "lr_scheduler.decay_type": "linear",
    "lr_scheduler.min_lr_factor": 0.1,
    "training.max_norm": 1.0,
    "training.mixed_precision_param": "float32",
    "training.mixed_precision_reduce": "float32",
    "model.tokenizer": "byte",
}
# Paragraphs of different lengths (one of two lines); ~130 tokens in all, so the SEQ-token windows of STEPS steps
# wrap around the file once and the saved position falls inside a paragraph.
PARAGRAPHS = [
    "alpha beta gamma",
    "the quick brown fox\njumps over the dog",
    "delta",
    "epsilon zeta eta theta iota",
    "kappa lambda mu",
    "nu xi omicron pi rho",
    "sigma tau upsilon phi chi psi omega",
]


def _corpus(folder: Path) -> Path:
    path = folder / "corpus.txt"
    path.write_text("\n\n".join(PARAGRAPHS) + "\n")
    return path


def _argv(dump: Path, corpus: Path, world: int, checkpoint: bool) -> list[str]:
    hp = [v for key, value in HP.items() for v in (f"--{key}", *flag(value))]
    return hp + [
        "--config",
        "train_configs/debug_model.toml",
        "--model.flavor",
        "tinymodel",
        "--training.seq_len",
        str(SEQ),
        "--training.steps",
        str(STEPS),
        "--training.seed",
        str(SEED),
        "--training.local_batch_size",
        str(GLOBAL_BATCH // world),
        "--training.dataset",
        "text",
        "--training.dataset_path",
        str(corpus),
        "--metrics.enable_tensorboard",
        "false",
        "--comm.heartbeat_seconds",
        "0",
        "--job.dump_folder",
        str(dump),
        "--checkpoint.enable",
        str(checkpoint).lower(),
        "--checkpoint.interval",
        str(SAVE_AT),
    ]


# ---------------------------------------------------------------------------------------- the ranks' side
def _train(argv: list[str], rank: int, py_seed: int, np_seed: int) -> dict:
    """One Trainer from scratch (or from the folder's checkpoint): per step the loss, grad norm, this rank's
    inputs and one draw from each global generator; at the end the full weights and optimizer state, the
    generators' states and the data position."""
    from titan_dmuon import dmuon
    from titan_dmuon.config import parse_args
    from titan_dmuon.trainer import Trainer

    cfg = parse_args(argv)  # (tyro's cache draws from Python's generator: train.py parses before anything else)
    random.seed(py_seed)
    np.random.seed(np_seed)
    trainer = Trainer(cfg)
    try:
        out = {"start": trainer.step, "steps": {}}
        step_fn = trainer.train_step

        def recorded_step(data_iter):
            inputs = []

            def batches():
                while True:
                    batch = next(data_iter)
                    inputs.append(batch[0].clone())
                    yield batch

            loss, norm, ntokens = step_fn(batches())
            draws = (torch.rand(()).item(), random.random(), float(np.random.random()))
            out["steps"][trainer.step] = {"loss": loss, "grad_norm": norm, "inputs": inputs, "draws": draws}
            return loss, norm, ntokens

        trainer.train_step = recorded_step
        trainer.train()
        out["model"] = dmuon.get_model_state_dict(trainer.model)
        out["optimizer"] = dmuon.get_optimizer_state_dict(trainer.model, trainer.optimizer)
        out["rng"] = (torch.get_rng_state(), random.getstate(), np.random.get_state())
        out["position"] = trainer.dataloader.position()
        return out
    finally:
        trainer.close()


def _three_runs(rank: int, world: int, root: str, corpus: str) -> dict:
    root_path, corpus_path = Path(root), Path(corpus)
    py, npy = PY_SEED + rank, NP_SEED + rank
    out = {
        "never": _train(_argv(root_path / "never", corpus_path, world, False), rank, py, npy),
        "saves": _train(_argv(root_path / "saves", corpus_path, world, True), rank, py, npy),
    }
    if rank == 0:
        step = root_path / "resumed" / "checkpoint" / f"step-{SAVE_AT}"
        shutil.copytree(root_path / "saves" / "checkpoint" / f"step-{SAVE_AT}", step)
    dist.barrier()
    # other seeds: the resumed run must get its generators back from the checkpoint
    out["resumed"] = _train(_argv(root_path / "resumed", corpus_path, world, True), rank, py + 99, npy + 99)
    return out


# ---------------------------------------------------------------------------------------- the references
def _stream() -> tuple[list[int], list[int]]:
    """(the training split's token stream of the corpus, each paragraph's token count), from the text alone: a
    paragraph is held out for validation when the CRC32 of its text is in the lowest 2% of the range, and when that
    holds out none of two or more, the paragraph with the lowest CRC32 is (docs/training.md, Data)."""
    crc = {p: zlib.crc32(p.encode()) for p in PARAGRAPHS}
    held = {p for p in PARAGRAPHS if crc[p] < 0.02 * 2**32} or {min(PARAGRAPHS, key=crc.__getitem__)}
    train = [p for p in PARAGRAPHS if p not in held]
    assert len(train) >= 5, "the corpus must keep most paragraphs for training"
    docs = [[BOS, *p.encode(), EOS] for p in train]
    return [t for d in docs for t in d], [len(d) for d in docs]


def _window(stream: list[int], step: int) -> torch.Tensor:
    """The inputs of window `step` (0-based): tokens [step * SEQ, step * SEQ + SEQ) of the endless stream."""
    return torch.tensor([stream[(step * SEQ + i) % len(stream)] for i in range(SEQ)])


def _position(lengths: list[int], steps: int) -> list[int]:
    """[passes over the unit, paragraph, token] where the window after `steps` windows starts (SEQ tokens each)."""
    passes, at = divmod(steps * SEQ, sum(lengths))
    for doc, n in enumerate(lengths):
        if at < n:
            return [passes, doc, at]
        at -= n
    raise AssertionError("unreachable")


def _lr_factor(step: int) -> float:
    """The schedule's factor for 0-based step `step`: warmup (k+1)/(W+1), then a linear decay over the other
    D = STEPS - W steps, progress (k+1)/(D+1), to min_lr_factor."""
    warmup, floor = HP["lr_scheduler.warmup_steps"], HP["lr_scheduler.min_lr_factor"]
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = (step - warmup + 1) / (STEPS - warmup + 1)
    return floor + (1 - floor) * (1 - progress)


@functools.cache
def _reference_training(steps: int):
    """(model, torch.optim.Muon, torch.optim.AdamW) after `steps` steps on the corpus windows, in this process:
    the model as the trainer starts it (meta -> to_empty -> manual_seed(seed) -> init_weights), the global batch
    GLOBAL_BATCH copies of the step's window, mean cross-entropy, the global grad norm clipped to max_norm."""
    import torch.nn.functional as F

    from tests.reference import fp32_torch_muon, reference_optimizers
    from titan_dmuon.models.llama3 import build_model

    stream, _ = _stream()
    model = build_model("tinymodel", vocab_size=258, device="meta", max_seq_len=SEQ)
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    regex = re.compile(MUON_PARAMS)
    muon, adamw = reference_optimizers(
        model,
        lambda name, p: p.ndim == 2 and regex.search(name) is not None,
        lr=HP["optimizer.muon.lr"],
        momentum=HP["optimizer.muon.momentum"],
        nesterov=HP["optimizer.muon.nesterov"],
        weight_decay=HP["optimizer.muon.weight_decay"],
        ns_coefficients="polar_express",
        ns_steps=HP["optimizer.muon.ns_steps"],
        adjust_lr_fn="match_rms_adamw",
        adamw_lr=HP["optimizer.adamw.lr"],
        adamw_betas=HP["optimizer.adamw.betas"],
        adamw_eps=HP["optimizer.adamw.eps"],
        adamw_weight_decay=HP["optimizer.adamw.weight_decay"],
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks' summation order
    try:
        with fp32_torch_muon():
            for step in range(steps):
                window = torch.tensor([stream[(step * SEQ + i) % len(stream)] for i in range(SEQ + 1)])
                batch = window.expand(GLOBAL_BATCH, SEQ + 1)
                muon.zero_grad()
                adamw.zero_grad()
                logits = model(batch[:, :-1].contiguous())
                F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten()).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), HP["training.max_norm"])
                for opt, base in ((muon, HP["optimizer.muon.lr"]), (adamw, HP["optimizer.adamw.lr"])):
                    for group in opt.param_groups:
                        group["lr"] = base * _lr_factor(step)
                muon.step()
                adamw.step()
    finally:
        torch.set_num_threads(threads)
    return model, muon, adamw


def _read_values(folder: Path, keys: list[str]) -> dict:
    """The non-tensor items `keys` of a DCP checkpoint (param group hyper-parameters), read by DCP's own reader."""
    values = dict.fromkeys(keys, None)
    dcp.load(values, checkpoint_id=folder, no_dist=True)
    return values


@pytest.fixture(scope="module", params=list(LAYOUTS))
def runs(request, tmp_path_factory):
    """(layout, world size, per-rank results, the root folder)."""
    world = LAYOUTS[request.param]
    root = tmp_path_factory.mktemp(f"runs-{request.param}")
    corpus = _corpus(root)
    results = run_distributed(_three_runs, world, str(root), str(corpus), timeout=240)
    return request.param, world, results, root


def _assert_equal(got, want, what: str) -> None:
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), what
        for k in want:
            _assert_equal(got[k], want[k], f"{what}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), what
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_equal(g, w, f"{what}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), f"{what} differs"
    else:
        assert got == want, f"{what}: {got!r} != {want!r}"


# ------------------------------------------------------------------------------------------------ tests
def test_saving_and_resuming_change_nothing_of_the_run(runs):
    """A run that saves at step SAVE_AT, and a resume from that checkpoint, equal a run that never saves: every
    loss and grad norm, and the final weights and optimizer state, bitwise."""
    layout, _, results, _ = runs
    for rank, r in enumerate(results):
        never, saves, resumed = r["never"], r["saves"], r["resumed"]
        assert never["start"] == saves["start"] == 0 and resumed["start"] == SAVE_AT
        assert sorted(never["steps"]) == sorted(saves["steps"]) == list(range(1, STEPS + 1))
        assert sorted(resumed["steps"]) == list(range(SAVE_AT + 1, STEPS + 1))
        for name, run in (("saves", saves), ("resumed", resumed)):
            for step, rec in run["steps"].items():
                for key in ("loss", "grad_norm"):
                    want = never["steps"][step][key]
                    assert rec[key] == want, (
                        f"{layout} rank {rank}: {name} {key} at step {step} {rec[key]!r} != {want!r}"
                    )
            _assert_equal(run["model"], never["model"], f"{layout} rank {rank}: {name} final weights")
            _assert_equal(run["optimizer"], never["optimizer"], f"{layout} rank {rank}: {name} final optimizer state")
        assert len(never["optimizer"]["state"]) == len(never["model"])  # every param has its state


def test_rng_streams_follow_the_seed_through_save_and_resume(runs):
    """The generators a step draws from: torch's is training.seed's stream (a torch.Generator seeded here), the
    Python and NumPy ones the streams the process was seeded with; saving does not draw from any of them, the
    checkpoint holds their states after SAVE_AT steps, and the resumed run continues each stream."""
    layout, _, results, root = runs
    saved = read_checkpoint(root / "saves" / "checkpoint" / f"step-{SAVE_AT}")
    for rank, r in enumerate(results):
        gen, py, npy = torch.Generator(), random.Random(PY_SEED + rank), np.random.RandomState(NP_SEED + rank)
        gen.manual_seed(SEED)
        want = {}
        for step in range(1, STEPS + 1):
            want[step] = (torch.rand((), generator=gen).item(), py.random(), float(npy.random_sample()))
            if step == SAVE_AT:
                at_save = (gen.get_state(), py.getstate(), npy.get_state())
        for name in ("never", "saves", "resumed"):
            for step, rec in results[rank][name]["steps"].items():
                assert rec["draws"] == want[step], f"{layout} rank {rank}: {name}'s draws after step {step}"
            torch_state, py_state, np_state = r[name]["rng"]
            assert torch.equal(torch_state, gen.get_state()), f"{layout} rank {rank}: {name}'s final torch RNG"
            assert py_state == py.getstate(), f"{layout} rank {rank}: {name}'s final Python RNG"
            assert np.array_equal(np_state[1], npy.get_state()[1]) and np_state[2] == npy.get_state()[2], name
        key = f"rng.rank{rank}"
        assert torch.equal(saved[f"{key}.torch"], at_save[0]), f"{layout} rank {rank}: the saved torch RNG"
        version, mt, _ = at_save[1]
        assert saved[f"{key}.python"].tolist() == [version, *mt], f"{layout} rank {rank}: the saved Python RNG"
        _, keys, pos, _, _ = at_save[2]
        assert saved[f"{key}.numpy"].tolist()[: len(keys) + 1] == [*keys.tolist(), pos], f"{layout} rank {rank}: numpy"


def test_data_follows_the_corpus_token_stream(runs):
    """Every step's inputs are the next SEQ-token window of the corpus's token stream, computed from the file,
    whether the run never saved, saved, or resumed; the saved and final positions are the counted ones."""
    layout, world, results, root = runs
    stream, lengths = _stream()
    assert STEPS * SEQ > len(stream) > SAVE_AT * SEQ  # the windows wrap around the file after the save
    for rank, r in enumerate(results):
        for name in ("never", "saves", "resumed"):
            for step, rec in r[name]["steps"].items():
                (inputs,) = rec["inputs"]
                assert inputs.shape == (GLOBAL_BATCH // world, SEQ)
                want = _window(stream, step - 1)
                for row in range(inputs.shape[0]):
                    assert torch.equal(inputs[row], want), f"{layout} rank {rank}: {name}'s inputs at step {step}"
            final = r[name]["position"]
            assert final["step"] == STEPS, (name, final)
            assert all(v == _position(lengths, STEPS) for v in final["rows"].values()), (layout, rank, name, final)
    saved = read_checkpoint(root / "saves" / "checkpoint" / f"step-{SAVE_AT}")
    assert saved["dataloader.step"].item() == SAVE_AT
    assert saved["dataloader.rows"].tolist() == [_position(lengths, SAVE_AT)] * GLOBAL_BATCH


def test_saved_optimizer_state_is_torch_optims(runs):
    """The step-SAVE_AT checkpoint against torch.optim.Muon + AdamW trained SAVE_AT steps here: each FQN's weight,
    momentum buffer, AdamW moments and step under its own name, each group's lr, the schedule's step."""
    from tests.reference import assert_rel_close

    layout, _, _, root = runs
    folder = root / "saves" / "checkpoint" / f"step-{SAVE_AT}"
    saved = read_checkpoint(folder)
    model, muon, adamw = _reference_training(SAVE_AT)
    checked = 0
    for fqn, p in model.named_parameters():
        assert_rel_close(saved[f"model.{fqn}"], p.detach(), 1e-5, f"{layout}: weight {fqn}")
        key = f"optimizer.state.{fqn}."
        if p in muon.state:
            want = {"momentum_buffer": muon.state[p]["momentum_buffer"]}
        else:
            want = {k: adamw.state[p][k] for k in ("exp_avg", "exp_avg_sq")}
            assert saved[key + "step"].item() == adamw.state[p]["step"].item() == SAVE_AT, fqn
        got = sorted(k.removeprefix(key) for k in saved if k.startswith(key) and "." not in k.removeprefix(key))
        assert got == sorted(want) + ([] if p in muon.state else ["step"]), (fqn, got)
        for name, value in want.items():
            assert_rel_close(saved[key + name], value, 1e-5, f"{layout}: {name} of {fqn}")
            checked += 1
    assert checked == 14 + 2 * (len(list(model.parameters())) - 14)
    assert saved["lr_scheduler.last_epoch"].item() == SAVE_AT
    groups = _read_values(folder, [f"optimizer.param_groups.{i}.{k}" for i in (0, 1) for k in ("kind", "lr")])
    base = {"muon": HP["optimizer.muon.lr"], "adamw": HP["optimizer.adamw.lr"]}
    for i in (0, 1):
        kind = groups[f"optimizer.param_groups.{i}.kind"]
        assert groups[f"optimizer.param_groups.{i}.lr"] == pytest.approx(base[kind] * _lr_factor(SAVE_AT), rel=1e-12)
