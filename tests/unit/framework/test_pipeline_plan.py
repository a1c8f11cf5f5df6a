"""The pipeline split (titan_dmuon/parallel/pipeline.py) and the planner's pipeline figures
(titan_dmuon/planner/pipeline.py) without any process group: the default split, the explicit one and its errors,
which stages each pp rank holds, what each rank sends, the bubble and the microbatches in flight."""

from __future__ import annotations

import dataclasses

import pytest

from titan_dmuon.config import ConfigError, JobConfig
from titan_dmuon.parallel.pipeline import plan_stages, stage_ids, stage_ranks
from titan_dmuon.planner.pipeline import bubble_fraction, in_flight, p2p_bytes


def _cfg(**parallelism) -> JobConfig:
    cfg = JobConfig()
    return dataclasses.replace(cfg, parallelism=dataclasses.replace(cfg.parallelism, **parallelism))


def test_default_split_balances_blocks_with_the_embedding_and_the_head() -> None:
    stages = plan_stages(_cfg(pipeline_parallel_degree=2, pipeline_parallel_schedule="1F1B"), 6)
    assert stages == [
        ["tok_embeddings", "layers.0", "layers.1", "layers.2"],
        ["layers.3", "layers.4", "layers.5", "norm", "output"],
    ]
    looped = plan_stages(_cfg(pipeline_parallel_degree=2, pipeline_parallel_schedule="Interleaved1F1B"), 6)
    assert [len(s) for s in looped] == [2, 2, 2, 3]  # 8 units (6 blocks, embedding, head) over 4 stages
    per_stage = plan_stages(
        _cfg(pipeline_parallel_degree=2, pipeline_parallel_layers_per_stage=1, pipeline_parallel_schedule="LoopedBFS"),
        2,
    )
    assert per_stage == [["tok_embeddings"], ["layers.0"], ["layers.1"], ["norm", "output"]]


@pytest.mark.parametrize(
    "split,message",
    [
        ("tok_embeddings,layers.0;layers.1,layers.0,norm,output", "is in stages 0 and 1"),
        ("tok_embeddings,layers.0;norm,output", "no stage holds layers.1"),
        ("layers.0,tok_embeddings;layers.1,norm,output", None),
        ("layers.1,tok_embeddings;layers.0,norm,output", "must run in order"),
        ("tok_embeddings,layers.0,norm;layers.1,output", "the last norm and output"),
        ("tok_embeddings,layers.0;layers.1,norm,output,lm_head", "'lm_head' is no module"),
    ],
)
def test_explicit_split_errors_name_the_problem(split, message) -> None:
    cfg = _cfg(pipeline_parallel_degree=2, module_fqns_per_model_part=split)
    if message is None:
        assert plan_stages(cfg, 2)[0] == ["layers.0", "tok_embeddings"]
        return
    with pytest.raises(ConfigError, match=message):
        plan_stages(cfg, 2)


def test_stage_placement_and_sends() -> None:
    assert [stage_ids(r, 4, 8, "Interleaved1F1B") for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [stage_ids(r, 4, 8, "ZBVZeroBubble") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert stage_ranks("DualPipeV", 4, 8) == [0, 1, 2, 3, 3, 2, 1, 0]
    # 1F1B over 4 ranks: the ends send one way, the middle both; 10 microbatches of 1 MiB
    assert [p2p_bytes("1F1B", 4, 4, r, 10, 2.0**20) for r in range(4)] == [
        10 * 2.0**20,
        *[20 * 2.0**20] * 2,
        10 * 2.0**20,
    ]
    # V: stages 3 and 4 share rank 3, so it sends only to rank 2 (both ways)
    assert p2p_bytes("ZBVZeroBubble", 4, 8, 3, 10, 1.0) == 20.0
    assert p2p_bytes("ZBVZeroBubble", 4, 8, 0, 10, 1.0) == 20.0  # stage 0 forward, stage 7 backward


def test_bubble_and_in_flight() -> None:
    assert bubble_fraction("1F1B", 4, 12, 1) == pytest.approx(3 / 15)
    assert bubble_fraction("Interleaved1F1B", 4, 12, 2) == pytest.approx(3 / 27)
    assert bubble_fraction("ZBVZeroBubble", 4, 8, 2) == 0.0
    assert bubble_fraction("GPipe", 1, 12, 1) == 0.0
    assert [in_flight("1F1B", 4, r, 12, 1) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight("GPipe", 4, 2, 12, 1) == 12
    # torch's own interleaved order: rank 0 warms up 2 (pp - 1) + (v - 1) pp + 1 = 11 stage-microbatches
    assert in_flight("Interleaved1F1B", 4, 0, 12, 2) == pytest.approx(11 / 2)
