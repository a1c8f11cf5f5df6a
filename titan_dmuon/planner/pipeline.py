"""What a pipeline adds to a plan: per pp rank the microbatches whose activations it keeps for backward at its
peak, the schedule's bubble, and the bytes its stages send each other. No process group; the assumptions
(docs/training.md, "Pipeline parallelism"): a stage's forward, input-grad and weight-grad passes each take the
same time (a full backward two forwards), and every stage is as fast as the others.

    held_terms(schedule, pp, r, m, ...)  (blocks, head) bytes rank r holds at its peak, from torch's action list
    in_flight(schedule, pp, r, m, v)     microbatches of rank r's whole part (all its stages) kept at once
    bubble_fraction(schedule, pp, m, v)  the idle share of a step, per rank
    p2p_bytes(...)                       what rank r sends per step (activations forward, their grads backward)
"""

from __future__ import annotations

from titan_dmuon.parallel.pipeline import held_by_schedule, stage_ranks


def in_flight(schedule: str, pp: int, rank: int, m: int, v: int) -> float:
    """Microbatches' activations rank `rank` keeps at its peak, in units of its whole part (v stages of a looped
    or V schedule count 1/v each): GPipe and LoopedBFS run every forward first (m); 1F1B warms up with pp - r
    forwards; the other multi-stage schedules are counted off torch's own action list for the rank (`held_by_schedule`),
    else, should torch's list be out of reach, Megatron's interleaved warm-up 2 (pp - r - 1) + (v - 1) pp + 1
    stage-microbatches."""
    if schedule in ("GPipe", "LoopedBFS"):
        return float(m)
    if schedule == "1F1B":
        return float(min(m, pp - rank))
    held = held_by_schedule(schedule, pp, rank, m, v)
    if held is not None:
        return held[0] / v
    return min(v * m, 2 * (pp - rank - 1) + (v - 1) * pp + 1) / v


def held_terms(
    schedule: str, pp: int, rank: int, m: int, stages: dict[int, tuple[float, float]]
) -> tuple[float, float]:
    """(blocks, head) activation bytes rank `rank` holds at its peak, given each of its stages' (blocks, head)
    bytes per microbatch: torch's action list where the schedule has one (`held_by_schedule`), else every stage times
    `in_flight` (GPipe, 1F1B, LoopedBFS: exact, one stage or all forwards first)."""
    v = len(stages)
    held = None if schedule in ("GPipe", "1F1B", "LoopedBFS") else held_by_schedule(schedule, pp, rank, m, v, stages)
    if held is not None:
        return held[0], held[1]
    k = in_flight(schedule, pp, rank, m, v)
    return k * sum(b for b, _ in stages.values()), k * sum(h for _, h in stages.values())


def bubble_fraction(schedule: str, pp: int, m: int, v: int) -> float:
    """The share of a step each rank idles: (pp - 1) / (m + pp - 1) for GPipe and 1F1B, with v stages per rank
    (pp - 1) / (v m + pp - 1) (Interleaved1F1B, LoopedBFS); the zero-bubble schedules fill it with weight-grad
    passes: a third of that left for InterleavedZeroBubble, none for ZBVZeroBubble once m >= 2 pp (a third of
    1F1B's below), DualPipeV's (pp/2 - 1) slots over its m."""
    if pp == 1:
        return 0.0
    idle = pp - 1
    if schedule in ("GPipe", "1F1B"):
        return idle / (m + idle)
    if schedule in ("Interleaved1F1B", "LoopedBFS"):
        return idle / (v * m + idle)
    if schedule == "InterleavedZeroBubble":
        return (idle / 3) / (v * m + idle / 3)
    if schedule == "ZBVZeroBubble":
        return 0.0 if m >= 2 * pp else (idle / 3) / (m + idle / 3)
    slots = max(pp / 2 - 1, 0.0)  # DualPipeV
    return slots / (m + slots)


def p2p_bytes(schedule: str, pp: int, num_stages: int, rank: int, m: int, activation_bytes: float) -> float:
    """What pp rank `rank` sends per step: each microbatch's activation to the next stage and its grad to the
    previous, for every stage boundary that crosses ranks (`activation_bytes` per microbatch and boundary)."""
    where = stage_ranks(schedule, pp, num_stages)
    sends = 0
    for s in range(num_stages):
        if where[s] != rank:
            continue
        if s + 1 < num_stages and where[s + 1] != rank:
            sends += 1  # activations forward
        if s > 0 and where[s - 1] != rank:
            sends += 1  # their grads backward
    return float(sends * m * activation_bytes)


__all__ = ["bubble_fraction", "held_terms", "in_flight", "p2p_bytes"]
