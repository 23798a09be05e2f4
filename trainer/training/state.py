"""The run state besides the weights: the optimizer (AdamW, or Muon + AdamW; ZeRO-1 sharded over the
ranks, whole, or over FSDP's sharded parameters: sharding.py) with its learning-rate schedule, the
RNG states (seeded, saved, restored for an exact resume) and torch's deterministic mode."""

from __future__ import annotations

import math
import os
import random
from collections.abc import MutableMapping
from typing import Any

import numpy as np
import torch

from trainer.config import RunConfig


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


def lr_lambda(cfg: RunConfig):
    """The LambdaLR factor: linear warmup (`train.warmup_steps`, or `warmup_ratio` of the steps), then
    constant or cosine down to `train.min_lr_ratio` at `train.max_steps`."""
    t = cfg.train
    warm = t.resolved_warmup_steps

    def f(step: int) -> float:  # step = optimizer steps done so far
        if warm and step < warm:
            return (step + 1) / warm
        if t.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, t.max_steps - warm))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def make_optimizer(model: torch.nn.Module, cfg: RunConfig, zero: bool):
    """(optimizer, scheduler) over `model`'s trainable parameters with the `lr_lambda` schedule:
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
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
