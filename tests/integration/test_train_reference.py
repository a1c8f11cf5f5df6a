"""train.py (DMuon) against a single-process reference written here, not train.py's own 1-process run.

test_train.py checks that every layout reproduces train.py's 1-process run: consistency. This file checks
correctness: a plain, unsharded model trained in this process by `torch.optim.Muon` (its Newton-Schulz swapped
for an fp32 Polar Express iteration written below) on the Muon matrices + `torch.optim.AdamW` on the rest,
with the warmup-stable-decay schedule, the clipping and the loss written below too. Only the model
(titan_dmuon/models/llama3, initialized the way the trainer does: meta -> to_empty -> manual_seed(seed) -> init_weights)
and the token windows (titan_dmuon.data, which is not what is under test) come from the project.

Every hyper-parameter is passed to train.py explicitly (HPARAMS, tests/train_runs.py), so the reference does not
depend on debug_model.toml's or the dataclasses' defaults. Muon weight decay is 0.1 (the toml has 0) so that decoupled
weight decay takes part. The clipping threshold is the median grad norm of an unclipped reference run (the default
data is this interpreter's standard library, so the norms differ between Python builds): some steps are clipped
and the others are not, on any machine.
Measured: the 1-process run equals the reference bitwise (losses), the 4-rank run within 2e-7 (losses and grad
norms), so 1e-5 leaves a wide margin for summation order while an optimizer-math bug moves the losses by more.
"""

from __future__ import annotations

import contextlib
import math
import re
import statistics
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
import torch.optim._muon as torch_muon

from tests.train_runs import HPARAMS, MUON_PARAMS, flag, read_scalars, run_train, tail

STEPS, SEED, SEQ_LEN = HPARAMS["training.steps"], HPARAMS["training.seed"], HPARAMS["training.seq_len"]
GLOBAL_BATCH = 8
# Short names for the reference below: optimizer.muon.lr -> lr, optimizer.adamw.lr -> adamw_lr, training.seed -> seed.
H = {k.split(".", 1)[1].replace("muon.", "").replace("adamw.", "adamw_"): v for k, v in HPARAMS.items()}
RTOL = 1e-5


def train_argv(local_batch_size: int, dump, max_norm: float) -> list[str]:
    argv = ["--config", "train_configs/debug_model.toml", "--job.dump_folder", str(dump)]
    argv += ["--training.max_norm", repr(max_norm)]
    for key, value in HPARAMS.items():
        argv += [f"--{key}", *flag(value)]
    return argv + ["--training.local_batch_size", str(local_batch_size), "--metrics.log_freq", "1"]


# ------------------------------------------------------------------------------------------- the reference
def lr_factor(step: int) -> float:
    """Warmup (k+1)/(W+1); stable 1; decay over the last D steps, progress (k+1)/(D+1), linearly to min."""
    warmup, decay = H["warmup_steps"], round(STEPS * H["decay_ratio"])
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if step < STEPS - decay:
        return 1.0
    progress = (step - (STEPS - decay) + 1) / (decay + 1)
    return H["min_lr_factor"] + (1 - H["min_lr_factor"]) * (1 - progress)


