"""How the drafter is spread over the trainer ranks: `train.shard`.

- `none`: DDP; every rank holds the whole drafter, its gradients and AdamW's moments.
- `optimizer`: DDP + ZeRO-1 (torch's ZeroRedundancyOptimizer): each rank keeps the moments of its
  share of the parameters.
- `full`: FSDP2 (torch's `fully_shard`): the trainable weights, their gradients and the moments are
  sharded over the ranks; each draft layer is one group, gathered only while it runs (and again in
  the backward), the drafter's own small tensors (fc, norms) are the root group. The frozen
  embedding and heads stay whole on every rank (`ignored_params`): they are never updated, so there
  is nothing to reduce, and the loss reads all of them every step. On CUDA: bf16 parameters and
  compute, fp32 sharded master weights and fp32 reduce-scatter.

With one rank every level is the plain optimizer (`train.optimizer`) on the bare drafter. DDP is
built with `gradient_as_bucket_view`: the gradients are views into its buckets instead of a second
copy.

One interface for the loop, whatever the level: `wrap`, `accumulating` (gradients kept local for
all but the last micro-batch), `clip_grad_norm`, and the checkpoint's `gather_state` / `load_state`:
a checkpoint holds the full weights and the optimizer's ordinary state dict (ids over its param
groups in order: the trainable order under AdamW) whatever the level, so it reloads in
`SpeculatorModel.from_pretrained` and resumes the same run.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from trainer.config.run import RunConfig
from trainer.training.distributed import Dist
from trainer.training.muon import MUON_STATE
from trainer.training.state import make_optimizer

DESCRIPTION = {
    "none": "{}",
    "optimizer": "ZeroRedundancyOptimizer({})",
    "full": "FSDP2({})",
}


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


class Sharding:
    """The drafter, its gradients and its optimizer over the ranks at level `train.shard`."""

    def __init__(self, cfg: RunConfig, d: Dist, bf16: bool):
        self.d = d
        self.level = cfg.train.shard if d.enabled else "none"  # one rank: nothing to shard over
        self.bf16 = bf16
        self.optimizer_name = {"adamw": "AdamW", "muon": "Muon+AdamW"}[cfg.train.optimizer]
        self.model: nn.Module | None = None
        self._prefix = ""

    @property
    def description(self) -> str:
        return DESCRIPTION[self.level].format(self.optimizer_name)

    # -------------------------------------------------------------- build
    def wrap(self, model: nn.Module, drafter: nn.Module) -> nn.Module:
        """`model` (the drafter, or a module holding it as `.drafter`) ready for the ranks."""
        base = "" if model is drafter else "drafter."
        self._prefix = "module." + base if self.level != "full" and self.d.enabled else base
        if not self.d.enabled:
            self.model = model
        elif self.level == "full":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16 if self.bf16 else None,
                reduce_dtype=torch.float32 if self.bf16 else None,
            )
            frozen = {p for p in model.parameters() if not p.requires_grad}
            for layer in drafter.layers:
                fully_shard(layer, mp_policy=mp)
            fully_shard(model, mp_policy=mp, ignored_params=frozen)
            self.model = model
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP

            dev = self.d.device
            self.model = DDP(
                model, device_ids=[dev.index] if dev.type == "cuda" else None, gradient_as_bucket_view=True
            )
        return self.model

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def make_optimizer(self, cfg: RunConfig):
        """(optimizer, scheduler) over the wrapped model's trainable parameters (FSDP's are its
        sharded DTensors, so the optimizer's state is sharded with them)."""
        return make_optimizer(self.model, cfg, zero=self.level == "optimizer")

    # -------------------------------------------------------------- a step
    @contextlib.contextmanager
    def accumulating(self, local: bool):
        """Inside, with `local`: the backward keeps its gradient on this rank (DDP `no_sync`, FSDP
        without the reduce-scatter); the next backward outside reduces what was accumulated."""
        if not (local and self.d.enabled):
            yield
        elif self.level == "full":
            self.model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.model.set_requires_gradient_sync(True)
        else:
            with self.model.no_sync():
                yield

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm over every rank's shards; the norm as a plain tensor."""
        norm = torch.nn.utils.clip_grad_norm_(self.trainable(), max_norm)
        return norm.full_tensor() if _is_dtensor(norm) else norm

    def local_moment_numel(self, optimizer) -> int:
        """Elements of the optimizer's moments this rank holds (AdamW's exp_avg + exp_avg_sq, Muon's
        momentum_buffer)."""
        local = optimizer.optim if self.level == "optimizer" else optimizer
        return sum(
            _local(v).numel()
            for st in local.state.values()
            for k, v in st.items()
            if k in ("exp_avg", "exp_avg_sq", *MUON_STATE)
        )

    def fingerprint(self) -> torch.Tensor:
        """A float64 fingerprint of what this rank holds whole and every rank must hold alike,
        compared across ranks at each checkpoint: the trainable weights under DDP; under FSDP, where
        each trainable weight has one owner, the frozen tensors every rank keeps a copy of."""
        full = self.level == "full"
        with torch.no_grad():
            parts = [_checksum(p) for p in self.model.parameters() if p.requires_grad != full]
            return torch.stack(parts).sum().reshape(1).cpu()

    # -------------------------------------------------------------- checkpoints
    def _names(self) -> list[str]:
        """Trainable parameter names as the drafter has them, in the optimizer's order."""
        p = self._prefix
        return [n[len(p) :] for n, q in self.model.named_parameters() if q.requires_grad]

    def _optimizer_fqns(self, optimizer) -> list[str]:
        """The model's names of the optimizer's parameters, over its groups in order: the ids of its
        state dict (one group under AdamW: the trainable order; Muon + AdamW: AdamW's, then Muon's)."""
        name = {id(q): n for n, q in self.model.named_parameters()}
        return [name[id(q)] for g in optimizer.param_groups for q in g["params"]]

    def gather_state(self, optimizer) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any] | None]:
        """What a checkpoint saves, on rank 0: (the drafter's full state dict for `save_pretrained`,
        None where the drafter itself holds it whole; the optimizer's state dict). (None, None) on the
        other ranks. A collective under FSDP and ZeRO (every rank calls it)."""
        if self.level == "full":
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
                get_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            weights = get_model_state_dict(self.model, options=opts)
            osd = get_optimizer_state_dict(self.model, optimizer, options=opts)
            if not self.d.is_main:
                return None, None
            p = self._prefix
            weights = {k[len(p) :]: v for k, v in weights.items() if k.startswith(p)}
            return weights, _fqn_to_ids(osd)
        if self.level == "optimizer":
            optimizer.consolidate_state_dict(to=0)
        if not self.d.is_main:
            return None, None
        return None, optimizer.state_dict()

    def load_state(self, weights: dict[str, torch.Tensor], optimizer, osd: dict[str, Any]) -> None:
        """Load a checkpoint's full trainable weights and optimizer state (every rank reads it whole;
        FSDP and ZeRO keep their share)."""
        names = self._names()
        if self.level == "full":
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True, strict=False)
            p = self._prefix
            set_model_state_dict(self.model, {p + n: weights[n] for n in names}, options=opts)
            set_optimizer_state_dict(
                self.model, optimizer, _ids_to_fqn(osd, self._optimizer_fqns(optimizer)), options=opts
            )
            return
        with torch.no_grad():
            for n, q in zip(names, self.trainable(), strict=True):
                q.copy_(weights[n].to(q.dtype))
        optimizer.load_state_dict(osd)


