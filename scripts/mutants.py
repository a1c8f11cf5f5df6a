#!/usr/bin/env python3
"""Mutation check: inject known bugs, one at a time, and see whether the tests aimed at each one catch it.

    python3 scripts/mutants.py                      # every mutant (slow: each runs its targeted test files)
    python3 scripts/mutants.py --list               # name, file, targeted tests, why a user would hit it
    python3 scripts/mutants.py --only lpt-ascending,ledger-double --jobs 2

Each mutant is applied to a temporary copy of the repository (the files `git ls-files` lists, as they are in
the working tree, or as of `--rev REV`); the real tree is never written. Its targeted test files run there as
`python3 -m pytest -q -x <files>` with cwd = the copy and PYTHONPATH = the copy, so the copy's code is what
gets imported, also by the ranks tests/_dist.py spawns (they inherit sys.path and the environment) and by the
torchrun / `python train.py` children of tests/integration (cwd = the copy, script dir first on sys.path),
ahead of the editable install's finder that points at the real tree. The `sanity-*` mutants check exactly
that: they make `import titan_dmuon` raise in the pytest process, in spawned ranks and in torchrun workers.

Caught = pytest did not pass (a failure, an error, a collection error or the --timeout). Survived = the
targeted tests all passed with the bug in. A mutant whose `old` text is not found exactly once in its file is
an error in this script, reported before anything runs (exit 2), so a refactor cannot silently disable a
mutant: update its `old`/`new` text. A targeted test file that does not exist is a failure of that mutant
("missing test file"). Exit status: 0 every mutant caught, 1 otherwise, 2 stale mutant definitions.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PREPEND = object()  # `old` of a mutant that inserts `new` at the top of its file


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    old: str | object
    new: str
    tests: tuple[str, ...]
    why: str
    expect: str = ""  # if set, caught only counts when pytest's output shows this text


_REDUCE_AVG = "lambda t, dst, g, a: dist.reduce(t, dst=dst, op=dist.ReduceOp.AVG, group=g, async_op=a),"
_SANITY = 'raise ImportError("mutant sanity check: {where} imported the copy\'s titan_dmuon")\n'

MUTANTS: tuple[Mutant, ...] = (
    # ---- sanity: the copy, not /work/main, is what every process imports ------------------------------
    Mutant(
        "sanity-import",
        "titan_dmuon/__init__.py",
        PREPEND,
        _SANITY.format(where="the pytest process"),
        ("tests/unit/dmuon/test_comm_ledger.py",),
        "not a bug: if this survives, the tests ran the real tree's code instead of the mutated copy",
        expect="mutant sanity check: the pytest process",
    ),
    Mutant(
        "sanity-spawned-ranks",
        "titan_dmuon/__init__.py",
        PREPEND,
        'import sys\n\nif "--multiprocessing-fork" in sys.orig_argv:\n    '
        + _SANITY.format(where="a spawned (tests/_dist.py) rank"),
        ("tests/distributed/test_dmuon_fsdp.py",),
        "not a bug: if this survives, the ranks tests/_dist.py spawns import the real tree, not the copy",
        expect="mutant sanity check: a spawned",
    ),
    Mutant(
        "sanity-torchrun-ranks",
        "titan_dmuon/__init__.py",
        PREPEND,
        'import os\n\nif "TORCHELASTIC_RUN_ID" in os.environ:\n    ' + _SANITY.format(where="a torchrun worker"),
        # a test that starts real torchrun workers (train.py's tests fork their ranks from tests/_dist.py's server)
        ("tests/distributed/test_dmuon_exit.py",),
        "not a bug: if this survives, the torchrun workers tests start import the real tree, not the copy",
        expect="mutant sanity check: a torchrun worker",
    ),
    # ---- gradient reductions ------------------------------------------------------------------------------
    Mutant(
        "shard-reduce-sum",
        "titan_dmuon/dmuon/comm.py",
        _REDUCE_AVG,
        _REDUCE_AVG.replace("op=dist.ReduceOp.AVG", 'op=dist.ReduceOp.SUM if kind == "reduce" else dist.ReduceOp.AVG'),
        ("tests/distributed/test_dmuon_fsdp.py",),
        "dedicated grads summed, not averaged, over the shard axis: N x the gradient; Newton-Schulz hides the "
        "scale from the update, but the momentum buffer, the grad norm and clipping see it",
    ),
    Mutant(
        "replicate-reduce-sum",
        "titan_dmuon/dmuon/comm.py",
        _REDUCE_AVG,
        _REDUCE_AVG.replace(
            "op=dist.ReduceOp.AVG", 'op=dist.ReduceOp.SUM if kind == "replicate_reduce" else dist.ReduceOp.AVG'
        ),
        ("tests/distributed/test_dmuon_hsdp_ddp.py",),
        "HSDP/DDP: dedicated grads summed over the replicate axis: R x the gradient (grad norm, clipping)",
    ),
    Mutant(
        "ddp-reduce-sum",
        "titan_dmuon/dmuon/ddp.py",
        "dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=self.group)",
        "dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)",
        ("tests/distributed/test_dmuon_hsdp_ddp.py",),
        "DDP: the AdamW params' grads summed over the replicas: N x the gradient (grad norm, clipping, AdamW eps)",
    ),
    # ---- the Muon update ------------------------------------------------------------------------------------
    Mutant(
        "nesterov-dropped",
        "titan_dmuon/dmuon/muon.py",
        'return grad.lerp(buf, mu) if opts["nesterov"] else buf',
        "return buf",
        ("tests/unit/dmuon/test_muon_update.py",),
        "nesterov=True (the default) silently trains with plain momentum",
    ),
    Mutant(
        "nesterov-false-raw-grad",
        "titan_dmuon/dmuon/muon.py",
        'return grad.lerp(buf, mu) if opts["nesterov"] else buf',
        'return grad.lerp(buf, mu) if opts["nesterov"] else grad',
        ("tests/unit/dmuon/test_muon_update.py", "tests/distributed/test_dmuon_options.py"),
        "optimizer.nesterov = false trains without momentum at all",
    ),
    Mutant(
        "weight-decay-after-update",
        "titan_dmuon/dmuon/muon.py",
        '    if opts["weight_decay"]:\n'
        '        data.mul_(1 - opts["lr"] * opts["weight_decay"])\n'
        "    data.add_(ortho.contiguous().to(data.dtype), "
        'alpha=-adjusted_lr(opts["lr"], opts["adjust_lr_fn"], dp.full_shape))\n',
        "    data.add_(ortho.contiguous().to(data.dtype), "
        'alpha=-adjusted_lr(opts["lr"], opts["adjust_lr_fn"], dp.full_shape))\n'
        '    if opts["weight_decay"]:\n'
        '        data.mul_(1 - opts["lr"] * opts["weight_decay"])\n',
        ("tests/distributed/test_dmuon_fsdp.py",),
        "decoupled weight decay also shrinks this step's update: not torch.optim.Muon's step",
    ),
    Mutant(
        "match-rms-adamw-min",
        "titan_dmuon/dmuon/muon.py",
        "return lr * 0.2 * math.sqrt(max(a, b))",
        "return lr * 0.2 * math.sqrt(min(a, b))",
        ("tests/unit/dmuon/test_muon_update.py", "tests/integration/test_train_reference.py"),
        "the default adjust_lr_fn under-scales every rectangular matrix (the FFN ones) by sqrt(long/short)",
    ),
    Mutant(
        "original-lr-inverted",
        "titan_dmuon/dmuon/muon.py",
        "return lr * math.sqrt(max(1.0, a / b))",
        "return lr * math.sqrt(max(1.0, b / a))",
        ("tests/distributed/test_dmuon_fsdp.py",),
        'adjust_lr_fn = "original" scales the wide matrices instead of the tall ones',
    ),
    Mutant(
        "param-groups-ignored",
        "titan_dmuon/dmuon/muon.py",
        "opts.update({k: v for k, v in user_groups[ui].items() if k in keys})",
        "opts.update({})",
        ("tests/distributed/test_dmuon_options.py",),
        "per-group overrides (e.g. no weight decay, another lr) silently fall back to the defaults",
    ),
    Mutant(
        "tp-async-live-opts",
        "titan_dmuon/dmuon/muon.py",
        "tp_jobs.append((_tp.TPUpdate(dp, update, st.ledger, st.tp_buffers), dict(opts)))",
        "tp_jobs.append((_tp.TPUpdate(dp, update, st.ledger, st.tp_buffers), opts))",
        ("tests/distributed/test_dmuon_tp.py",),
        "async TP: an update applied at the next forward uses the lr the scheduler set after the step",
    ),
    # ---- the backward: which reduces fire, and what the owner keeps ------------------------------------------
    Mutant(
        "reduce-on-last-local-grad",
        "titan_dmuon/dmuon/group.py",
        "        if not self._pending_nodes and self._nograd_forwards == 0:\n            self.reduce_grads()\n",
        "        if not self._pending_nodes and self._nograd_forwards == 0:\n"
        "            if all(dp.local_grad is not None for dp in self.params):\n"
        "                self.reduce_grads()\n",
        ("tests/distributed/test_loop_conditional.py",),
        "the reduce waits for every local grad: a rank that skipped a matrix reduces that group at the end of "
        "backward, the others mid-backward, so the ranks' collectives go out in different orders (a hang)",
    ),
    Mutant(
        "missing-zero-fill",
        "titan_dmuon/dmuon/group.py",
        "                    else:\n                        dst.zero_()\n",
        "                    else:\n                        pass\n",
        ("tests/distributed/test_loop_conditional.py",),
        "a rank without a grad sends whatever the fresh packed buffer held instead of zeros",
    ),
    Mutant(
        "unused-matrix-not-skipped",
        "titan_dmuon/dmuon/group.py",
        "fill_(float(has_grad))",
        "fill_(1.0)",
        ("tests/distributed/test_loop_conditional.py",),
        "a matrix no rank used still gets momentum and weight decay from its owner (torch.optim.Muon skips it)",
    ),
    Mutant(
        "user-clear-not-seen",
        "titan_dmuon/dmuon/param.py",
        "        if self._reduced_grad is None:\n            return\n        g = self.param.grad\n",
        "        if True:\n            return\n        g = self.param.grad\n",
        ("tests/distributed/test_loop_zero_grad.py",),
        "model.zero_grad() / p.grad = None leave the owner's reduced grad: it accumulates across steps",
    ),
    Mutant(
        "end-of-backward-never-queued",
        "titan_dmuon/dmuon/group.py",
        "            self.state.queue_final_callback(self._task)\n",
        "            pass\n",
        ("tests/distributed/test_loop_checkpointing.py",),
        "no group ever ends its backward: after the first step every reduce is skipped and Muon silently stops",
    ),
    # ---- ownership, communication, clipping --------------------------------------------------------------------
    Mutant(
        "lpt-ascending",
        "titan_dmuon/dmuon/partition.py",
        "units.sort(key=lambda u: (-u[0], u[1]))",
        "units.sort(key=lambda u: (u[0], u[1]))",
        ("tests/unit/dmuon/test_partition.py",),
        "owners assigned smallest-first: the Newton-Schulz work is unbalanced and the slowest rank sets the pace",
    ),
    Mutant(
        "hsdp-publish-skipped",
        "titan_dmuon/dmuon/muon.py",
        "_replicate.publish(st.groups[g], [dp for dp in st.groups[g].params if dp.tp_group is None])",
        "_replicate.publish(st.groups[g], [])",
        ("tests/distributed/test_dmuon_hsdp_ddp.py",),
        "HSDP/DDP: only the owner's replica sees the update; the other replicas train on stale weights",
    ),
    Mutant(
        "torch-ddp-not-ignored",
        "titan_dmuon/dmuon/api.py",
        "    _ddp.ignore_in_torch_ddp(model, [name for name, _ in selected])\n",
        "",
        ("tests/unit/dmuon/test_ddp.py", "tests/distributed/test_dmuon_hsdp_ddp.py"),
        "torch DDP also buckets and all-reduces the dedicated matrices DMuon already reduces to their owners",
    ),
    Mutant(
        "tp-deferred-tail-dropped",
        "titan_dmuon/dmuon/group.py",
        "            work = finish()\n",
        "            work = Work()\n",
        ("tests/distributed/test_dmuon_tp.py",),
        "TP matrices never get their update (or their publish) applied: the scatter is awaited by no one",
    ),
    Mutant(
        "z3-backward-rebroadcast-skipped",
        "titan_dmuon/dmuon/group.py",
        '            self._unshard_work = broadcast_coalesced(ops, ax.shard_group, st.ledger, "broadcast")\n',
        "            if not _in_backward():\n"
        '                self._unshard_work = broadcast_coalesced(ops, ax.shard_group, st.ledger, "broadcast")\n',
        ("tests/distributed/test_dmuon_fsdp.py",),
        "reshard_after_forward (Z3): backward runs on whatever the re-allocated buffer holds, not the weights",
    ),
    Mutant(
        "clip-share-dropped",
        "titan_dmuon/dmuon/clip.py",
        "    dist.all_reduce(ded_sq)\n",
        "",
        ("tests/distributed/test_dmuon_features.py",),
        "each rank's grad norm counts only the matrices it owns: wrong, rank-dependent clipping",
    ),
    Mutant(
        "dp-rank-ignored",
        "titan_dmuon/data/packing.py",
        "self.rows = [dp_rank + dp_world_size * i for i in",
        "self.rows = [dp_world_size * i for i in",
        ("tests/unit/framework/test_data.py",),
        "every DP rank trains on the same windows: N x the compute for 1 x the data",
    ),
    Mutant(
        "ledger-double",
        "titan_dmuon/dmuon/comm.py",
        "self.current[kind] += share\n",
        "self.current[kind] += 2 * share\n",
        ("tests/unit/dmuon/test_comm_ledger.py",),
        "the dmuon/elements_* metrics report twice the traffic (a wrong Z2/Z3 or HSDP cost comparison)",
    ),
    Mutant(
        "moe-aux-unscaled",
        "titan_dmuon/trainer.py",
        "set_aux_loss_scale(self.model, 1.0 / n_micro)",
        "set_aux_loss_scale(self.model, 1.0)",
        ("tests/distributed/test_moe_aux_accumulation.py",),
        "under gradient accumulation the MoE auxiliary loss weighs accumulation-steps times what it should",
    ),
    Mutant(
        "pp-microbatch-loss-unscaled",
        "titan_dmuon/parallel/pipeline.py",
        "return self._loss_fn(output, target) / n  # the microbatches' sum is the step's mean",
        "return self._loss_fn(output, target)",
        ("tests/integration/test_pipeline.py",),
        "under a pipeline each microbatch's loss counts whole: the grads are microbatches times too large",
    ),
    Mutant(
        "pp-no-dmuon-reduce",
        "titan_dmuon/components/optimizer/dmuon.py",
        "        dmuon.reduce_grads(self.model)  # to the owners, then FSDP2's reduce-scatter\n",
        "",
        ("tests/integration/test_pipeline.py",),
        "under a pipeline the Muon grads accumulated without sync never reach their owners",
    ),
    Mutant(
        "pp-stage-local-norm",
        "titan_dmuon/dmuon/clip.py",
        "        dist.all_reduce(others_sq, group=pp_mesh.get_group())\n",
        "        pass\n",
        ("tests/integration/test_pipeline.py",),
        "under a pipeline each stage clips by its own norm, not the whole model's",
    ),
    Mutant(
        "stray-3d-muon",
        "titan_dmuon/components/optimizer/base.py",
        "strays = [n for n, p in selected if p.ndim == 3 and id(p) not in stacks]",
        "strays = []",
        ("tests/unit/framework/test_optimizer_components.py",),
        "a regex that matches too much: Muon orthogonalizes a 3-D param that is no expert stack slice by slice",
    ),
    Mutant(
        "checksum-unchecked",
        "titan_dmuon/components/checkpoint/integrity.py",
        "                if zlib.crc32(view) != crc:",
        "                if False:",
        ("tests/integration/test_checkpoint_damage.py",),
        "a byte changed since the save (bit rot, a partial copy) is loaded as if intact",
    ),
    Mutant(
        "exit-hook-missing",
        "titan_dmuon/dmuon/state.py",
        "atexit.register(release_at_exit)\n",
        "",
        ("tests/distributed/test_dmuon_exit.py",),
        "DMuon's process groups live into interpreter teardown, where gloo's threads can abort a clean run (SIGABRT)",
    ),
    Mutant(
        "kv-positions-one-low",
        "titan_dmuon/components/kv_cache.py",
        "        return (query[None, :] - self.pad[:, None]).clamp(min=0)\n",
        "        return (query[None, :] - self.pad[:, None] - 1).clamp(min=0)\n",
        ("tests/unit/framework/test_generation.py",),
        "decoding with the KV cache rotates each new token one position too low: the text drifts from the model's",
    ),
)


# ------------------------------------------------------------------------------------------------ sources
def tracked_files(rev: str | None) -> list[str]:
    args = ["git", "ls-files", "-z"] if rev is None else ["git", "ls-tree", "-r", "-z", "--name-only", rev]
    out = subprocess.run(args, cwd=REPO, check=True, capture_output=True).stdout.decode()
    return [p for p in out.split("\0") if p]


def read_source(path: str, rev: str | None) -> str:
    if rev is None:
        return (REPO / path).read_text()
    return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO, check=True, capture_output=True, text=True).stdout


def make_copy(dest: Path, files: list[str], rev: str | None) -> None:
    if rev is not None:
        archive = subprocess.run(["git", "archive", rev], cwd=REPO, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        return
    for rel in files:
        src = REPO / rel
        if not src.is_file():  # deleted in the working tree, or a submodule
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)


def mutate(text: str, m: Mutant) -> str:
    if m.old is PREPEND:
        return m.new + text
    return text.replace(m.old, m.new, 1)


def stale(m: Mutant, rev: str | None) -> str | None:
    """Why the mutant cannot be applied as written (None if it can)."""
    try:
        text = read_source(m.file, rev)
    except (OSError, subprocess.CalledProcessError):
        return f"{m.file} not found"
    if m.old is PREPEND:
        return None
    n = text.count(m.old)
    return None if n == 1 else f"old text found {n} times in {m.file} (must be exactly once):\n{m.old}"


# ---------------------------------------------------------------------------------------------------- run
@dataclass
class Result:
    mutant: Mutant
    status: str  # caught | survived | missing test file | error
    seconds: float
    detail: str = ""
    output: str = ""


def _child_env(copy: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        and not k.startswith("TORCHELASTIC_")
    }
    env["PYTHONPATH"] = str(copy)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _first_failure(output: str) -> str:
    for line in output.splitlines():
        match = re.match(r"^(FAILED|ERROR) (\S+)", line)
        if match:
            return match.group(2)
    return ""


_live: set[subprocess.Popen] = set()
_live_lock = threading.Lock()


def run_mutant(m: Mutant, files: list[str], rev: str | None, timeout: float, keep: bool) -> Result:
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f"mutant-{m.name}-"))
    try:
        make_copy(tmp, files, rev)
        missing = [t for t in m.tests if not (tmp / t).is_file()]
        if missing:  # a file only in the working tree is not copied: it must be tracked (git add) first
            where = [f"{t} (untracked)" if rev is None and (REPO / t).is_file() else t for t in missing]
            return Result(m, "missing test file", time.perf_counter() - start, ", ".join(where))
        target = tmp / m.file
        target.write_text(mutate(target.read_text(), m))
        try:
            compile(target.read_text(), str(target), "exec")
        except SyntaxError as e:
            return Result(m, "error", time.perf_counter() - start, f"the mutant does not compile: {e}")
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *m.tests]
        proc = subprocess.Popen(
            cmd,
            cwd=tmp,
            env=_child_env(tmp),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: a timeout ends it with every rank it started
        )
        with _live_lock:
            _live.add(proc)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            status = "error" if m.expect and m.expect not in output else "caught"
            return Result(m, status, time.perf_counter() - start, f"timeout after {timeout:.0f} s", output)
        finally:
            with _live_lock:
                _live.discard(proc)
        seconds = time.perf_counter() - start
        if proc.returncode == 0:
            return Result(m, "survived", seconds, "", output)
        # test failures / errors, an error while collecting (2, with -x), or tests/conftest.py failing to import
        # the mutated library (4)
        if proc.returncode in (1, 2, 4):
            if m.expect and m.expect not in output:
                return Result(m, "error", seconds, f"failed, but without {m.expect!r} in the output", output)
            return Result(m, "caught", seconds, _first_failure(output) or f"pytest exit {proc.returncode}", output)
        return Result(m, "error", seconds, f"pytest exit {proc.returncode}", output)
    finally:
        if keep:
            print(f"[{m.name}] copy kept at {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ report
def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def _short(test: str) -> str:
    return test.removeprefix("tests/")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--only", default="", help="comma-separated mutant names (default: all)")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once (each may start many ranks)")
    parser.add_argument("--rev", default=None, help="copy this git revision instead of the working tree's files")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per mutant; a timeout counts as caught")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copies")
    args = parser.parse_args(argv)

    names = [m.name for m in MUTANTS]
    assert len(set(names)) == len(names), "duplicate mutant names"
    selected = list(MUTANTS)
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in names]
        if unknown:
            parser.error(f"unknown mutant(s) {', '.join(unknown)}; --list shows them")
        selected = [m for m in MUTANTS if m.name in wanted]

    if args.list:
        for m in selected:
            print(f"{m.name}\n    file:  {m.file}\n    tests: {', '.join(m.tests)}\n    why:   {m.why}")
        return 0

    problems = [(m.name, why) for m in selected if (why := stale(m, args.rev)) is not None]
    if problems:
        for name, why in problems:
            print(f"mutant {name}: {why}", file=sys.stderr)
        print("stale mutant definitions: update their old/new text in scripts/mutants.py", file=sys.stderr)
        return 2

    files = tracked_files(args.rev)
    results: list[Result] = []
    t0 = time.perf_counter()
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = [pool.submit(run_mutant, m, files, args.rev, args.timeout, args.keep) for m in selected]
            for fut in concurrent.futures.as_completed(futures):
                r = fut.result()
                results.append(r)
                print(f"[{r.mutant.name}] {r.status} ({r.seconds:.0f} s) {r.detail}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        with _live_lock:
            for proc in _live:
                os.killpg(proc.pid, signal.SIGKILL)
        raise
    total = time.perf_counter() - t0

    order = {m.name: i for i, m in enumerate(selected)}
    results.sort(key=lambda r: order[r.mutant.name])
    rows = [
        [
            r.mutant.name,
            r.mutant.file,
            ", ".join(_short(t) for t in r.mutant.tests),
            r.status if r.status != "caught" or not r.detail else f"caught ({_short(r.detail)})",
            f"{r.seconds:.0f}",
        ]
        for r in results
    ]
    print(table(rows, ["mutant", "file", "targeted tests", "result", "seconds"]))
    bad = [r for r in results if r.status != "caught"]
    for r in bad:
        print(f"\n--- {r.mutant.name}: {r.status} {r.detail}\n    why it matters: {r.mutant.why}")
        if r.output:
            print("\n".join(r.output.rstrip().splitlines()[-15:]))
    caught = len(results) - len(bad)
    print(f"\n{caught}/{len(results)} caught in {total:.0f} s (jobs {args.jobs})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