def _polar_express_coefficients(steps: int) -> list[tuple[float, float, float]]:
    """Amsel et al. 2025 (degree 5), each triple but the last divided by (1.01, 1.01^3, 1.01^5) for safety."""
    raw = [
        (8.28721201814563, -23.595886519098837, 17.300387312530933),
        (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
        (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
        (3.3184196573706015, -2.488488024314874, 0.51004894012372),
        (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    ]
    assert steps <= len(raw)
    return [(a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in raw[:steps]]


def _polar_express_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's NS signature; X / (1.01 ||X||_F), then one quintic per step, in fp32."""
    x = grad.float()
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / (x.norm() * 1.01).clamp(min=eps)
    for a, b, c in ns_coefficients[:ns_steps]:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if grad.size(0) > grad.size(1) else x


def reference_run(max_norm: float) -> tuple[list[float], list[float]]:
    """(losses, grad norms) of STEPS steps on the global batch, one process, no parallelism."""
    from titan_dmuon.data import build_dataloader, build_tokenizer
    from titan_dmuon.models.llama3 import build_model

    tokenizer = build_tokenizer(H["tokenizer"])
    loader = build_dataloader(
        dataset=H["dataset"],
        dataset_path="",
        dataset_field="text",
        tokenizer=tokenizer,
        dp_rank=0,
        dp_world_size=1,
        local_batch_size=GLOBAL_BATCH,
        seq_len=SEQ_LEN,
        split="train",
        seed=SEED,
    )
    model = build_model(H["flavor"], vocab_size=tokenizer.vocab_size, device="meta", max_seq_len=SEQ_LEN)
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))

    regex = re.compile(MUON_PARAMS)
    muon_params = [p for n, p in model.named_parameters() if p.ndim == 2 and regex.search(n)]
    assert len(muon_params) == 14  # 2 blocks x (wq, wk, wv, wo, w1, w2, w3)
    ids = {id(p) for p in muon_params}
    muon = torch.optim.Muon(
        muon_params,
        lr=H["lr"],
        momentum=H["momentum"],
        nesterov=H["nesterov"],
        weight_decay=H["weight_decay"],
        ns_coefficients=_polar_express_coefficients(H["ns_steps"]),
        eps=H["eps"],
        ns_steps=H["ns_steps"],
        adjust_lr_fn=H["adjust_lr_fn"],
    )
    adamw = torch.optim.AdamW(
        [p for p in model.parameters() if id(p) not in ids],
        lr=H["adamw_lr"],
        betas=H["adamw_betas"],
        eps=H["adamw_eps"],
        weight_decay=H["adamw_weight_decay"],
    )
    losses, norms = [], []
    data = iter(loader)
    with mock.patch.object(torch_muon, "_zeropower_via_newtonschulz", _polar_express_fp32):
        for step in range(STEPS):
            inputs, labels = next(data)
            muon.zero_grad()
            adamw.zero_grad()
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
            for opt, base in ((muon, H["lr"]), (adamw, H["adamw_lr"])):
                for group in opt.param_groups:
                    group["lr"] = base * lr_factor(step)
            muon.step()
            adamw.step()
            losses.append(loss.item())
    return losses, norms


@contextlib.contextmanager
def _one_thread():
    """train.py runs with OMP_NUM_THREADS=1: the same CPU kernels' summation order here."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], list[float], float]:
    """(losses, grad norms, max_norm): max_norm is the median norm of an unclipped run of the same steps."""
    with _one_thread():
        max_norm = statistics.median(reference_run(math.inf)[1])
        return (*reference_run(max_norm), max_norm)


# ------------------------------------------------------------------------------------------------ tests
def _run(nproc: int, local_batch_size: int, dump, max_norm: float) -> dict[str, dict[int, float]]:
    proc = run_train(nproc, train_argv(local_batch_size, dump, max_norm))
    assert proc.returncode == 0, tail(proc)
    return read_scalars(dump / "tb")


def _assert_matches_reference(scalars, reference) -> None:
    ref_losses, ref_norms, max_norm = reference
    steps = list(range(1, STEPS + 1))
    assert sorted(scalars["loss/train"]) == steps
    for step in steps:  # the lrs train.py logs for a step are the ones it trains that step with
        assert scalars["lr/muon"][step] == pytest.approx(H["lr"] * lr_factor(step - 1), rel=1e-6), step
        assert scalars["lr/adamw"][step] == pytest.approx(H["adamw_lr"] * lr_factor(step - 1), rel=1e-6), step
    assert min(ref_norms) < max_norm < max(ref_norms)  # some steps are clipped, some not
    for tag, want in (("loss/train", ref_losses), ("grad_norm", ref_norms)):
        got = [scalars[tag][s] for s in steps]
        rel = [abs(g - w) / abs(w) for g, w in zip(got, want, strict=True)]
        worst = max(range(STEPS), key=rel.__getitem__)
        assert rel[worst] <= RTOL, (
            f"{tag}: step {worst + 1} train.py {got[worst]!r} vs reference {want[worst]!r} "
            f"(relative {rel[worst]:.3g} > {RTOL:g})\ntrain.py:  {got}\nreference: {want}"
        )
    assert all(math.isfinite(v) for v in ref_losses) and ref_losses[-1] < ref_losses[0]


@pytest.mark.slow
def test_single_process_dmuon_matches_reference(tmp_path, reference) -> None:
    _assert_matches_reference(_run(1, GLOBAL_BATCH, tmp_path, reference[2]), reference)


@pytest.mark.slow
def test_fsdp_4_ranks_dmuon_matches_reference(tmp_path, reference) -> None:
    """4 DP ranks x 2 sequences: rank r reads windows r, r+4, ... (the reference's global batch)."""
    scalars = _run(4, GLOBAL_BATCH // 4, tmp_path, reference[2])
    _assert_matches_reference(scalars, reference)
    assert max(scalars["dmuon/ns_calls"].values()) < 14  # rank 0 updates only the matrices it owns
