"""Structure the code keeps: rules a reader relies on when carrying it on, checked on the source text."""

from __future__ import annotations

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
