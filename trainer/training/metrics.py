"""What one training step yields (`StepResult`) and the step event's fields made from it, pooled
over the ranks (`step_metrics`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainer.training.distributed import Dist, all_reduce_


@dataclass(frozen=True)
class StepResult:
    """One drafter step on this rank. A skipped update (non-finite loss, grad or target features on
    any rank) has `finite` False; when the drafter never ran, `loss` and `grad_norm` are NaN and
    `metrics` is empty."""

    loss: torch.Tensor  # this rank's loss (a 0-d tensor)
    metrics: dict[str, torch.Tensor]  # speculators' per-step sums and totals (eal, accuracies)
    grad_norm: torch.Tensor  # the total gradient norm before clipping
    lr: float  # the learning rate the step used
    finite: bool  # the update was applied on every rank

    @classmethod
    def skipped(cls, lr: float, device: torch.device) -> StepResult:
        """The step of a batch whose target features were not finite: no drafter forward at all."""
        nan = torch.tensor(float("nan"), device=device)
        return cls(loss=nan, metrics={}, grad_norm=nan, lr=lr, finite=False)


def merge_batches(batches: list[dict[str, Any]]) -> dict[str, Any]:
    """What `step_metrics` reads of a step's micro-batches (tokens, supervised tokens, documents) as
    one batch."""
    if len(batches) == 1:
        return batches[0]
    return {
        "input_ids": np.concatenate([b["input_ids"] for b in batches]),
        "loss_mask": np.concatenate([b["loss_mask"] for b in batches]),
        "num_docs": sum(int(b["num_docs"]) for b in batches),
    }


def start_step_memory(device: torch.device) -> None:
    """From here the CUDA peak is this step's: without a reset, `max_memory_allocated` keeps the
    process's highest mark (the target's load, the first compile's autotuning, a checkpoint's gather),
    not the step's peak that the memory model (trainer/layout/sizing.py) predicts."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def memory_snapshot(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {
            "gpu_allocated_gb": round(torch.cuda.memory_allocated(device) / 2**30, 3),
            "gpu_peak_gb": round(torch.cuda.max_memory_allocated(device) / 2**30, 3),
        }
    import psutil

    return {"rss_gb": round(psutil.Process().memory_info().rss / 2**30, 3)}


def step_metrics(
    result: StepResult,
    batch: dict[str, Any],
    *,
    d: Dist,
    block_size: int,
    started: float,
    captured: float,
    done: float,
) -> dict[str, Any]:
    """The step event's fields (a collective: sums over the ranks). `started`, `captured`, `done`:
    perf_counter at the step's start, after the target's capture, after the drafter step."""
    B = block_size
    keys = ["eal_sum", "eal_total", "full_acc_sum", "full_acc_total"]
    keys += [f"position_{k}_acc_{s}" for k in range(1, B) for s in ("sum", "total")]
    zero = torch.zeros((), device=d.device)
    vec = torch.stack(
        [result.metrics.get(k, zero).detach().float().reshape(()) for k in keys]
        + [
            result.loss.detach().float().reshape(()),
            torch.tensor(float(batch["input_ids"].size), device=d.device),
            torch.tensor(float(batch["loss_mask"].sum()), device=d.device),
        ]
    )
    all_reduce_(vec, d)
    vals = dict(zip(keys + ["loss", "tokens", "supervised"], vec.tolist()))

    def ratio(s: float, t: float) -> float | None:
        return (s / t) if t else None

    batch_tokens = int(vals["tokens"])
    step_s = done - started
    return {
        "loss": vals["loss"] / d.world_size,
        "finite": result.finite,
        "eal": ratio(vals["eal_sum"], vals["eal_total"]),
        "acc": ratio(vals["full_acc_sum"], vals["full_acc_total"]),
        "position_acc": [
            ratio(vals[f"position_{k}_acc_sum"], vals[f"position_{k}_acc_total"]) for k in range(1, B)
        ],
        "lr": result.lr,
        "grad_norm": float(result.grad_norm),
        "batch_tokens": batch_tokens,
        "supervised_tokens": int(vals["supervised"]),
        "docs": int(batch["num_docs"]),
        "tokens_per_s": batch_tokens / step_s if step_s > 0 else None,
        "target_s": round(captured - started, 5),
        "drafter_s": round(done - captured, 5),
        "step_s": round(step_s, 5),
        **memory_snapshot(d.device),
    }
