"""The trainer's initial weights against the documented Llama-3 init, drawn here with plain torch on each full
matrix (not with titan_dmuon/components/initialization.py, materialize or the family's param_inits).

test_start.py holds every layout to the 1-process start, and the 1-process start to `init_weights`: both sides
run the same `param_inits` and `fill_`, so a wrong std (a missing depth scale, a cutoff taken in units of
std) passes there. The reference here is the documented distribution of each parameter (torchtitan's Llama-3
init, titan_dmuon/models/common/block.py and decoder.py):

  tok_embeddings          normal(0, 1)
  attention.wq/wk/wv, w1  trunc_normal(0, 0.02), cut at +-2 (absolute, as nn.init.trunc_normal_)
  attention.wo, w2, w3    trunc_normal(0, 0.02 / sqrt(2 (layer + 1)))  (depth_init)
  norms                   1
  output                  trunc_normal(0, dim^-0.5), cut at +-3 dim^-0.5

and the topology-invariant seeding rule of titan_dmuon/components/initialization.py's docstring: a matrix is cut into
tiles of TILE rows x columns (every tinymodel matrix fits in one), and tile (i, j) of parameter `fqn` is drawn from a
torch.Generator seeded with the 8-byte little-endian BLAKE2b of "seed\\0fqn\\0i\\0j" (63 bits). Checked on one
process and on 2 ranks (FSDP2 shards, DMuon owners): bitwise against that draw, and, independently of the
seeding rule, each matrix's sample std against its documented std.
"""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

from tests._dist import run_distributed
from tests.train_runs import tiny_train_argv

pytestmark = pytest.mark.slow

SEED, VOCAB, DIM, LAYERS, HIDDEN = 7, 258, 64, 2, 192  # tinymodel with the byte tokenizer: ffn 2/3 * 4 * 64 -> 192
TILE = (512, 2048)  # titan_dmuon.components.initialization.TILE as documented; asserted in the ranks


def _argv(dump: str, world: int) -> list[str]:
    return tiny_train_argv(dump, "--training.local_batch_size", str(8 // world), seed=SEED)


def _initial_weights(rank: int, world: int, dump: str) -> dict[str, torch.Tensor] | None:
    """The Trainer's start (build on meta, parallelize, materialize), gathered whole on rank 0."""
    import titan_dmuon.components.initialization
    from titan_dmuon import dmuon
    from titan_dmuon.config import parse_args
    from titan_dmuon.trainer import Trainer

    assert tuple(titan_dmuon.components.initialization.TILE) == TILE
    trainer = Trainer(parse_args(_argv(dump, world)))
    try:
        full = dmuon.get_model_state_dict(trainer.model)
        return full if rank == 0 else None
    finally:
        trainer.close()


# ------------------------------------------------------------------------------------------- the reference
def _documented() -> dict[str, tuple[str, float, float]]:
    """FQN -> (kind, std, cutoff): the Llama-3 init of titan_dmuon/models/llama3 as documented, for tinymodel."""
    out: dict[str, tuple[str, float, float]] = {"tok_embeddings.weight": ("normal", 1.0, math.inf)}
    for layer in range(LAYERS):
        scaled = 0.02 / math.sqrt(2 * (layer + 1))
        p = f"layers.{layer}."
        out |= {p + "attention_norm.weight": ("ones", 0, 0), p + "ffn_norm.weight": ("ones", 0, 0)}
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1"):
            out[f"{p}{name}.weight"] = ("trunc_normal", 0.02, 2.0)
        for name in ("attention.wo", "feed_forward.w2", "feed_forward.w3"):
            out[f"{p}{name}.weight"] = ("trunc_normal", scaled, 2.0)
    out["norm.weight"] = ("ones", 0, 0)
    out["output.weight"] = ("trunc_normal", DIM**-0.5, 3 * DIM**-0.5)
    return out


SHAPES = {
    "tok_embeddings.weight": (VOCAB, DIM),
    "output.weight": (VOCAB, DIM),
    "norm.weight": (DIM,),
    **{
        f"layers.{i}.{name}": shape
        for i in range(LAYERS)
        for name, shape in {
            "attention_norm.weight": (DIM,),
            "ffn_norm.weight": (DIM,),
            "attention.wq.weight": (DIM, DIM),
            "attention.wk.weight": (DIM, DIM),
            "attention.wv.weight": (DIM, DIM),
            "attention.wo.weight": (DIM, DIM),
            "feed_forward.w1.weight": (HIDDEN, DIM),
            "feed_forward.w2.weight": (DIM, HIDDEN),
            "feed_forward.w3.weight": (HIDDEN, DIM),
        }.items()
    },
}


def _tile_generator(fqn: str) -> torch.Generator:
    digest = hashlib.blake2b(f"{SEED}\0{fqn}\0{0}\0{0}".encode(), digest_size=8).digest()
    gen = torch.Generator()
    gen.manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    return gen


def _reference(fqn: str) -> torch.Tensor:
    kind, std, cut = _documented()[fqn]
    shape = SHAPES[fqn]
    if kind == "ones":
        return torch.ones(shape)
    assert shape[0] <= TILE[0] and shape[1] <= TILE[1], "one tile per matrix"
    out = torch.empty(shape)
    if kind == "normal":
        return out.normal_(0.0, std, generator=_tile_generator(fqn))
    return torch.nn.init.trunc_normal_(out, 0.0, std, -cut, cut, generator=_tile_generator(fqn))


def _truncated_std(std: float, cut: float) -> float:
    """The std of N(0, std^2) cut at +-cut."""
    if math.isinf(cut):
        return std
    z = cut / std
    pdf = math.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    return std * math.sqrt(1 - 2 * z * pdf / math.erf(z / math.sqrt(2)))


@pytest.fixture(scope="module", params=[1, 2], ids=["1proc", "fsdp2"])
def start(request, tmp_path_factory) -> tuple[int, dict[str, torch.Tensor]]:
    world = request.param
    weights = run_distributed(_initial_weights, world, str(tmp_path_factory.mktemp("init")))[0]
    return world, weights


def test_every_parameter_has_its_documented_std(start):
    """Each matrix's sample std is its documented std (after truncation), within 6 standard errors; norms are 1."""
    world, weights = start
    assert sorted(weights) == sorted(SHAPES)
    for fqn, (kind, std, cut) in _documented().items():
        w = weights[fqn].double()
        assert tuple(w.shape) == SHAPES[fqn], fqn
        if kind == "ones":
            assert torch.equal(w, torch.ones_like(w)), fqn
            continue
        want = _truncated_std(std, cut)
        got = w.std().item()
        tolerance = 6 * want / math.sqrt(2 * w.numel())  # the std's standard error, 6 times
        assert abs(got - want) <= tolerance, f"{world} rank(s): {fqn} std {got:.5f}, documented {want:.5f}"
        assert abs(w.mean().item()) <= 6 * want / math.sqrt(w.numel()), fqn
        assert w.abs().max().item() <= cut, fqn


def test_every_parameter_is_the_documented_draw(start):
    """Bitwise: each full matrix equals its distribution drawn with plain torch from its tile's generator."""
    world, weights = start
    for fqn in SHAPES:
        assert torch.equal(weights[fqn], _reference(fqn)), f"{world} rank(s): {fqn} differs from the documented draw"
