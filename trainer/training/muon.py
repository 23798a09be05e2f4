"""`train.optimizer: muon`: torch's Muon on the drafter's 2-D weight matrices, torch's AdamW on the
rest, as ONE optimizer.

Which tensor goes where is speculators' rule (`split_named_params_for_muon`: 2-D, both sides above 1,
not an embedding or a head). speculators drives two optimizers side by side; here they are the two
halves of one `torch.optim.Optimizer` whose param groups carry `muon: True` or not, because the rest
of the trainer takes one optimizer: ZeroRedundancyOptimizer partitions its groups over the ranks
(each rank builds a `MuonWithAdamW` over its share), LambdaLR schedules every group's lr, FSDP2's
state-dict helpers read and write it, and a checkpoint holds one ordinary optimizer state dict
(ids over the groups in order). The inner Muon and AdamW share this optimizer's group dicts and its
`state`, so each does exactly its own update on exactly its own groups.
"""

from __future__ import annotations

from typing import Any

import torch

MUON_STATE = ("momentum_buffer",)


class MuonWithAdamW(torch.optim.Optimizer):
    """Groups with `muon: True` are stepped by torch.optim.Muon, the others by torch.optim.AdamW.
    Each group carries its own hyper-parameters (`muon_param_groups` writes Muon's into its group):
    a wrapper that rebuilds the groups (ZeRO-1 partitions them) keeps them as they are."""

    def __init__(
        self, params, lr: float, betas: tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.0
    ):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay, "muon": False})
        self._link()

    def _link(self) -> None:
        """The inner optimizers over this one's own group dicts and state."""
        adamw = [g for g in self.param_groups if not g["muon"]]
        muon = [g for g in self.param_groups if g["muon"]]
        self._inner: list[torch.optim.Optimizer] = []
        if adamw:
            self._inner.append(torch.optim.AdamW(adamw, lr=adamw[0]["lr"]))
        if muon:
            self._inner.append(torch.optim.Muon(muon, lr=muon[0]["lr"]))
        for inner in self._inner:
            inner.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # new group dicts and state: link them again
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for inner in self._inner:
            inner.step()
        return loss


def muon_param_groups(
    model: torch.nn.Module, lr: float, momentum: float, weight_decay: float
) -> list[dict[str, Any]]:
    """[AdamW's group, Muon's group] of `model`'s trainable parameters by speculators' rule (a group
    left out when it is empty), each in the model's parameter order; Muon's group carries Muon's
    learning rate, momentum and weight decay, and speculators' `match_rms_adamw` scaling (AdamW's
    update RMS, so one lr scale serves both)."""
    from speculators.train.optimizers import split_named_params_for_muon

    muon, adamw = split_named_params_for_muon(model)
    groups: list[dict[str, Any]] = []
    if adamw:
        groups.append({"params": [p for _, p in adamw], "muon": False})
    if muon:
        groups.append(
            {
                "params": [p for _, p in muon],
                "muon": True,
                "lr": lr,
                "momentum": momentum,
                "weight_decay": weight_decay,
                "adjust_lr_fn": "match_rms_adamw",
            }
        )
    return groups
