"""Qwen3 (tied tinymodel: one embedding/output Parameter) through train.py on every layout, and its TP plan.

Every run trains `qwen3/tinymodel` for STEPS steps on the same global batch of 8 x 32 tokens (the pattern of
tests/integration/test_train.py: DP rank r reads windows r, r+N, ..., so every layout's mean loss is the single
process's), and its losses (1e-5) and grad norms (1e-4) must be the single process's:

  1 process       dmuon (reference): the tied matrix is no Muon matrix (14 Muon matrices: the blocks' projections)
  4 ranks         1D FSDP dmuon; HSDP 2x2 dmuon; dp2 x tp2 dmuon; 1D FSDP muon_naive == the 1D FSDP dmuon run
  1 vs 2 ranks    checkpoint.initial_load_path from a Hugging Face Qwen3 folder (export_hf of a tiny model):
                  the same first-step loss, on one process and on 2 TP ranks (each loading its shard)
  2 ranks         the TP plan in process: with sequence parallelism, the loss and every grad (the q/k norms', the
                  tied matrix's) equal one process's; without it and without loss parallelism (scripts/generate.py's
                  plan) the model loaded from the HF folder generates one process's tokens
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from tests._dist import run_distributed
from tests.train_runs import assert_same_run, read_scalars, run_train, tail, tiny_train_argv

STEPS = 4
QWEN3 = ["--model.name", "qwen3", "--training.steps", str(STEPS), "--metrics.log_freq", "1"]
QWEN3 += ["--lr_scheduler.warmup_steps", "2"]
VOCAB = 258  # the byte tokenizer's, which the debug config's runs use


def _train(nproc: int, dump: Path, *extra: str) -> dict[str, dict[int, float]]:
    """A qwen3 tinymodel run on `nproc` ranks that must succeed; its TensorBoard scalars."""
    proc = run_train(nproc, tiny_train_argv(dump, *QWEN3, *extra, tensorboard=True), timeout=240)
    assert proc.returncode == 0, tail(proc)
    return read_scalars(dump / "tb")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """1 process, dmuon, local batch 8 (the global batch of every run below)."""
    return _train(1, tmp_path_factory.mktemp("q3_ref"), "--training.local_batch_size", "8")


@pytest.fixture(scope="module")
def fsdp_4_ranks(tmp_path_factory):
    return _train(4, tmp_path_factory.mktemp("q3_fsdp4"), "--training.local_batch_size", "2")


def test_single_process_trains_with_the_tied_matrix_on_adamw(reference) -> None:
    loss = [reference["loss/train"][s] for s in range(1, STEPS + 1)]
    assert all(torch.isfinite(torch.tensor(loss))) and loss[-1] < loss[0] - 0.2, loss
    assert set(reference["dmuon/ns_calls"].values()) == {14.0}  # 2 blocks x (wq wk wv wo w1 w2 w3)


@pytest.mark.slow
def test_fsdp_4_ranks_matches_single_process(fsdp_4_ranks, reference) -> None:
    assert_same_run(fsdp_4_ranks, reference, rtol=1e-5)
    assert set(fsdp_4_ranks["dmuon_mean/ns_calls"].values()) == {14 / 4}  # each Muon matrix once over the ranks


@pytest.mark.slow
def test_hsdp_2x2_matches_single_process(tmp_path, reference) -> None:
    s = _train(4, tmp_path, "--parallelism.data_parallel_replicate_degree", "2", "--training.local_batch_size", "2")
    assert_same_run(s, reference, rtol=1e-5)


@pytest.mark.slow
def test_dp2_tp2_matches_single_process(tmp_path, reference) -> None:
    """TP shards the tied [vocab, dim] matrix on the vocabulary (the embedding row-wise, the output column-wise:
    both dim 0) and FSDP2 shards those rows again over dp: still one Parameter, the reference's run."""
    s = _train(4, tmp_path, "--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4")
    assert_same_run(s, reference, rtol=1e-5)
    assert sum(s["dmuon/bytes_tp_gather"].values()) > 0


@pytest.mark.slow
def test_per_head_dp2_tp2_matches_its_single_process_run(tmp_path, reference) -> None:
    """Per-head Muon (wq/wk/wv's heads and wo's column blocks) on dp2 x tp2, where every head lies in one TP shard
    and is orthogonalized there, equals the same option's 1-process run (whose owner runs NS on every whole
    matrix's blocks), and it is another run than the whole-matrix one."""
    per_head = ["--optimizer.muon.per_head", "true", "--optimizer.muon.per_head_wo", "true"]
    one = _train(1, tmp_path / "one", "--training.local_batch_size", "8", *per_head)
    tp = _train(
        4, tmp_path / "tp", "--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4", *per_head
    )
    assert_same_run(tp, one, rtol=5e-5)
    assert abs(reference["loss/train"][STEPS] - one["loss/train"][STEPS]) > 1e-4  # the whole-matrix run


@pytest.mark.slow
def test_muon_naive_4_ranks_matches_dmuon(tmp_path, fsdp_4_ranks) -> None:
    """The naive baseline (every Muon grad all-gathered, Newton-Schulz on every rank) trains the same model as DMuon
    for the same config and seed (the one train.py test of it: llama3 and qwen3 share the model core)."""
    s = _train(4, tmp_path, "--training.local_batch_size", "2", "--optimizer.name", "muon_naive")
    assert_same_run(s, fsdp_4_ranks, rtol=1e-5)
    assert set(s["muon_naive/ns_calls"].values()) == {14.0}  # every rank orthogonalizes every Muon matrix
    assert min(s["muon_naive/bytes_all_gather"].values()) > 0


