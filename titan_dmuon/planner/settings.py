"""The settings of a run that change what DMuon moves and where its state lives (`CommSettings`): the communication
plan's bytes and the memory plan's TP owners follow the same per-matrix TP decision."""

from __future__ import annotations

from dataclasses import dataclass

from titan_dmuon import dmuon
from titan_dmuon.config import JobConfig

costs = dmuon.costs


@dataclass(frozen=True)
class CommSettings:
    """The settings of a run that change what moves."""

    tp_distributed_gram: bool  # optimizer.dmuon.tp_distributed_gram: TP matrices may take the "gram" path
    gram_restarts: tuple[int, ...]  # the Gram NS restarts (one more Gram all-reduce each)
    fsdp_reshard_after_forward: str  # parallelism.fsdp_reshard_after_forward
    tp_distributed_gram_policy: str = "beneficial"  # optimizer.dmuon.tp_distributed_gram_policy: which of them do

    @classmethod
    def from_config(cls, cfg: JobConfig) -> CommSettings:
        mc = cfg.optimizer.muon
        return cls(
            tp_distributed_gram=cfg.optimizer.dmuon.tp_distributed_gram,
            gram_restarts=tuple(dmuon.gram_restarts(dmuon.resolve_coefficients(mc.ns_coefficients, mc.ns_steps))),
            fsdp_reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward,
            tp_distributed_gram_policy=cfg.optimizer.dmuon.tp_distributed_gram_policy,
        )

    def tp_decision(self, m: costs.Matrix) -> costs.TPDecision:
        """A dense matrix's TP path and why: `costs.tp_decision`, the rule dmuon.Muon follows."""
        return m.tp_decision(self.tp_distributed_gram, self.tp_distributed_gram_policy, self.gram_restarts)
