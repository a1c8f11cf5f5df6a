"""Optimizer components selected by `optimizer.name`: dmuon, muon_naive, adamw (base.py: the protocol and the
registry; importing this package registers the three)."""

from . import adamw, dmuon, muon_naive  # noqa: F401 (each registers itself)
from .base import (
    OptimizerComponent,
    available_optimizers,
    build_optimizer_component,
    get_optimizer_component,
    muon_predicate,
    register_optimizer,
)
from .muon_naive import NaiveMuon

__all__ = [
    "NaiveMuon",
    "OptimizerComponent",
    "available_optimizers",
    "build_optimizer_component",
    "get_optimizer_component",
    "muon_predicate",
    "register_optimizer",
]
