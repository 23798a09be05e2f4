"""The source a run config asks for: the one place that knows every kind of hidden-state source (the
kinds import the interface in base.py; base.py imports none of them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the light side stays importable without torch
    import torch

    from trainer.config.run import RunConfig


def make_source(
    cfg: RunConfig,
    device: torch.device,
    devices: list[torch.device] | None = None,
    *,
    d=None,
    warn=None,
):
    """The source a run config asks for: the in-process hooked target, or a vLLM server (the run's
    own, started by the main rank, or the one at target.vllm.url). `d`: the run's Dist, `warn(kind,
    message)`: where a source's warnings go."""
    if cfg.target.source == "vllm":
        from trainer.sources.vllm import open_vllm_source

        return open_vllm_source(cfg, device, d=d, warn=warn)
    from trainer.sources.hooked import HookedTransformersSource

    return HookedTransformersSource(
        cfg.target.path,
        cfg.drafter.aux_ids,
        dtype=cfg.target.dtype,
        out_device=device,
        devices=devices or [device],
    )
