"""Every collective DMuon issues is async and waited only where its buffer is consumed, and the stream code
paths (docs/dmuon.md, "CUDA streams") are right, checked on real gloo ranks (1D, HSDP, dp x tp, 3D).

Each rank wraps torch.distributed's collectives while training: an op DMuon issues runs at once on copies of
its tensors, and its real buffers are poisoned (outputs filled with NaN) until its work is waited, when the
result is copied in. A read before the wait (a missing wait) turns the losses and weights into NaN or makes
them differ from an unwrapped run; a write into a buffer in flight, or freeing it, is seen at the wait.

The CPU path has no streams, so the test puts a stand-in on `DMuonState.streams` (what `CudaStreams` is on a
GPU): it models which ops each "stream" has seen complete (a wait on a work or an event, a stream entering
`use` after the compute stream), and checks that each op is issued from its stream, that every tensor it
touches on a side stream was held for that stream (`record_stream`: the caching allocator must not reuse it
in flight), that its inputs were complete on that stream, and, at the points where compute reads a buffer
(a group's forward, the owner's accumulation of its reduced grad, the update), that every op which wrote the
buffer is complete on the compute stream.
"""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
import torch.distributed as dist

from tests._dist import backend_name, run_distributed

pytestmark = pytest.mark.skipif(
    backend_name() != "gloo", reason="the stand-in streams model CUDA streams on CPU; gpu_check runs the real ones"
)

STEPS = 3
# (issuing file, collective) -> (the stream it must be issued from, the function that must wait for it)
EXPECTED = {
    ("group.py", "broadcast"): ("broadcast", {"wait_for_unshard"}),
    ("group.py", "reduce"): ("reduce", {"_start_stage2"}),
    ("replicate_axis.py", "reduce"): ("replicate_broadcast", {"_finish_stage2"}),
    ("replicate_axis.py", "broadcast"): ("replicate_broadcast", {"wait_publish"}),
    ("tp.py", "gather"): ("replicate_broadcast", {"settle"}),  # tp_gather="backward": the grad's gather
    ("tp.py", "scatter"): ("replicate_broadcast", {"wait"}),
}
# Where the waiting stream is not (only) the compute stream: the replicate-axis stream waits for stage 1 before
# stage 2 and for stage 2 before the owner's accumulation (compute waits for that stream at the end of
# backward); the broadcast stream waits for the publish before it copies the masters (compute does in a drain,
# under DDP).
WAIT_STREAM = {
    ("group.py", "reduce"): {"replicate_broadcast"},
    ("replicate_axis.py", "reduce"): {"replicate_broadcast"},
    ("replicate_axis.py", "broadcast"): {"broadcast", "compute"},
}
WRAPPED = ("broadcast", "reduce", "gather", "scatter", "all_reduce", "all_gather")
# DMuon files whose collectives are sync by design: a scalar or a one-off consumed on the next line (the grad
# norm of clip_grad_norm_, replicate's end-of-backward all-reduce of the non-dedicated params, state dicts).
SYNC_BY_DESIGN = ("clip.py", "ddp.py", "state_dict.py", "api.py")


def _caller() -> tuple[str, str] | None:
    """(file, function) of the innermost frame in titan_dmuon/dmuon/ outside comm.py, or None."""
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename.replace("\\", "/")
        if "/titan_dmuon/dmuon/" in path and not path.endswith("/comm.py"):
            return path.rsplit("/", 1)[1], f.f_code.co_name
        f = f.f_back
    return None


def _waiter() -> str:
    """The function (outside comm.py) that called `Work.wait()`."""
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename.replace("\\", "/")
        if "/titan_dmuon/" in path and not path.endswith("/comm.py"):
            return f.f_code.co_name
        f = f.f_back
    return "?"


