"""The run state besides the weights: the optimizer (AdamW, or Muon + AdamW; ZeRO-1 sharded over the
ranks, whole, or over FSDP's sharded parameters: sharding.py) with its learning-rate schedule (over
the steps, or over a time budget's progress), the RNG states (seeded, saved, restored for an exact
resume) and torch's deterministic mode."""

from __future__ import annotations

import math
import os
import random
from collections.abc import MutableMapping
from typing import Any

import numpy as np
import torch

from trainer.config.run import RunConfig


def seed_all(seed: int) -> None:
    """Seed torch, numpy and Python's RNGs alike."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


DETERMINISTIC_ENV = "DFLASH_DETERMINISTIC"  # 1: on, also on CUDA; 0: off; unset: on CPU only
CUBLAS_WORKSPACE = ":4096:8"  # the cuBLAS workspace torch's deterministic mode asks for


def set_determinism(device: torch.device, environ: MutableMapping[str, str] = os.environ) -> bool:
    """torch's deterministic algorithms (warn-only where an op has none): on CPU by default, where they
    cost nothing and the exact-resume tests rely on them; on CUDA only with DFLASH_DETERMINISTIC=1.
    On CUDA they slow every step: inductor drops reduction configs from its autotuning
    (torch/_inductor/runtime/triton_heuristics.py), ops take their slower deterministic kernels, and
    fresh allocations are NaN-filled; and they would not make a GPU run bit-exact anyway (warn-only:
    speculators' fused Triton loss is not covered). When asked for on CUDA: CUBLAS_WORKSPACE_CONFIG
    is set (unless set; cuBLAS reads it when its handle is made, before the first matmul) and the
    NaN fill is turned off (torch.utils.deterministic.fill_uninitialized_memory). Returns the mode."""
    import torch.utils.deterministic

    value = environ.get(DETERMINISTIC_ENV, "").strip()
    on = value == "1" if value in ("0", "1") else device.type != "cuda"
    if on and device.type == "cuda":
        environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        torch.utils.deterministic.fill_uninitialized_memory = False
    torch.use_deterministic_algorithms(on, warn_only=True)
    return on


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def decay_factor(progress: float, train) -> float:
    """The factor after warm-up at `progress` (0..1) through the decay: 1 (constant), or cosine from 1
    down to `train.min_lr_ratio` at 1."""
    if train.schedule == "constant":
        return 1.0
    p = min(1.0, max(0.0, progress))
    return train.min_lr_ratio + (1 - train.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))


def lr_lambda(cfg: RunConfig):
    """The LambdaLR factor: linear warmup (`train.warmup_steps`, or `warmup_ratio` of the steps), then
    constant or cosine down to `train.min_lr_ratio` at `train.max_steps`."""
    t = cfg.train
    warm = t.resolved_warmup_steps

    def f(step: int) -> float:  # step = optimizer steps done so far
        if warm and step < warm:
            return (step + 1) / warm
        return decay_factor((step - warm) / max(1, t.max_steps - warm), t)

    return f


def budget_factor(progress: float, train) -> float:
    """The factor at `progress` (0..1) through a time budget: linear warm-up over the first
    `train.warmup_ratio` of it, then the decay over the rest; the floor at 1 (the last step)."""
    warm = train.warmup_ratio
    if warm and progress < warm:
        return max(progress, 1e-3 * warm) / warm
    return decay_factor((progress - warm) / (1 - warm) if warm < 1 else 1.0, train)


class BudgetSchedule:
    """`train.time_budget`'s learning-rate schedule: the factor follows the progress the budget
    (trainer/training/budget.py) sets before each step, not the step count. The same face as the
    LambdaLR the loop otherwise holds: `get_last_lr()` is the step's rate, `step()` after the update,
    `state_dict()` / `load_state_dict()` for the checkpoint."""

    def __init__(self, optimizer, train):
        self.optimizer, self.train = optimizer, train
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]  # Muon's groups have their own
        self.progress, self.last_epoch = 0.0, 0
        self.set_progress(0.0)

    def set_progress(self, progress: float) -> None:
        """The rate of the coming step at `progress` (never back: a restart continues)."""
        self.progress = max(self.progress, min(1.0, progress))
        f = budget_factor(self.progress, self.train)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * f

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def step(self) -> None:
        self.last_epoch += 1

    def state_dict(self) -> dict[str, Any]:
        return {"progress": self.progress, "last_epoch": self.last_epoch, "base_lrs": self.base_lrs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A budget's schedule goes on where it was; a step schedule's state (a run given a budget
        on a restart) keeps its step count and starts the progress from the clock."""
        self.base_lrs = list(state.get("base_lrs") or self.base_lrs)
        self.last_epoch = int(state.get("last_epoch", 0))
        self.progress = 0.0
        self.set_progress(float(state.get("progress", 0.0)))


def make_optimizer(model: torch.nn.Module, cfg: RunConfig, zero: bool):
    """(optimizer, scheduler) over `model`'s trainable parameters with the `lr_lambda` schedule (the
    `BudgetSchedule` with `train.time_budget`):
    AdamW (`train.optimizer: adamw`) or Muon on the 2-D weights + AdamW on the rest (`muon`, one
    optimizer: trainer/training/muon.py). `zero`: ZeRO-1 (torch's ZeroRedundancyOptimizer), each rank
    keeps the optimizer state of its share of the parameters."""
    t = cfg.train
    adamw = {"lr": t.lr, "betas": t.betas, "weight_decay": t.weight_decay}
    if t.optimizer == "muon":
        from trainer.training.muon import MuonWithAdamW, muon_param_groups

        muon_lr = t.lr if t.muon_lr is None else t.muon_lr
        cls, kwargs = MuonWithAdamW, adamw
        params = muon_param_groups(model, muon_lr, t.muon_momentum, t.muon_weight_decay)
    else:
        cls, params, kwargs = torch.optim.AdamW, [p for p in model.parameters() if p.requires_grad], adamw
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(params, optimizer_class=cls, **kwargs)
    else:
        optimizer = cls(params, **kwargs)
    if t.time_budget is not None:  # the rate follows the budget's progress (BudgetSchedule)
        return optimizer, BudgetSchedule(optimizer, t)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