def _checksum(t: torch.Tensor, chunk: int = 1 << 24) -> torch.Tensor:
    """sum + 1e-3 * sum |x| in float64, `chunk` elements at a time (no float64 copy of a vocab-wide
    tensor)."""
    flat = t.detach().reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=flat.device)
    for s in range(0, flat.numel(), chunk):
        x = flat[s : s + chunk].double()
        total += x.sum() + x.abs().sum() * 1e-3
    return total


def _fqn_to_ids(osd: dict[str, Any]) -> dict[str, Any]:
    """torch.distributed.checkpoint's optimizer state (keyed by parameter name) as the optimizer's own
    state dict (keyed by the parameter's index over the groups in order, as `Optimizer.state_dict`)."""
    index = {n: i for i, n in enumerate(n for g in osd["param_groups"] for n in g["params"])}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in osd["param_groups"]]
    return {"state": {index[n]: st for n, st in osd["state"].items()}, "param_groups": groups}


def _ids_to_fqn(osd: dict[str, Any], fqns: list[str]) -> dict[str, Any]:
    """The inverse of `_fqn_to_ids`: `fqns` are the names in the optimizer's group order."""
    groups = [{**g, "params": [fqns[i] for i in g["params"]]} for g in osd["param_groups"]]
    return {"state": {fqns[int(i)]: st for i, st in osd["state"].items()}, "param_groups": groups}
