"""Where DMuon's forward/backward hooks attach, independent of who owns what (docs/dmuon.md,
"Hook boundaries and the per-step lifecycle").

Default: the `layers.N` / `blocks.N` ancestor of each dedicated param (one packed broadcast per block),
else the param's parent module. An explicit `hook_boundary_predicate(module)` picks the lowest ancestor
for which it is true, mirroring `fully_shard(module)`.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch.nn as nn

_LAYER_RE = re.compile(r"^(.*?(?:^|\.)(?:layers|blocks)\.\d+)\.")


def _find_layer_module(model: nn.Module, param_fqn: str) -> str:
    """FQN of the `layers.N` / `blocks.N` ancestor of a param, else of its parent module ('' = root)."""
    m = _LAYER_RE.match(param_fqn)
    if m:
        return m.group(1)
    return param_fqn.rpartition(".")[0]


def _find_hook_module(model: nn.Module, param_fqn: str, predicate: Callable[[nn.Module], bool]) -> str:
    """FQN of the lowest ancestor module of a param for which `predicate(module)` is true."""
    parts = param_fqn.split(".")[:-1]
    for depth in range(len(parts), -1, -1):
        fqn = ".".join(parts[:depth])
        if predicate(model.get_submodule(fqn)):
            return fqn
    raise ValueError(
        f"hook_boundary_predicate is false for every ancestor of '{param_fqn}' (the root included): "
        "make it true for the module that should own this param's broadcast (e.g. its transformer block)"
    )


def resolve_hook_modules(
    model: nn.Module, param_fqns: list[str], predicate: Callable[[nn.Module], bool] | None
) -> dict[str, str]:
    """Map each param FQN to the FQN of the module whose hooks serve it."""
    out = {}
    for fqn in param_fqns:
        out[fqn] = _find_layer_module(model, fqn) if predicate is None else _find_hook_module(model, fqn, predicate)
        module = model.get_submodule(out[fqn])
        if type(module).forward is nn.Module.forward:
            raise ValueError(
                f"hook boundary '{out[fqn] or '<root>'}' of '{fqn}' is a {type(module).__name__} with no "
                "forward of its own (hooks on it never fire): give that layer a module with a forward, or "
                "pass hook_boundary_predicate selecting a module that is called"
            )
    return out
