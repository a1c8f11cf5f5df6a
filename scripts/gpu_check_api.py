"""The private torch APIs titan_dmuon calls: one list (`PRIVATE_APIS`), the check that each is on this torch
(`python scripts/gpu_check_api.py`, scripts/gpu_check.sh's compat section) and the scan of the code that finds
them (`scan`), which tests/unit/framework/test_gpu_check.py holds to the list: a new private use that is not
listed fails there, and so does an entry marked guarded whose guard is gone from its file.

An entry is `guarded` when the code runs without it (a `getattr`/`hasattr` fallback, or a path taken only where
it exists) and `required` otherwise: the pin (pyproject.toml, torch 2.13) is then its only guard, and a torch
without it fails where the entry says. The compat check prints one line per entry: `ok`, `MISSING` (required:
the check fails) or `absent` (guarded: what the fallback does instead).

    python scripts/gpu_check_api.py            # the check on this torch; exit 1 if a required one is missing
    python scripts/gpu_check_api.py --scan     # the private uses the scan finds in titan_dmuon/, listed or not
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# What the scan reads: the library and the two top-level entry points.
SCANNED = ("titan_dmuon", "dmuon.py", "train.py")


@dataclass(frozen=True)
class PrivateAPI:
    """One private torch API. `path` is "module:attr.chain" (the module part importable). `names` are the private
    names the scan sees for it (default: the private segments of `path`); `used_in` the files (under titan_dmuon/,
    relative) that use it; `guard` how the code copes without it (empty: required); `guard_text` a string each file
    of `used_in` that guards it must contain (its getattr/hasattr); `probe` checks it on this torch (default:
    resolve `path`) and may return a short note."""

    path: str
    used_in: tuple[str, ...]
    guard: str = ""
    guard_text: str = ""
    names: tuple[str, ...] = ()
    probe: Callable[[], object] | None = field(default=None, compare=False)

    @property
    def guarded(self) -> bool:
        return bool(self.guard)

    def private_names(self) -> tuple[str, ...]:
        if self.names:
            return self.names
        module, _, chain = self.path.partition(":")
        return tuple(p for p in (*module.split("."), *chain.split(".")) if _private(p))

    def resolve(self) -> object:
        module, _, chain = self.path.partition(":")
        obj: object = importlib.import_module(module)
        for part in filter(None, chain.split(".")):
            obj = getattr(obj, part)
        return obj

    def check(self) -> object:
        """Raise if it is not on this torch; else a note (or None)."""
        return self.probe() if self.probe is not None else (self.resolve() and None)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _attr(module: str, chain: str) -> object:
    return PrivateAPI(f"{module}:{chain}", ()).resolve()


def _has_param(module: str, chain: str, name: str) -> None:
    params = inspect.signature(_attr(module, chain)).parameters
    if name not in params:
        raise AttributeError(f"no parameter {name!r} in {list(params)}")


def _instance_has(obj: object, name: str) -> None:
    """For an attribute set on instances (not on the class)."""
    if not hasattr(obj, name):
        raise AttributeError(f"a {type(obj).__name__} has no {name!r}")


def _dtensor_has(name: str) -> None:
    """Whether a DTensor instance has `name` (set on instances, not on the class): one made on a fake world of one
    rank (nothing is communicated), torn down after unless a process group was there before."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.testing._internal.distributed.fake_pg import FakeStore

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cpu", torch.arange(dist.get_world_size()))
        _instance_has(DTensor.from_local(torch.zeros(2, 2), mesh, [Replicate()]), name)
    finally:
        if made:
            dist.destroy_process_group()


C10D = "torch.distributed.distributed_c10d"
PG = "torch.distributed:ProcessGroup"
FSDP = "torch.distributed.fsdp._fully_shard"
# Private-looking attributes the project sets on torch objects itself (markers), not torch's: the scan skips them.
PROJECT_ATTRIBUTES = {
    "_dedicated_owner_rank": "dmuon/api.py marks a dedicated param (fsdp2_patch.py and units.py read it)",
    "_dmuon_param": "dmuon/api.py: the DedicatedParam record of a param",
    "_meshes": "parallel/parallel_dims.py: ParallelDims' built meshes (object.__setattr__ on a frozen dataclass)",
}