class Recorder:
    """The wrapped collectives, the stand-in streams, and everything they saw."""

    def __init__(self):
        self.ops: list[Op] = []
        self.violations: list[str] = []
        self.current = ["compute"]
        self.visible: dict[str, set[int]] = {"compute": set()}  # stream -> ids of ops complete on it
        self.held: set[tuple[int, str]] = set()  # (storage ptr, stream)
        self.writers: dict[int, list[tuple[int, int, int]]] = {}  # storage ptr -> (begin, end, op id) written
        self.real = {name: getattr(dist, name) for name in WRAPPED}

    # ---- streams stand-in (the Streams interface) ----
    @property
    def stream(self) -> str:
        return self.current[-1]

    def need_visible(self, tensors, where: str) -> None:
        seen = self.visible.setdefault(self.stream, set())
        for t in tensors:
            begin, end = _span(t)
            for w_begin, w_end, op_id in self.writers.get(_ptr(t), ()):
                if w_begin < end and begin < w_end and op_id not in seen:
                    op = self.ops[op_id]
                    self.violations.append(
                        f"{where}: reads a buffer that {op.file} {op.name} (op {op_id}) wrote, not yet complete on "
                        f"the {self.stream} stream (a missing wait or event)"
                    )

    def install(self) -> None:
        for name in WRAPPED:
            setattr(dist, name, self._wrap(name))

    def uninstall(self) -> None:
        for name, fn in self.real.items():
            setattr(dist, name, fn)

    def _wrap(self, name: str):
        real = self.real[name]

        def wrapped(*args, **kwargs):
            where = _caller()
            if where is None or where[0] in SYNC_BY_DESIGN:
                return real(*args, **kwargs)
            return Op(self, name, where, real, args, kwargs).issue()

        return wrapped

    def unwaited(self) -> list[str]:
        return [f"{op.file} {op.name} (op {op.id}) was never waited" for op in self.ops if not op.done]


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a (contiguous) tensor covers."""
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


class Op:
    """One wrapped collective: run now on copies, real outputs poisoned until `wait()`."""

    def __init__(self, rec: Recorder, name: str, where: tuple[str, str], real, args, kwargs):
        self.rec, self.name, self.file, self.issuer, self.real = rec, name, where[0], where[1], real
        self.args, self.kwargs = list(args), dict(kwargs)
        self.id = len(rec.ops)
        self.done = False
        self.stream = rec.stream
        rec.ops.append(self)

    def _split(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(inputs, outputs) of this rank's part of the op."""
        a, k, me = self.args, self.kwargs, dist.get_rank()
        if self.name == "broadcast":
            return ([a[0]], []) if k["src"] == me else ([], [a[0]])
        if self.name in ("reduce", "all_reduce"):
            return [], [a[0]]
        if self.name == "gather":
            return [a[0]], list(k.get("gather_list") or [])
        if self.name == "scatter":
            return list(k.get("scatter_list") or []), [a[0]]
        if self.name == "all_gather":
            return [a[1]], list(a[0])
        raise AssertionError(self.name)

    def issue(self) -> Op:
        rec = self.rec
        if not self.kwargs.get("async_op", False):
            rec.violations.append(f"{self.file} {self.name} from {self.issuer}: issued with async_op=False")
        expected = EXPECTED.get((self.file, self.name))
        if expected is not None and self.stream != expected[0]:
            rec.violations.append(
                f"{self.file} {self.name}: issued on the {self.stream} stream, expected {expected[0]}"
            )
        self.inputs, self.outputs = self._split()
        if self.stream != "compute":
            for t in self.inputs + self.outputs:
                if (_ptr(t), self.stream) not in rec.held:
                    rec.violations.append(
                        f"{self.file} {self.name}: a tensor it uses on the {self.stream} stream was not held for "
                        "that stream (the allocator could reuse it in flight)"
                    )
        reads = self.inputs + (self.outputs if self.name in ("reduce", "all_reduce") else [])
        rec.need_visible(reads, f"{self.file} {self.name} issue")
        # run it now, on copies, the same on every rank (gloo, sync)
        copies = {id(t): t.detach().clone() for t in self.inputs + self.outputs}
        args = [self._swap(v, copies) for v in self.args]
        kwargs = {key: self._swap(v, copies) for key, v in self.kwargs.items()}
        kwargs["async_op"] = False
        self.real(*args, **kwargs)
        self.results = [copies[id(t)] for t in self.outputs]
        self.snapshots = [t.detach().clone() for t in self.inputs]
        self.ptrs = [(t.data_ptr(), _ptr(t)) for t in self.outputs]
        for t in self.outputs:
            t.detach().fill_(float("nan"))
            rec.writers.setdefault(_ptr(t), []).append((*_span(t), self.id))
        self.issue_visible = set(rec.visible.setdefault(self.stream, set())) | {self.id}
        return self

    @staticmethod
    def _swap(v, copies):
        if isinstance(v, torch.Tensor):
            return copies.get(id(v), v)
        if isinstance(v, list):
            return [copies.get(id(t), t) for t in v]
        return v

    # the work handle DMuon waits on
    def wait(self) -> None:
        rec = self.rec
        rec.visible.setdefault(rec.stream, set()).update(self.issue_visible)
        if self.done:
            return
        self.done = True
        key = (self.file, self.name)
        expected = EXPECTED.get(key)
        waiter = _waiter()
        if expected is not None and waiter not in expected[1]:
            rec.violations.append(f"{self.file} {self.name}: waited in {waiter}, expected {sorted(expected[1])}")
        want_stream = WAIT_STREAM.get(key, {"compute"})
        if expected is not None and rec.stream not in want_stream:
            rec.violations.append(f"{self.file} {self.name}: waited on the {rec.stream} stream, not {want_stream}")
        for t, snap in zip(self.inputs, self.snapshots, strict=True):
            if t.untyped_storage().size() == 0 or not torch.equal(t, snap):
                rec.violations.append(f"{self.file} {self.name}: an input was changed or freed while in flight")
        for t, res, ptrs in zip(self.outputs, self.results, self.ptrs, strict=True):
            if t.untyped_storage().size() == 0 or (t.data_ptr(), _ptr(t)) != ptrs:
                rec.violations.append(f"{self.file} {self.name}: its output buffer was freed while in flight")
                continue
            if not torch.isnan(t).all():
                rec.violations.append(f"{self.file} {self.name}: its output buffer was written while in flight")
            reduce_garbage = self.name == "reduce" and self.kwargs["dst"] != dist.get_rank()
            if not reduce_garbage:  # a reduce's non-destination buffers stay poisoned: never to be read
                t.detach().copy_(res)


