"""comm.py's stream seam on CPU: `streams_for` gives the no-op `Streams` off CUDA, whose methods change nothing
(the gloo path is the stream-free code), and `WaitMeter`'s percentiles (nearest rank, microseconds)."""

from __future__ import annotations

import torch

from titan_dmuon.dmuon.comm import STREAM_OF, CudaStreams, Streams, WaitMeter, Work, streams_for


class _Handle:
    def __init__(self):
        self.waits = 0

    def wait(self):
        self.waits += 1


def test_cpu_streams_are_the_no_op_seam():
    streams = streams_for(torch.device("cpu"))
    assert type(streams) is Streams
    t = torch.ones(3)
    with streams.use("reduce"):
        streams.hold(t)
    assert streams.event() is None
    h = _Handle()
    seconds = streams.timed_wait(Work([h]))
    assert h.waits == 1 and seconds >= 0.0
    assert Work([streams.event()]).is_pending() is False  # a CPU "event" is no work at all


def test_every_side_stream_has_a_priority():
    assert set(STREAM_OF.values()) == set(Streams.names) == set(CudaStreams.PRIORITY)
    assert CudaStreams.PRIORITY == {"broadcast": -1, "reduce": -1, "replicate_broadcast": 0}


def test_wait_meter_percentiles_and_window():
    meter, streams = WaitMeter(), Streams()
    assert meter.summary(streams) == {}
    for us in range(1, 101):  # 1..100 us
        meter.add(us * 1e-6)
    out = meter.summary(streams)
    assert round(out["publish_wait_p50_us"]) == 50
    assert round(out["publish_wait_p90_us"]) == 90
    assert round(out["publish_wait_p99_us"]) == 99
    assert out["publish_waits"] == 100
    assert meter.summary(streams) == {}  # each call is one logging window
