"""Structure the code keeps: rules a reader relies on when carrying it on, checked on the source text."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from titan_dmuon.components.optimizer import available_optimizers, get_optimizer_component

PACKAGE = Path(__file__).resolve().parents[3] / "titan_dmuon"


def test_the_trainer_names_no_optimizer() -> None:
    """The trainer asks the optimizer component (titan_dmuon/components/optimizer/) what it needs; a branch on an
    optimizer's name there would have to be repeated for every new one."""
    text = (PACKAGE / "trainer.py").read_text()
    text = re.sub(r"titan_dmuon|TITAN_DMUON", "", text)  # the package's own name is no optimizer's
    names = {*available_optimizers(), "muon", "adamw"}
    found = sorted({m.group(0) for m in re.finditer(r"[A-Za-z_]+", text) if m.group(0).lower() in names})
    assert not found, f"titan_dmuon/trainer.py names optimizers: {found}"


def test_only_the_planned_optimizer_gets_the_device_memory_check() -> None:
    """The trainer's CUDA memory check runs for the components the planner models, which is dmuon alone: muon_naive
    and adamw keep their params in FSDP2, a layout the planner does not cost."""
    assert {name for name in available_optimizers() if get_optimizer_component(name).planned} == {"dmuon"}


def test_no_model_family_imports_another() -> None:
    """The families share titan_dmuon/models/common/; one importing a sibling is a copy waiting to happen (a third
    family would have to pick which sibling to lean on)."""
    models = PACKAGE / "models"
    families = sorted(p.name for p in models.iterdir() if p.is_dir() and p.name not in ("common", "__pycache__"))
    assert {"llama3", "qwen3"} <= set(families), families
    for family in families:
        for path in sorted((models / family).rglob("*.py")):
            text = path.read_text()
            for other in families:
                if other != family:
                    pattern = rf"(models\.{other}\b|from \.\.{other}\b|import {other}\b)"
                    assert not re.search(pattern, text), f"{path.relative_to(PACKAGE)} imports the {other} family"


def _imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, in functions too, but not under `if TYPE_CHECKING:` (types only)."""
    found = []

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    walk(other)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            walk(child)

    walk(tree)
    return found


def test_no_import_cycle() -> None:
    """No module of the package reaches itself through imports, counting the ones inside functions (an import moved
    into a function to dodge a cycle hides the cycle, it does not remove it): each module sits above what it uses."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if package else parts)] = (path, package)
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, package) in modules.items():
        here = name if package else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges[name] |= {a.name for a in node.names if a.name in modules}
                continue
            base = node.module or ""
            if node.level:
                parent = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target in modules or base in modules:
                    edges[name].add(target if target in modules else base)
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for nxt in sorted(edges[name] - {name}):
            assert state.get(nxt) != 1, "import cycle: " + " -> ".join([*path[path.index(nxt) :], nxt])
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[name] = 2

    for name in sorted(modules):
        if name not in state:
            visit(name, [name])