class FakeEvent:
    def __init__(self, rec: Recorder):
        self.rec, self.seen = rec, set(rec.visible.setdefault(rec.stream, set()))

    def wait(self) -> None:
        self.rec.visible.setdefault(self.rec.stream, set()).update(self.seen)


def _fake_streams(rec: Recorder):
    from titan_dmuon.dmuon.comm import Streams

    class FakeStreams(Streams):
        """Streams on CPU, modelled: see the module docstring."""

        @contextlib.contextmanager
        def use(self, name):
            assert name in self.names, name
            seen = rec.visible.setdefault(name, set())
            seen.update(rec.visible[rec.stream])  # the stream waits for the compute stream's queued work
            rec.current.append(name)
            try:
                yield
            finally:
                rec.current.pop()

        def hold(self, *tensors):
            for t in tensors:
                if t is not None:
                    rec.held.add((_ptr(t), rec.stream))

        def event(self):
            return FakeEvent(rec)

    return FakeStreams()


def _install_checkpoints(model, rec: Recorder) -> None:
    """Where compute reads a buffer DMuon's collectives wrote: each op that wrote it must be complete there."""
    from titan_dmuon.dmuon import muon as muon_mod
    from titan_dmuon.dmuon.state import state_of

    st = state_of(model, "test")
    for g in st.groups:

        def check_forward(module, args, g=g):
            masters = [dp._owned_data for dp in g.params if dp._owned_data is not None]
            rec.need_visible(([g.buffer] if not g.live else []) + masters, f"forward of {g.module_fqn}")

        g.module.register_forward_pre_hook(check_forward)  # after DMuon's own pre-forward hook
        finish = g.finish_reduce

        def checked_finish(gbuf, finish=finish, g=g):
            rec.need_visible([gbuf], f"finish_reduce of {g.module_fqn}")
            return finish(gbuf)

        g.finish_reduce = checked_finish
        reduce = g.reduce_grads

        def checked_reduce(reduce=reduce, g=g):
            grads = [dp.local_grad for dp in g.params if dp.local_grad is not None]
            reduce()
            for grad in grads:  # packed on the reduce stream, then dropped by the compute stream
                if st.sync_grads and (_ptr(grad), "reduce") not in rec.held:
                    rec.violations.append(f"reduce_grads of {g.module_fqn}: a grad was not held for the reduce stream")

        g.reduce_grads = checked_reduce
    apply = muon_mod._apply_update

    def checked_apply(dp, ortho, opts, *blocks):
        rec.need_visible([dp._owned_data, ortho], f"the update of {dp.fqn}")
        seen = rec.visible.setdefault("compute", set())
        for op in rec.ops:  # the reduced grad was accumulated from every reduce: complete on compute by now
            if op.name == "reduce" and op.file in ("group.py", "replicate_axis.py") and op.id not in seen:
                rec.violations.append(
                    f"the update of {dp.fqn}: {op.file} reduce (op {op.id}) is not complete on the compute stream"
                )
        return apply(dp, ortho, opts, *blocks)

    muon_mod._apply_update = checked_apply