PRIVATE_APIS: tuple[PrivateAPI, ...] = (
    # ---- process groups (dmuon/comm.py, parallel/runtime.py)
    PrivateAPI(
        f"{C10D}:_use_torchcomms_enabled",
        ("dmuon/comm.py",),
        guard="getattr: False (a torch without it has no TorchComms backend to enable)",
        guard_text='getattr(_c10d, "_use_torchcomms_enabled", None)',
    ),
    PrivateAPI(
        f"{C10D}:_get_split_source",
        ("dmuon/comm.py",),
        guard="getattr: its rule inline (the bound device's backend and its supports_splitting)",
        guard_text='getattr(_c10d, "_get_split_source", None)',
    ),
    PrivateAPI(f"{C10D}:_get_default_group", ("dmuon/comm.py", "parallel/runtime.py")),
    PrivateAPI(f"{C10D}:_get_default_store", ("parallel/runtime.py",)),
    PrivateAPI(f"{C10D}:_set_pg_timeout", ("parallel/runtime.py",)),
    PrivateAPI(f"{C10D}:_hash_ranks_to_str", ("dmuon/comm.py",)),
    PrivateAPI(f"{C10D}:_world.pg_map", ("dmuon/comm.py", "parallel/runtime.py"), names=("_world",)),
    PrivateAPI(f"{C10D}:_world.pg_names", ("dmuon/comm.py",), names=("_world",)),
    PrivateAPI(
        "torch.distributed:_coalescing_manager",
        ("dmuon/comm.py",),
        probe=lambda: _has_param("torch.distributed", "_coalescing_manager", "async_ops"),
    ),
    PrivateAPI(f"{PG}._device_types", ("dmuon/comm.py", "parallel/runtime.py")),
    PrivateAPI(f"{PG}._get_backend", ("dmuon/comm.py", "parallel/runtime.py")),
    PrivateAPI(
        "torch.distributed:ProcessGroupGloo._Options._timeout",
        ("dmuon/comm.py", "parallel/runtime.py"),
        names=("_timeout",),
        guard="getattr/hasattr on the backend's options: no timeout read (the new group takes torch's default)",
        guard_text="_timeout",
    ),
    # ---- autograd, dynamo, pytree
    PrivateAPI("torch._C:_current_graph_task_id", ("dmuon/group.py", "models/common/moe.py")),
    PrivateAPI(
        "torch.autograd:Variable._execution_engine.queue_callback",
        ("dmuon/ddp.py", "dmuon/state.py"),
        names=("_execution_engine",),
    ),
    PrivateAPI("torch.autograd:_profiler_enabled", ("dmuon/trace.py",)),
    PrivateAPI("torch._dynamo:disable", ("dmuon/group.py",)),
    PrivateAPI("torch.utils._pytree:tree_flatten", ("dmuon/group.py",)),
    PrivateAPI("torch.utils._pytree:tree_unflatten", ("dmuon/group.py",)),
    # ---- ops
    PrivateAPI(
        "torch:_grouped_mm",
        ("models/common/moe.py",),
        guard="hasattr: the experts run one by one (experts_loop)",
        guard_text='hasattr(torch, "_grouped_mm")',
    ),
    PrivateAPI("torch:_foreach_mul_", ("dmuon/clip.py",)),
    PrivateAPI(
        "torch:ops.mkldnn._is_mkldnn_bf16_supported",
        ("dmuon/newton_schulz.py",),
        guard="try/except AttributeError, RuntimeError: no native bf16 (NS in fp32 on that CPU)",
        guard_text="except (AttributeError, RuntimeError)",
    ),
    PrivateAPI(
        "torch.cuda:_sleep",
        ("dmuon/comm.py",),
        guard="getattr: the debug delay of DMUON_DEBUG_SLOW_STREAMS_CYCLES is off",
        guard_text='getattr(torch.cuda, "_sleep", None)',
    ),
    PrivateAPI(
        "torch.cuda.memory:_record_memory_history",
        ("components/profiling.py",),
        guard="called only where torch.cuda.is_available() (the CPU build lacks it)",
        guard_text="torch.cuda.is_available()",
    ),
    PrivateAPI(
        "torch.cuda.memory:_snapshot",
        ("components/profiling.py",),
        guard="called only where torch.cuda.is_available() (the CPU build lacks it)",
        guard_text="torch.cuda.is_available()",
    ),
    # ---- DTensor / FSDP2 / DDP / pipelining internals
    PrivateAPI(
        "torch.distributed.tensor._utils:compute_local_shape_and_global_offset", ("components/checkpoint/hf_io.py",)
    ),
    PrivateAPI(
        "torch.distributed.tensor.placement_types:_StridedShard",
        (
            "components/checkpoint/hf_io.py",
            "components/initialization.py",
            "dmuon/clip.py",
            "dmuon/qk_clip.py",
            "models/common/tensor_parallel.py",
        ),
        # built from C++ on some versions (no Python signature): construct one
        probe=lambda: _attr("torch.distributed.tensor.placement_types", "_StridedShard")(0, split_factor=2) and None,
    ),
    PrivateAPI(
        "torch.distributed.tensor:DTensor._local_tensor",
        ("dmuon/param.py", "dmuon/state_dict.py"),
        probe=lambda: _dtensor_has("_local_tensor"),
    ),
    PrivateAPI(
        "torch.distributed.tensor:DTensor._spec",
        ("dmuon/param.py",),
        probe=lambda: _dtensor_has("_spec"),
    ),
    PrivateAPI("torch:Tensor._nnz", ("dmuon/param.py",)),
    PrivateAPI("torch.distributed.device_mesh:DeviceMesh._get_root_mesh", ("dmuon/tp.py",)),
    PrivateAPI("torch.nn:Module._parameters", ("components/initialization.py",), probe=lambda: _module_parameters()),
    PrivateAPI(
        f"{FSDP}._fsdp_init:_get_managed_states",
        ("dmuon/fsdp2_patch.py",),
        names=("_fully_shard", "_fsdp_init", "_get_managed_states"),
        probe=lambda: _has_param(f"{FSDP}._fsdp_init", "_get_managed_states", "ignored_params"),
    ),
    PrivateAPI(
        f"{FSDP}._fsdp_state:FSDPState._state_ctx",
        ("parallel/pipeline.py",),
        probe=lambda: _fsdp_state_sets("_state_ctx"),
    ),
    PrivateAPI(
        f"{FSDP}._fsdp_state:FSDPState._fsdp_param_groups",
        ("parallel/pipeline.py",),
        probe=lambda: _fsdp_state_sets("_fsdp_param_groups"),
    ),
    PrivateAPI(f"{FSDP}._fsdp_state:FSDPState._root_post_backward_final_callback", ("parallel/pipeline.py",)),
    PrivateAPI(
        "torch.distributed.pipelining.schedules:ScheduleLoopedBFS._calculate_single_rank_operations",
        ("parallel/pipeline.py",),
        names=("_calculate_single_rank_operations", "_n_microbatches"),
        guard="try/except: the peak falls back to the schedule's closed form",
        guard_text="except Exception:",
    ),
    PrivateAPI(
        "torch.distributed.pipelining.schedules:_ComputationType",
        ("parallel/pipeline.py",),
        guard="try/except: the peak falls back to the schedule's closed form",
        guard_text="except Exception:",
    ),
    PrivateAPI(
        "torch.optim.lr_scheduler:LRScheduler._step_count",
        ("components/checkpoint/manager.py",),
        probe=lambda: _instance_has(_lambda_lr(), "_step_count"),
    ),
    PrivateAPI(
        "torch.optim.lr_scheduler:LRScheduler._last_lr",
        ("components/checkpoint/manager.py",),
        probe=lambda: _instance_has(_lambda_lr(), "_last_lr"),
    ),
    PrivateAPI(
        "torch.nn.parallel:DistributedDataParallel._set_params_and_buffers_to_ignore_for_model",
        ("dmuon/ddp.py",),
    ),
    PrivateAPI(
        "torch.nn.parallel:DistributedDataParallel._ddp_params_and_buffers_to_ignore",
        ("dmuon/ddp.py",),
        guard="getattr with default (): nothing marked before",
        guard_text='getattr(model, "_ddp_params_and_buffers_to_ignore", ())',
        probe=lambda: _ddp_ignore_attr(),
    ),
    PrivateAPI("torch.distributed.checkpoint._nested_dict:flatten_state_dict", ("components/checkpoint/manager.py",)),
    PrivateAPI(
        "torch.distributed.checkpoint._nested_dict:flatten_state_dict",
        ("components/checkpoint/memory.py",),
    ),
    PrivateAPI("torch.distributed.checkpoint._nested_dict:set_element", ("components/checkpoint/dcp_io.py",)),
    PrivateAPI("torch.testing._internal.distributed.fake_pg:FakeStore", ("planner/plan.py",)),
)


