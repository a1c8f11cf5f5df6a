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

from titan_dmuon.parallel.pipeline import V_SCHEDULES


def in_flight(schedule: str, pp: int, rank: int, m: int, v: int) -> float:
    """Microbatches' activations rank `rank` keeps at its peak, in units of its whole part (v stages of a looped
    or V schedule count 1/v each): GPipe and LoopedBFS run every forward first (m); 1F1B warms up with pp - r
    forwards; the other multi-stage schedules are counted off torch's own action list for the rank (`_held`),
    else, should torch's list be out of reach, Megatron's interleaved warm-up 2 (pp - r - 1) + (v - 1) pp + 1
    stage-microbatches."""
    if schedule in ("GPipe", "LoopedBFS"):
        return float(m)
    if schedule == "1F1B":
        return float(min(m, pp - rank))
    held = _held(schedule, pp, rank, m, v)
    if held is not None:
        return held[0] / v
    return min(v * m, 2 * (pp - rank - 1) + (v - 1) * pp + 1) / v


def _held(
    schedule: str, pp: int, rank: int, m: int, v: int, weights: dict[int, tuple[float, ...]] | None = None
) -> tuple[float, ...] | None:
    """What rank `rank` holds at once at its peak in torch's action list for `schedule`: a forward (F) holds its
    stage-microbatch's activations until its full backward (B) or, split, its weight pass (W: the input pass I
    leaves what W needs). With `weights` (stage -> a tuple of byte terms per microbatch) the terms at the peak of
    their sum; else the number of stage-microbatches, as a 1-tuple. The list comes from the schedule class's own
    planning method, on an instance built without stages or a process group (the attributes it reads); None if
    that is not possible (GPipe and 1F1B have no such method: their closed forms are exact)."""
    try:
        from torch.distributed.pipelining.schedules import _ComputationType, get_schedule_class

        cls = get_schedule_class(schedule)
        plan = cls.__new__(cls)
        plan.pp_group_size, plan._n_microbatches, plan.n_local_stages, plan.num_stages = pp, m, v, v * pp
        plan.number_of_rounds = max(1, m // pp)
        plan.microbatches_per_round = m // plan.number_of_rounds
        actions = plan._calculate_single_rank_operations(rank)
    except Exception:  # noqa: BLE001 - a private method of torch's: the caller falls back to a closed form
        return None
    kinds = _ComputationType
    live: set[tuple[int, int]] = set()
    best: tuple[float, ...] = (0.0,)

    def terms() -> tuple[float, ...]:
        if weights is None:
            return (float(len(live)),)
        return tuple(sum(col) for col in zip(*(weights[s] for s, _ in live), strict=True)) if live else best

    for action in actions:
        if action is None:
            continue
        for a in getattr(action, "sub_actions", None) or (action,):
            key = (a.stage_index, a.microbatch_index)
            if a.computation_type == kinds.FORWARD:
                live.add(key)
                now = terms()
                if sum(now) > sum(best):
                    best = now
            elif a.computation_type in (kinds.FULL_BACKWARD, kinds.BACKWARD_WEIGHT):
                live.discard(key)
    return best


def held_terms(
    schedule: str, pp: int, rank: int, m: int, stages: dict[int, tuple[float, float]]
) -> tuple[float, float]:
    """(blocks, head) activation bytes rank `rank` holds at its peak, given each of its stages' (blocks, head)
    bytes per microbatch: torch's action list where the schedule has one (`_held`), else every stage times
    `in_flight` (GPipe, 1F1B, LoopedBFS: exact, one stage or all forwards first)."""
    v = len(stages)
    held = None if schedule in ("GPipe", "1F1B", "LoopedBFS") else _held(schedule, pp, rank, m, v, stages)
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


def stage_ranks(schedule: str, pp: int, num_stages: int) -> list[int]:
    """The pp rank of every stage."""
    if schedule in V_SCHEDULES:
        return [s if s < pp else 2 * pp - 1 - s for s in range(num_stages)]
    return [s % pp for s in range(num_stages)]


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


__all__ = ["bubble_fraction", "held_terms", "in_flight", "p2p_bytes", "stage_ranks"]