# ------------------------------------------------------------------------------------ Hugging Face start
def _hf_folder(folder: Path, vocab: int = VOCAB) -> Path:
    """A tied tinymodel (seed 123, not the runs' seed 7) exported as a Hugging Face Qwen3 folder."""
    from titan_dmuon.components.checkpoint.hf_io import export_hf
    from titan_dmuon.models.qwen3 import SPEC, build_model

    torch.manual_seed(123)
    model = build_model("tinymodel", vocab_size=vocab, device="cpu", max_seq_len=32)
    with torch.no_grad():  # far from the seeded init: peaked attention, blocks that outweigh the embedding
        for block in model.layers.values():
            block.attention.wq.weight.mul_(8)
            block.attention.wk.weight.mul_(8)
            block.attention.wo.weight.mul_(10)
            block.feed_forward.w2.weight.mul_(10)
    export_hf(model.state_dict(), folder, SPEC.state_dict_adapter(model))
    return folder


@pytest.mark.slow
def test_initial_load_from_hf_folder_on_2_tp_ranks_matches_1_process(tmp_path, reference) -> None:
    """The folder's vocabulary is padded past the tokenizer's ids, as published ones are (Qwen3: 151,936 rows for
    151,669 ids): the run takes its size from config.json and writes it into its saved config."""
    from titan_dmuon.config import load_toml

    hf = _hf_folder(tmp_path / "hf", vocab=VOCAB + 62)
    load = ["--checkpoint.initial_load_path", str(hf), "--training.steps", "2"]
    one = _train(1, tmp_path / "one", "--training.local_batch_size", "8", *load)
    two = _train(
        2, tmp_path / "two", "--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2", *load
    )
    assert_same_run(two, one, rtol=1e-5)  # the first step's loss, and the next one's
    # the folder's weights, not the seeded init (which would give the reference's loss to 1e-6)
    assert abs(one["loss/train"][1] - reference["loss/train"][1]) > 0.01
    assert load_toml(str(tmp_path / "one" / "config.toml")).model.vocab_size == VOCAB + 62


# ------------------------------------------------------------------------------------------- the TP plan
def _tp_rank(rank: int, world: int, folder: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from titan_dmuon.components.checkpoint.hf_io import load_hf_weights
    from titan_dmuon.components.generation import Sampling, generate
    from titan_dmuon.models.qwen3 import SPEC, build_model

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    gen = torch.Generator().manual_seed(5)
    tokens, labels = torch.randint(0, VOCAB, (2, 2, 32), generator=gen)
    out = {}

    def reference_model():
        model = build_model("tinymodel", vocab_size=VOCAB, max_seq_len=32)
        model.to_empty(device="cpu")
        model.init_buffers("cpu")
        sd = model.state_dict()
        load_hf_weights(sd, folder, SPEC.state_dict_adapter(model))
        return model

    # training's plan: sequence parallel, loss parallel; every grad equals one process's
    ref = reference_model()
    loss = SPEC.loss_fn(ref(tokens), labels)
    loss.backward()
    model = build_model("tinymodel", vocab_size=VOCAB, max_seq_len=32)
    SPEC.apply_tp(model, mesh)
    out["tied_after_tp"] = model.output.weight is model.tok_embeddings.weight
    out["placements"] = tuple(model.tok_embeddings.weight.placements)
    model.to_empty(device="cpu")
    model.init_buffers("cpu")
    load_hf_weights(model.state_dict(), folder, SPEC.state_dict_adapter(model))
    out["tied_after_to_empty"] = model.output.weight is model.tok_embeddings.weight
    with loss_parallel():
        tp_loss = SPEC.loss_fn(model(tokens), labels)
        tp_loss.backward()
    tp_loss = tp_loss.full_tensor() if isinstance(tp_loss, DTensor) else tp_loss
    out["loss"] = (tp_loss.item(), loss.item())
    grads = dict(ref.named_parameters())
    worst = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        worst[name] = float((g - grads[name].grad).abs().max() / grads[name].grad.abs().max())
    out["grads"] = worst

    # generation's plan (scripts/generate.py): no sequence parallelism, replicated logits
    model = build_model("tinymodel", vocab_size=VOCAB, max_seq_len=32)
    SPEC.apply_tp(model, mesh, loss_parallel=False, sequence_parallel=False)
    model.to_empty(device="cpu")
    SPEC.init_buffers(model, "cpu")
    load_hf_weights(model.state_dict(), folder, SPEC.state_dict_adapter(model))
    with torch.no_grad():
        want = ref(tokens)
        out["logits"] = float((model(tokens) - want).abs().max() / want.abs().max())
    prompts = [[1, 5, 9, 200, 17, 3], [1, 40, 41]]
    sampling = Sampling(max_new_tokens=10)
    out["generated"] = (generate(model.eval(), prompts, sampling).tokens, generate(ref, prompts, sampling).tokens)
    return out


@pytest.mark.slow
def test_tp_plan_q_k_norms_and_tied_matrix(tmp_path) -> None:
    from torch.distributed.tensor import Shard

    folder = str(_hf_folder(tmp_path / "hf"))
    for out in run_distributed(functools.partial(_tp_rank, folder=folder), 2, timeout=240):
        assert out["tied_after_tp"] and out["tied_after_to_empty"]
        assert out["placements"] == (Shard(0),)  # the vocabulary rows, for the embedding and the output
        tp_loss, loss = out["loss"]
        assert abs(tp_loss - loss) <= 1e-6 * loss
        assert {n for n in out["grads"] if "q_norm" in n or "k_norm" in n} and "tok_embeddings.weight" in out["grads"]
        bad = {n: w for n, w in out["grads"].items() if w > 1e-5}
        assert not bad, bad
        assert out["logits"] <= 1e-6
        tp_tokens, tokens = out["generated"]
        assert tp_tokens == tokens and len(tokens[0]) == 10
