"""Make a plain `fully_shard(module, mesh=...)` skip DMuon's dedicated params (docs/dmuon.md, "Ownership").

The patch wraps one private FSDP2 function, `_fsdp_init._get_managed_states`, adding every param that
carries `_dedicated_owner_rank` to `ignored_params`. FSDP2 and DMuon then manage disjoint param sets.
"""

from __future__ import annotations

import torch

_PATCHED_ATTR = "_dmuon_patched"


def install_patch() -> None:
    """Idempotent. Fails loudly when this torch lacks the private function the patch needs."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_init
    except ImportError as e:  # pragma: no cover - depends on the torch build
        raise ImportError(
            f"titan_dmuon.dmuon needs FSDP2 (torch.distributed.fsdp._fully_shard); "
            f"torch {torch.__version__} has none: install torch 2.13"
        ) from e
    original = getattr(_fsdp_init, "_get_managed_states", None)
    if original is None:
        raise ImportError(
            f"titan_dmuon.dmuon patches torch.distributed.fsdp._fully_shard._fsdp_init._get_managed_states, "
            f"which torch {torch.__version__} does not have: use torch 2.13 (the version DMuon supports)"
        )
    if getattr(original, _PATCHED_ATTR, False):
        return

    def _get_managed_states(modules, ignored_params=None):
        ignored = set(ignored_params) if ignored_params else set()
        for module in modules:
            for _, param in module.named_parameters(recurse=False):
                if hasattr(param, "_dedicated_owner_rank"):
                    ignored.add(param)
        return original(modules, ignored)

    setattr(_get_managed_states, _PATCHED_ATTR, True)
    _fsdp_init._get_managed_states = _get_managed_states
