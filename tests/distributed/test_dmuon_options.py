"""Every shipped dmuon.Muon option against torch.optim.Muon (fp32 NS) + AdamW on real gloo ranks (1D FSDP2,
2 ranks): the shipped defaults ("match_rms_adamw" lr adjustment, Polar Express coefficients, Nesterov), and
"original" + "muon" coefficients + plain momentum + weight decay with `param_groups` overrides on some Muon
matrices and on an AdamW param, matched by separate param groups in the reference optimizers.

Losses, global grad norms, weights and every step's owners' momentum buffers at 1e-5 relative. Both
configurations train in one spawn of the ranks (the spawn, not the steps, is what costs here).
"""

from __future__ import annotations

import pytest

from tests._dist import run_distributed
from tests.dmuon_harness import assert_matches_reference, reference, train
from tests.reference import assert_rel_close

STEPS = 4  # Nesterov and plain momentum only part from the second step on
WORLD = 2
CONFIGS = {
    "shipped": dict(adjust_lr_fn="match_rms_adamw", ns_coefficients="polar_express", nesterov=True),
    "original-plain-groups": dict(
        adjust_lr_fn="original",
        ns_coefficients="muon",
        nesterov=False,
        weight_decay=0.1,
        groups=[
            # every Muon key of one matrix kind overridden, the lr adjustment and coefficients included
            dict(
                match="up_proj",
                lr=0.05,
                momentum=0.8,
                nesterov=True,
                weight_decay=0.3,
                adjust_lr_fn="match_rms_adamw",
                ns_coefficients="polar_express",
            ),
            dict(match="head", lr=3e-3, weight_decay=0.0),  # an AdamW param
        ],
    ),
}


def _train_configs(rank: int, world_size: int, configs: list[dict]):
    return [train(rank, world_size, "fsdp", (world_size,), STEPS, options=c, check_every_step=False) for c in configs]


@pytest.mark.slow
def test_options_match_torch_muon():
    per_rank = run_distributed(_train_configs, WORLD, list(CONFIGS.values()))
    for i, (name, options) in enumerate(CONFIGS.items()):
        results = [r[i] for r in per_rank]
        ref = reference(WORLD, STEPS, options)
        try:
            assert_matches_reference(results, ref)
            for fqn, buf in ref["momentum"][-1].items():  # and through the checkpoint getter
                assert_rel_close(results[0]["osd"]["state"][fqn]["momentum_buffer"], buf, 1e-5, fqn)
        except AssertionError as e:
            raise AssertionError(f"options {name!r}: {e}") from e
    groups = per_rank[0][1]["osd"]["param_groups"]  # the overrides are the optimizer's own param groups
    up = [g for g in groups if any("up_proj" in f for f in g["params"])]
    assert len(up) == 1 and up[0]["lr"] == 0.05 and up[0]["momentum"] == 0.8 and up[0]["nesterov"] is True
    assert all("up_proj" in f for f in up[0]["params"]) and up[0]["kind"] == "muon"
