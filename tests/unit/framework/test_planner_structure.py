"""The dry-run planner (titan_dmuon/planner/) builds on public API alone: the optimizer library's (`dmuon.<name>`,
`dmuon.costs.<name>`, no import of its modules) and torch's, so that a change inside either cannot silently change
the plan; what it costs comes from the library's cost model, which the optimizer itself uses."""

from __future__ import annotations

import ast
import pkgutil
from pathlib import Path

from titan_dmuon import dmuon

PLANNER = Path(__file__).resolve().parents[3] / "titan_dmuon" / "planner"
# torch registers the "fake" process-group backend only in this module (torch 2.13): the one private import
FAKE_PG = "torch.testing._internal.distributed.fake_pg"


def _modules() -> dict[str, ast.Module]:
    names = [m.name for m in pkgutil.iter_modules([str(PLANNER)])]
    assert {"plan", "memory", "lpt", "communication", "report"} <= set(names), names
    return {n: ast.parse((PLANNER / f"{n}.py").read_text()) for n in ["__init__", *names]}


def test_the_planner_imports_no_private_module() -> None:
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            else:
                continue
            for module in modules:
                assert not module.startswith("titan_dmuon.dmuon"), (name, module)  # `from titan_dmuon import dmuon`
                private = module != "__future__" and any(part.startswith("_") for part in module.split("."))
                assert not private or module == FAKE_PG, (name, module)
                if isinstance(node, ast.ImportFrom) and module.startswith("torch"):
                    assert not [a.name for a in node.names if a.name.startswith("_")], (name, module)


def test_the_planner_uses_public_library_names() -> None:
    used, used_costs = set(), set()
    for tree in _modules().values():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            if isinstance(node.value, ast.Name) and node.value.id == "dmuon":
                used.add(node.attr)
            elif isinstance(node.value, ast.Name) and node.value.id == "costs":  # `costs = dmuon.costs`
                used_costs.add(node.attr)
            elif isinstance(node.value, ast.Attribute) and node.value.attr == "costs":
                used_costs.add(node.attr)
    assert used and used <= set(dmuon.__all__), used - set(dmuon.__all__)
    assert used_costs and used_costs <= set(dmuon.costs.__all__), used_costs - set(dmuon.costs.__all__)
    assert {"shard_axis", "replicate_axis", "tp_update", "tp_gram", "KINDS"} <= used_costs
    assert "dedicated_matrices" in used
