"""The run's checks on itself and the warnings they raise: the target's features finite on every
rank, the target's agreement with the data, non-finite steps (and when there are too many to go
on), stalled steps."""

from __future__ import annotations

from typing import Any

import torch

from trainer.config.run import RunConfig
from trainer.training.distributed import Dist, all_ranks, all_reduce_


def features_finite(cap, d: Dist) -> bool:
    """The target's features are finite on every rank. A broken target (corrupt shard, fp16
    overflow) otherwise trains silently: NaN verifier logits have argmax 0 everywhere, the
    drafter learns to always say 0 and `eal` looks perfect."""
    return all_ranks(bool(torch.isfinite(cap.aux).all()) and bool(torch.isfinite(cap.last).all()), d)


@torch.no_grad()
def target_agreement(drafter, b: dict[str, Any], cap, d: Dist, rows: int = 1024) -> float | None:
    """Share of supervised tokens that equal the verifier's own greedy prediction from the
    previous position (pooled over ranks). On data the target wrote itself (what DFlash's
    targets assume) it is near 1. Low: the data was written by another model or with another
    chat template / thinking mode, or the target is broken (its logits collapse). With a draft
    vocabulary the verifier head scores only the kept tokens: its argmax is mapped back to target ids
    and only tokens of the draft vocabulary are counted. `rows` tokens are scored at a time: the
    [T, vocab] logits never materialise at once (the trainer passes its loss chunk, at most 1024)."""
    ids, mask, docs = b["input_ids_t"][0], b["loss_mask_t"][0], b["document_ids_t"][0]
    head, norm = drafter.verifier_lm_head, drafter.verifier_norm
    reduced = bool(getattr(drafter, "use_draft_vocab", False))
    hits = torch.zeros(2, device=d.device)
    T = ids.numel()
    for s in range(0, T - 1, rows):
        e = min(T - 1, s + rows)
        pred = head(norm(cap.last[0, s:e].float()).to(head.weight.dtype)).argmax(-1)  # bf16 head on CUDA
        sel = (mask[s + 1 : e + 1] != 0) & (docs[s + 1 : e + 1] == docs[s:e])
        if reduced:
            pred = pred + drafter.d2t[pred]
            sel &= drafter.t2d[ids[s + 1 : e + 1]]
        hits[0] += (pred[sel] == ids[s + 1 : e + 1][sel]).sum()
        hits[1] += sel.sum()
    all_reduce_(hits, d)
    return (hits[0] / hits[1]).item() if hits[1] > 0 else None


class RunHealth:
    """The warnings of one run about itself, through the trainer's `emit` and `log` (rank 0 only).
    Keeps the count of non-finite steps in a row and warns about low agreement once per run."""

    def __init__(self, cfg: RunConfig, emit, log, where=None):
        """`where`: a callable that says which ranks (nodes) are behind, for a stall warning."""
        self.train, self.emit, self.log, self.where = cfg.train, emit, log, where
        self.bad_streak = 0
        self.agreement_warned = False

    def on_stall(self, step: int, waited: float, threshold: float) -> None:
        """The stall watchdog's callback (its own thread)."""
        factor = self.train.stall_factor
        message = f"step {step} has run {waited:.0f}s (> {threshold:.0f}s, {factor:g}x the median step)"
        where = self.where() if self.where else ""
        self.emit(
            "warning",
            kind="stall",
            step=step,
            waited_s=round(waited, 1),
            message=message + (f": {where}" if where else ""),
        )
        self.log(f"WARNING step {step} stalled for {waited:.0f}s" + (f": {where}" if where else ""))

    def after_step(self, step: int, m: dict[str, Any], problem: str | None) -> bool:
        """Warn about step `step` (its metrics `m`, its `problem`: nonfinite_target, nonfinite_loss or
        None). True when the run must stop: more than `train.nan_tolerance` non-finite steps in a row."""
        if problem:
            self.bad_streak += 1
            what = "target features" if problem == "nonfinite_target" else "loss/grad"
            self.emit(
                "warning",
                kind=problem,
                step=step,
                loss=m["loss"],
                grad_norm=m["grad_norm"],
                message=f"non-finite {what} at step {step}: update skipped ({self.bad_streak} in a row)",
            )
            self.log(f"WARNING non-finite {what} at step {step}: update skipped")
            if self.bad_streak > self.train.nan_tolerance:
                hint = (
                    "check the target's weights (a corrupt shard? fp16 overflow?)"
                    if problem == "nonfinite_target"
                    else "lower train.lr or check the data"
                )
                self.emit(
                    "warning",
                    kind="nonfinite_abort",
                    step=step,
                    message=f"{self.bad_streak} non-finite steps in a row: stopping ({hint})",
                )
                return True
        else:
            self.bad_streak = 0
        agreement = m.get("target_agreement")
        floor = self.train.min_target_agreement
        if agreement is not None and agreement < floor and not self.agreement_warned:
            self.agreement_warned = True
            self.emit(
                "warning",
                kind="low_target_agreement",
                step=step,
                target_agreement=agreement,
                message=f"only {agreement:.0%} of supervised tokens are the target's own greedy choice "
                f"(< {floor:.0%}): the drafter learns the target's "
                "predictions, not this data. Regenerate the responses with this target and "
                "the serving chat template (`dflash regenerate`), or check the target's weights",
            )
            self.log(
                f"WARNING target agreement {agreement:.1%} at step {step}: data not written by this target?"
            )
        return False
