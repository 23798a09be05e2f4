"""The hidden-state source interface the training loop depends on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the light side stays importable without torch
    import torch


@dataclass
class Captured:
    """What one target forward yields for the drafter (all on the drafter's device)."""

    aux: torch.Tensor  # [1, T, n_aux * H]: aux layers concatenated in aux_ids order
    last: torch.Tensor  # [1, T, H]: the verifier's last hidden state, BEFORE the final norm


class HiddenStateSource(Protocol):
    aux_ids: list[int]  # speculators convention: id k = HF hidden_states[k]
    hidden_size: int
    num_layers: int

    def capture(self, input_ids: torch.Tensor, position_ids: torch.Tensor, ticket=None) -> Captured:
        """Run the frozen target on one packed sequence ([1, T] each; positions restart per
        document) and return its features. Never computes the target's lm_head. `ticket`: what
        `batches()` attached to the batch when it was requested ahead (None: compute now)."""
        ...

    def batches(self, sampler):
        """The sampler the loop draws from: `sampler` itself, or one that requests batches ahead."""
        ...

    @property
    def embedding_weight(self) -> torch.Tensor | None:
        """The target's input embedding when this process holds it (an in-process copy, on the
        drafter's device), else None: the drafter can then use it instead of its own copy."""
        ...
