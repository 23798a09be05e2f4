"""The drafter's loss without the vocabulary-wide tensors: `train.loss_chunk_rows`.

speculators' DFlash forward applies `lm_head` to every query row (anchors x block) and
`verifier_lm_head` to the verifier's hidden state at every target row, so a step holds two
`[rows, vocab]` tensors plus the loss's own copies (8192 x 248,320 for the seeds' recipe: gigabytes).
`ChunkedDraftLoss` runs speculators' own backbone with both heads deferred (they return the hidden
states they are given), then applies the heads and speculators' own per-position loss to `rows`
rows at a time under activation checkpointing: the forward keeps no chunk's logits, the backward
recomputes one chunk at a time. The masking, the position weights (exp decay or D-PACE) and the
reduction are speculators' `compound_loss`; the accuracy and accepted-length metrics are its
counters over argmaxes taken per chunk. Same loss and gradients as the unchunked forward up to
float rounding (tests/unit/test_chunked_loss.py); the loss function itself (eager on CPU, the fused
Triton kernels on CUDA) is the one `train.loss` selects, applied per chunk.

An `nn.Module` holding the drafter, so DDP wraps it like the drafter itself (the loop calls it with
the drafter's own forward signature and gets speculators' `(None, loss, metrics)`).

Compiled where speculators compiles: speculators wraps only `DFlashDraftModel.forward` in
`torch.compile`, and only when CUDA is visible (`conditional_torch_compile`,
speculators/models/utils.py; models/dflash/core.py). Calling `_backbone_forward` directly skips that,
and flex attention run outside `torch.compile` takes torch's unfused path, which materialises the
whole fp32 score matrix (torch/nn/attention/flex_attention.py). So the backbone call goes through
the same decision (`backbone_forward`): compiled on CUDA, as is on CPU (where the drafter runs sdpa).
The two identity heads are made once, so the compiled backbone sees the same modules every step
(one graph across steps: checked)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# torch.compile's options for the backbone on CUDA (tests trace with backend="eager" on CPU)
COMPILE_OPTIONS: dict = {}


def backbone_forward(drafter: nn.Module) -> Callable:
    """`drafter._backbone_forward` compiled exactly where speculators compiles the drafter's own
    forward: its `conditional_torch_compile` (CUDA visible and `torch.compile` present)."""
    from speculators.models.utils import conditional_torch_compile

    return conditional_torch_compile(drafter._backbone_forward, **COMPILE_OPTIONS)


def is_compiled(fn: Callable) -> bool:
    """Whether `fn` is a `torch.compile` wrapper."""
    return hasattr(fn, "_torchdynamo_orig_callable")


@contextlib.contextmanager
def _heads_deferred(
    drafter: nn.Module, identities: tuple[nn.Module, nn.Module]
) -> Iterator[tuple[nn.Module, nn.Module]]:
    """Inside: `lm_head` and `verifier_lm_head` are `identities` (the backbone returns the normed draft
    hidden states as "logits" and the normed verifier states as "targets"); yields the real heads."""
    heads = (drafter.lm_head, drafter.verifier_lm_head)
    drafter.lm_head, drafter.verifier_lm_head = identities
    try:
        yield heads
    finally:
        drafter.lm_head, drafter.verifier_lm_head = heads


def _per_position_chunked(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    head: nn.Module,
    verifier_head: nn.Module,
    rows: int,
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """speculators' per-position loss `fn(logits, targets) -> [1, N]`, over hidden states instead of
    logits: the heads and `fn` applied `rows` rows at a time, each chunk recomputed in the backward."""

    def chunk_loss(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return fn(head(h), verifier_head(t))

    def per_position(hidden: torch.Tensor, target_hidden: torch.Tensor) -> torch.Tensor:
        parts = [
            checkpoint(
                chunk_loss, hidden[:, s : s + rows], target_hidden[:, s : s + rows], use_reentrant=False
            )
            for s in range(0, hidden.shape[1], rows)
        ]
        return torch.cat(parts, dim=1)

    return per_position


@torch.no_grad()
def _argmax_chunked(states: torch.Tensor, head: nn.Module, rows: int) -> torch.Tensor:
    """argmax over the vocabulary of `head(states)`, `rows` rows at a time: [1, N] token ids."""
    return torch.cat(
        [head(states[:, s : s + rows]).argmax(dim=-1) for s in range(0, states.shape[1], rows)], dim=1
    )


class ChunkedDraftLoss(nn.Module):
    """The drafter's training forward with its loss over `rows`-row chunks (see the module doc)."""

    def __init__(self, drafter: nn.Module, rows: int):
        super().__init__()
        if rows < 1:
            raise ValueError(f"loss chunk rows must be at least 1, got {rows}")
        self.drafter = drafter
        self.rows = rows
        self._identities = (nn.Identity(), nn.Identity())  # a tuple: not submodules, no state
        self._backbone = backbone_forward(drafter)

    def forward(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        verifier_last_hidden_states: torch.Tensor,
        document_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        loss_config=None,
        gamma: float = 4.0,
        max_anchors: int = 512,
        per_position_loss_weight: str = "fixed-exp-decay",
        dpace_alpha: float = 0.5,
    ):
        from speculators.losses import compound_loss, dflash_loss_decay, dpace_loss_decay
        from speculators.models.metrics import compute_accepted_length_counts, compute_accuracy_multi_step

        d = self.drafter
        if loss_config is None:
            raise ValueError(
                "ChunkedDraftLoss needs the run's loss_config (speculators' resolve_loss_config)"
            )
        with _heads_deferred(d, self._identities) as (head, verifier_head):
            _, hidden, target_hidden, mask, _ = self._backbone(
                hidden_states,
                input_ids,
                loss_mask,
                verifier_last_hidden_states,
                document_ids,
                position_ids,
                max_anchors=max_anchors,
            )
        block, from_anchor = d.block_size, bool(d.config.sample_from_anchor)
        pos_idx = (torch.arange(hidden.shape[1], device=hidden.device) % block).unsqueeze(0)
        chunked = {
            name: (_per_position_chunked(fn, head, verifier_head, self.rows), weight)
            for name, (fn, weight) in loss_config.items()
        }
        if per_position_loss_weight == "dpace":  # as speculators' dflash compute_metrics builds it
            decay = partial(dpace_loss_decay, loss_mask=mask, block_size=block, dpace_alpha=dpace_alpha)
        else:
            decay = partial(dflash_loss_decay, gamma=gamma, sample_from_anchor=from_anchor)
        loss, term_losses = compound_loss(hidden, target_hidden, mask, pos_idx, chunked, decay_fn=decay)

        # the metrics speculators' compute_metrics reports, from ids taken per chunk
        pred_ids = _argmax_chunked(hidden.detach(), head, self.rows)
        target_ids = _argmax_chunked(target_hidden, verifier_head, self.rows)
        correct, total = compute_accuracy_multi_step(pred_ids, target_ids, mask, pos_idx, block)
        one = torch.tensor(1.0, device=hidden.device)
        metrics = {"loss_sum": loss.detach().clone(), "loss_total": one}
        for name, value in term_losses.items():
            metrics[f"{name}_sum"], metrics[f"{name}_total"] = value, one.clone()
        start = 0 if from_anchor else 1
        metrics["full_acc_sum"], metrics["full_acc_total"] = correct[start:].sum(), total[start:].sum()
        for pos in range(start, block):
            metrics[f"position_{pos}_acc_sum"], metrics[f"position_{pos}_acc_total"] = (
                correct[pos],
                total[pos],
            )
        metrics["eal_sum"], metrics["eal_total"] = compute_accepted_length_counts(
            (pred_ids == target_ids).reshape(-1, block)[:, start:],
            mask.to(torch.bool).reshape(-1, block)[:, start:],
        )
        return None, loss, metrics