def _build(layout: str, world_size: int):
    from torch.distributed.device_mesh import init_device_mesh

    from tests.dmuon_harness import build_muon, shard_blocks
    from tests.tiny_models import TinyLlama, apply_llama_tp, proj_predicate
    from titan_dmuon import dmuon

    torch.manual_seed(0)
    model = TinyLlama(32, 64, 4, 2)
    if layout == "1d":
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
        dmuon.dedicate_params(model, mesh, proj_predicate)
        fsdp_mesh = mesh
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
        dmuon.dedicate_params(model, mesh["shard"], proj_predicate, replicate_mesh=mesh["replicate"])
        fsdp_mesh = mesh
    elif layout == "dp_tp":
        mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
        apply_llama_tp(model, mesh["tp"])
        dmuon.dedicate_params(model, mesh["dp"], proj_predicate)
        fsdp_mesh = mesh["dp"]
    elif layout == "3d":
        mesh = init_device_mesh("cpu", (2, world_size // 4, 2), mesh_dim_names=("replicate", "shard", "tp"))
        apply_llama_tp(model, mesh["tp"])
        dmuon.dedicate_params(model, mesh["shard"], proj_predicate, replicate_mesh=mesh["replicate"])
        fsdp_mesh = mesh["replicate", "shard"]
    else:
        raise ValueError(layout)
    shard_blocks(model, fsdp_mesh)
    return model, build_muon(model)


def _train(model, opt, dp_rank: int) -> tuple[list[float], dict]:
    from tests.tiny_models import seq_batch
    from titan_dmuon import dmuon

    losses = []
    for step in range(STEPS):
        loss = model(seq_batch(step, dp_rank, 2, 8, 32))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    loss = model(seq_batch(STEPS, dp_rank, 2, 8, 32))  # the last step's publish is consumed by a forward
    losses.append(loss.item())
    dmuon.drain(model)
    return losses, {k: v.clone() for k, v in dmuon.get_model_state_dict(model).items()}


def _dp_rank(layout: str) -> int:
    return dist.get_rank() // 2 if layout in ("dp_tp", "3d") else dist.get_rank()


def _run(rank: int, world_size: int, layout: str, sabotage: str | None = None):
    from titan_dmuon.dmuon.state import state_of

    model, opt = _build(layout, world_size)
    ref_losses, ref_sd = _train(model, opt, _dp_rank(layout))  # unwrapped, no stand-in: the same code as is

    model, opt = _build(layout, world_size)
    rec = Recorder()
    st = state_of(model, "test")
    st.streams = _fake_streams(rec)
    _install_checkpoints(model, rec)
    if sabotage is not None:
        _sabotage(sabotage, st)
    rec.install()
    try:
        losses, sd = _train(model, opt, _dp_rank(layout))
    finally:
        rec.uninstall()
    kinds = sorted({(op.file, op.name, op.stream) for op in rec.ops})
    return dict(
        violations=rec.violations + rec.unwaited(),
        kinds=kinds,
        same=losses == ref_losses and all(torch.equal(sd[k], v) for k, v in ref_sd.items()),
        finite=all(torch.isfinite(torch.tensor(losses)).tolist()),
    )


def _sabotage(what: str, st) -> None:
    """Break one wait (the test must then fail): see test_a_missing_wait_fails."""
    if what == "unshard-wait":  # forward reads the packed buffer without waiting for its broadcast
        for g in st.groups:
            g.wait_for_unshard = lambda: None
    elif what == "events":  # compute reads the reduced grads without waiting for the side stream's accumulation
        st.streams.event = lambda: None
    elif what == "hold":  # the packed grad buffer is not held for the reduce stream
        original = st.streams.hold
        st.streams.hold = lambda *ts: original(*[t for t in ts if t.dtype != torch.float32 or t.dim() != 1])
    else:
        raise ValueError(what)


LAYOUTS = {"1d": 2, "hsdp": 4, "dp_tp": 4, "3d": 4}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_collectives_async_on_their_streams_and_waited_where_consumed(layout):
    results = run_distributed(_run, LAYOUTS[layout], layout)
    for rank, r in enumerate(results):
        assert r["violations"] == [], f"rank {rank}: " + "\n".join(r["violations"][:10])
        assert r["finite"] and r["same"], f"rank {rank}: the poisoned run differs from the plain one"
    kinds = {k for r in results for k in r["kinds"]}
    want = set() if layout == "3d" else {("group.py", "broadcast", "broadcast"), ("group.py", "reduce", "reduce")}
    if layout in ("hsdp", "3d"):
        want |= {
            ("replicate_axis.py", "reduce", "replicate_broadcast"),
            ("replicate_axis.py", "broadcast", "replicate_broadcast"),
        }
    if layout in ("dp_tp", "3d"):
        want |= {("tp.py", "gather", "replicate_broadcast"), ("tp.py", "scatter", "replicate_broadcast")}
    assert want <= kinds, f"not exercised: {sorted(want - kinds)}"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sabotage", "layout", "expect"),
    [
        ("unshard-wait", "1d", "forward of"),
        ("events", "hsdp", "not complete on the compute stream"),
        ("hold", "1d", "was not held"),
    ],
)
def test_a_missing_wait_or_hold_fails(sabotage, layout, expect):
    """The checks above catch what they are for: a wait, an event or a hold taken out is reported."""
    results = run_distributed(_run, LAYOUTS[layout], layout, sabotage)
    found = [v for r in results for v in r["violations"]]
    assert any(expect in v for v in found), found[:5]