def _lambda_lr():
    import torch

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)


def _ddp_ignore_attr() -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    model = torch.nn.Linear(1, 1)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["weight"])
    _instance_has(model, "_ddp_params_and_buffers_to_ignore")


def _module_parameters() -> None:
    import torch

    if not isinstance(torch.nn.Linear(1, 1)._parameters, dict):
        raise AttributeError("nn.Module._parameters is not a dict")


def _fsdp_state_sets(name: str) -> None:
    """FSDPState's __init__ sets `name` on the instance (an FSDPState needs a module and a mesh to exist)."""
    state = importlib.import_module(f"{FSDP}._fsdp_state")
    if f"self.{name}" not in inspect.getsource(state.FSDPState.__init__):
        raise AttributeError(f"FSDPState() sets no {name}")


# ---- the scan -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Use:
    """A private name the code takes from torch: `name`, at `file`:`line`; `chain` the dotted source text."""

    name: str
    file: str
    line: int
    chain: str


def _files(root: Path) -> list[Path]:
    out: list[Path] = []
    for entry in SCANNED:
        p = root / entry
        out += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return out


def _chain(node: ast.expr) -> tuple[ast.expr, list[str]]:
    """(root expression, attribute names from the root outwards) of `a.b.c`."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return node, parts[::-1]


def _own_attributes(trees: list[ast.AST]) -> set[str]:
    """Attribute names the project defines on its own objects: stored on self/cls, or defined in a class body."""
    names: set[str] = set(PROJECT_ATTRIBUTES)
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        names.add(item.name)
                    elif isinstance(item, ast.Assign):
                        names |= {t.id for t in item.targets if isinstance(t, ast.Name)}
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        names.add(item.target.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", "ctx"):
                    names.add(node.attr)
    return names


def scan(root: Path = REPO) -> list[Use]:
    """Every private name the scanned code takes from torch: in imports of torch modules, in attribute chains off a
    torch module, as string arguments of getattr/hasattr/setattr, and as private attributes of objects that the
    project does not define itself (such an object is torch's: DTensor, ProcessGroup, FSDP state, ...)."""
    files = _files(root)
    trees = {f: ast.parse(f.read_text(), str(f)) for f in files}
    own = _own_attributes(list(trees.values()))
    uses: list[Use] = []
    for f, tree in trees.items():
        rel = str(f.relative_to(root / "titan_dmuon")) if f.is_relative_to(root / "titan_dmuon") else f.name
        modules: dict[str, str] = {}  # local name -> the module it is an alias of (torch or not)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    modules[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                    if a.name.startswith("torch"):
                        for p in a.name.split("."):
                            if _private(p):
                                uses.append(Use(p, rel, node.lineno, a.name))
            elif isinstance(node, ast.ImportFrom):
                mod = "." * node.level + (node.module or "")
                for a in node.names:
                    modules[a.asname or a.name] = f"{mod}.{a.name}"
                    if mod.startswith("torch"):
                        for p in (*mod.split("."), a.name):
                            if _private(p):
                                uses.append(Use(p, rel, node.lineno, f"{mod}.{a.name}"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2:
                    arg = node.args[1]
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and _private(arg.value):
                        if arg.value not in own:
                            uses.append(Use(arg.value, rel, node.lineno, f"{node.func.id}(..., {arg.value!r})"))
            if not isinstance(node, ast.Attribute):  # each prefix of a chain is visited: a.b._c and a.b
                continue
            base, parts = _chain(node)
            if not _private(parts[-1]):
                continue
            text = ".".join(parts)
            if isinstance(base, ast.Name) and base.id in modules:
                module = modules[base.id]
                if module.startswith("torch"):
                    uses.append(Use(parts[-1], rel, node.lineno, f"{module}.{text}"))
                continue  # a project or standard-library module's attribute
            if parts[-1] not in own:
                root_text = base.id if isinstance(base, ast.Name) else type(base).__name__
                uses.append(Use(parts[-1], rel, node.lineno, f"{root_text}.{text}"))
    return uses


def uncovered(uses: list[Use], apis: tuple[PrivateAPI, ...] = PRIVATE_APIS) -> list[Use]:
    """The uses no entry of `apis` lists (by private name and file)."""
    listed = {(n, f) for api in apis for n in api.private_names() for f in api.used_in}
    return [u for u in uses if (u.name, u.file) not in listed]


def missing_guards(root: Path = REPO, apis: tuple[PrivateAPI, ...] = PRIVATE_APIS) -> list[str]:
    """Entries marked guarded whose guard text is not in each file that uses them."""
    out = []
    for api in apis:
        if not api.guarded:
            continue
        for f in api.used_in:
            if api.guard_text not in (root / "titan_dmuon" / f).read_text():
                out.append(f"{api.path} in {f}: no {api.guard_text!r}")
    return out


# ---- the check on this torch ------------------------------------------------------------------------------------


def check(apis: tuple[PrivateAPI, ...] = PRIVATE_APIS, out=print) -> bool:
    """One line per API on this torch; False if a required one is missing."""
    import torch

    out(f"torch {torch.__version__} (the project pins 2.13): {len(apis)} private APIs the code calls")
    ok = True
    seen = set()
    for api in apis:
        if api.path in seen:
            continue
        seen.add(api.path)
        where = ", ".join(sorted({f for a in apis if a.path == api.path for f in a.used_in}))
        try:
            note = api.check()
            out(f"  ok       {api.path}" + (f": {note}" if note not in (None, True) else "") + f"  [{where}]")
        except Exception as e:  # noqa: BLE001
            if api.guarded:
                out(f"  absent   {api.path} ({type(e).__name__}): guarded, {api.guard}  [{where}]")
            else:
                ok = False
                out(f"  MISSING  {api.path}: {type(e).__name__}: {e}  [{where}: required, no fallback]")
    return ok


# Public APIs with a version-dependent signature, what the parity tests patch, and the imports a run needs: checked
# with the private ones (a missing one is a failure).
def _public_checks() -> list[tuple[str, Callable[[], object]]]:
    return [
        ("fully_shard(ignored_params=)", lambda: _has_param("torch.distributed.fsdp", "fully_shard", "ignored_params")),
        ("torch.optim.Muon (the tests' reference)", lambda: _attr("torch.optim", "Muon") and None),
        (
            "torch.optim._muon._zeropower_via_newtonschulz (tests/reference.py patches it)",
            lambda: _attr("torch.optim._muon", "_zeropower_via_newtonschulz") and None,
        ),
        (
            "checkpoint.state_dict get/set_optimizer_state_dict",
            lambda: _attr("torch.distributed.checkpoint.state_dict", "set_optimizer_state_dict") and None,
        ),
        (
            "import titan_dmuon.dmuon (installs the FSDP2 patch)",
            lambda: importlib.import_module("titan_dmuon.dmuon") and None,
        ),
        (
            "import titan_dmuon.trainer (tyro, torchdata, tensorboard)",
            lambda: importlib.import_module("titan_dmuon.trainer") and None,
        ),
    ]


def check_public(out=print) -> bool:
    ok = True
    for what, fn in _public_checks():
        try:
            fn()
            out(f"  ok       {what}")
        except Exception as e:  # noqa: BLE001
            ok = False
            out(f"  MISSING  {what}: {type(e).__name__}: {e}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scan", action="store_true", help="list the private uses the scan finds, listed or not")
    args = parser.parse_args(argv)
    if args.scan:
        uses = scan()
        left = set(uncovered(uses))
        for u in uses:
            print(f"{'UNLISTED ' if u in left else 'listed   '}{u.file}:{u.line} {u.chain}")
        return 1 if left else 0
    left, unguarded = uncovered(scan()), missing_guards()
    ok = check()
    print("public APIs and imports:")
    ok = check_public() and ok
    for u in left:
        print(f"  UNLISTED {u.file}:{u.line} {u.chain} (add it to scripts/gpu_check_api.py)")
    for line in unguarded:
        print(f"  UNGUARDED {line}")
    ok = ok and not left and not unguarded
    if os.environ.get("GPU_CHECK_PLANTED"):  # scripts/gpu_check.sh GPU_CHECK_PLANT_FAIL=compat
        print("FAIL: planted failure (GPU_CHECK_PLANTED)")
        ok = False
    print(f"compat: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
