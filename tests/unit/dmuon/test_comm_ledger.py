"""DMuon's byte ledger (titan_dmuon.dmuon.comm.CommLedger) and its counting rule (docs/dmuon.md, Bytes per step)."""

import pytest
import torch

from titan_dmuon.dmuon.comm import KINDS, CommLedger, Work


def test_kinds():
    assert KINDS == (
        "broadcast",
        "reduce",
        "replicate_reduce",
        "replicate_broadcast",
        "tp_gather",
        "tp_scatter",
        "tp_gram",
    )


def test_all_reduce_counts_twice_the_share():
    led = CommLedger()
    led.record("tp_gram", 64, 4, 4, factor=2)  # ring all-reduce: 2(N-1)/N·P
    assert led.current["tp_gram"] == 96.0 and led.current_bytes["tp_gram"] == 384.0


def test_record_share_elements_and_bytes():
    led = CommLedger()
    led.record("broadcast", 1000, 4, 2)  # 3/4 * 1000 = 750 elements, 1500 bytes (bf16)
    assert led.current["broadcast"] == 750.0
    assert led.current_bytes["broadcast"] == 1500.0
    led.record("broadcast", 600, 3, 4)  # + 2/3 * 600 = 400 elements, 1600 bytes (fp32)
    assert led.current["broadcast"] == pytest.approx(1150.0, abs=1e-9)
    assert led.current_bytes["broadcast"] == pytest.approx(3100.0, abs=1e-9)
    led.record("reduce", 7, 8, 4)  # 7/8 * 7 = 6.125 elements, 24.5 bytes
    assert led.current["reduce"] == pytest.approx(6.125, abs=1e-12)
    assert led.current_bytes["reduce"] == pytest.approx(24.5, abs=1e-12)
    assert led.current["broadcast"] == pytest.approx(1150.0, abs=1e-9)  # kinds are separate
    assert led.ops["broadcast"] == 2 and led.ops["reduce"] == 1


def test_group_of_one_moves_nothing():
    led = CommLedger()
    led.record("tp_gather", 12345, 1, 4)
    assert led.current["tp_gather"] == 0.0
    assert led.current_bytes["tp_gather"] == 0.0


def test_unknown_kind_raises():
    led = CommLedger()
    with pytest.raises(ValueError, match="all_gather"):
        led.record("all_gather", 10, 2, 4)
    with pytest.raises(ValueError):
        led.record("Broadcast", 10, 2, 4)
    assert sum(led.current.values()) == 0.0


def test_end_step_moves_and_resets():
    led = CommLedger()
    led.record("broadcast", 800, 8, 2)  # 700 el, 1400 B
    led.record("replicate_reduce", 100, 2, 4)  # 50 el, 200 B
    led.end_step()
    assert set(led.last_step) == set(KINDS) and list(led.last_step) == list(KINDS)
    assert set(led.last_step_bytes) == set(KINDS)
    assert led.last_step == {
        "broadcast": 700.0,
        "reduce": 0.0,
        "replicate_reduce": 50.0,
        "replicate_broadcast": 0.0,
        "tp_gather": 0.0,
        "tp_scatter": 0.0,
        "tp_gram": 0.0,
    }
    assert led.last_step_bytes == {
        "broadcast": 1400.0,
        "reduce": 0.0,
        "replicate_reduce": 200.0,
        "replicate_broadcast": 0.0,
        "tp_gather": 0.0,
        "tp_scatter": 0.0,
        "tp_gram": 0.0,
    }
    assert all(isinstance(v, float) for v in led.last_step.values())
    # current is reset
    assert sum(led.current.values()) == 0.0 and sum(led.current_bytes.values()) == 0.0
    # the next step counts from zero and replaces last_step
    led.record("tp_scatter", 30, 3, 1)  # 20 el, 20 B
    assert led.current["tp_scatter"] == 20.0
    assert led.last_step["broadcast"] == 700.0  # last_step untouched until end_step
    led.end_step()
    assert led.last_step == {**{k: 0.0 for k in KINDS}, "tp_scatter": 20.0}
    assert led.last_step_bytes == {**{k: 0.0 for k in KINDS}, "tp_scatter": 20.0}
    # an empty step reports all zeros
    led.end_step()
    assert led.last_step == {k: 0.0 for k in KINDS}
    assert led.last_step_bytes == {k: 0.0 for k in KINDS}


def test_end_step_snapshot_is_independent():
    led = CommLedger()
    led.record("reduce", 10, 2, 4)
    led.end_step()
    snap = led.last_step
    led.record("reduce", 10, 2, 4)
    assert snap["reduce"] == 5.0  # later records do not leak into the closed step


def test_ledgers_do_not_share_state():
    a, b = CommLedger(), CommLedger()
    a.record("broadcast", 10, 2, 4)
    assert b.current.get("broadcast", 0.0) == 0.0


def test_z2_and_hsdp_bytes_formula():
    # The Z2 and HSDP bytes (docs/dmuon.md, Bytes per step). Z2 per step for dedicated params: one broadcast
    # (forward) + one reduce of P_M elements on N ranks: 2 (N-1)/N * P_M elements; HSDP adds (R-1)/R * P_M
    # reduce + (R-1)/R * P_M publish.
    N, R = 8, 2
    shapes = [(64, 32), (32, 32), (16, 48)]
    led = CommLedger()
    P = 0
    for s in shapes:
        t = torch.empty(s, dtype=torch.bfloat16)
        P += t.numel()
        led.record("broadcast", t.numel(), N, t.element_size())
        led.record("reduce", t.numel(), N, t.element_size())
        led.record("replicate_reduce", t.numel(), R, t.element_size())
        led.record("replicate_broadcast", t.numel(), R, t.element_size())
    led.end_step()
    assert P == 64 * 32 + 32 * 32 + 16 * 48
    assert led.last_step["broadcast"] + led.last_step["reduce"] == pytest.approx(2 * (N - 1) / N * P, rel=1e-12)
    assert led.last_step["replicate_reduce"] == pytest.approx((R - 1) / R * P, rel=1e-12)
    assert led.last_step["replicate_broadcast"] == pytest.approx((R - 1) / R * P, rel=1e-12)
    assert sum(led.last_step_bytes.values()) == pytest.approx(2 * (2 * (N - 1) / N + 2 * (R - 1) / R) * P, rel=1e-12)


def test_work_wait_is_idempotent():
    class W:
        def __init__(self):
            self.n = 0

        def wait(self):
            self.n += 1

    ws = [W(), W()]
    work = Work(ws + [None])
    assert work.is_pending()
    work.wait()
    work.wait()
    assert [w.n for w in ws] == [1, 1]
    assert not work.is_pending()
    assert not Work().is_pending()
