"""What a verify forward needs on targets whose layers are not all full attention (heavy side).

Sliding-window layers (gpt-oss, Gemma 3: `layer_types` names `sliding_attention`, with
`sliding_window`):

- the KV cache: transformers gives such a layer a `DynamicSlidingWindowLayer`, which keeps only the
  last window-1 positions and refuses `crop` once the window is full ("the current layer does not
  track past states"): the harness's rollback after a rejected block died with that traceback on the
  first prompt longer than the window. The verify cache is a plain `DynamicCache()` instead (every
  layer full, as the drafter's own cache is, trainer/eval/harness.py): the window is applied by the
  mask the model builds per layer type, so the logits are the same, and a crop is a crop.
- a tree's 4D mask (trainer/eval/tree.py): a model takes a 4D mask as it is, for every layer, so a
  sliding layer would see the whole context; the tree's mask goes in per layer type, the sliding
  layers' cut to the window by position (query at p sees position q only if p - q < window, as
  transformers' `sliding_window_overlay`).

Eager attention (a model without sdpa: gpt-oss, whose attention sinks sdpa lacks, loads eager) adds
its mask to the scores: a boolean mask becomes 0 / the dtype's minimum.

Targets with linear-attention layers (Qwen3.5) are left as they are: their recurrent state is another
matter (the cache's own layers are kept)."""

from __future__ import annotations

import torch

SLIDING = "sliding_attention"


def layer_types(model) -> set[str]:
    cfg = model.config.get_text_config()
    return set(getattr(cfg, "layer_types", None) or ())


def sliding_window(model) -> int | None:
    """The window of the target's sliding layers, None when it has none."""
    cfg = model.config.get_text_config()
    window = getattr(cfg, "sliding_window", None)
    return int(window) if window and SLIDING in layer_types(model) else None


def verify_cache(model, cache):
    """The cache to run a verify forward on: `cache` when there is one, a plain `DynamicCache()` (full
    layers) for a fresh forward of a target with sliding layers, else None (the model's own)."""
    if cache is not None or sliding_window(model) is None:
        return cache
    from transformers import DynamicCache

    return DynamicCache()


def verify_mask(model, mask: torch.Tensor | None, position_ids: torch.Tensor | None):
    """A tree's boolean mask [1, 1, q, past+q] as the target takes it: per layer type with the sliding
    layers' window, additive under eager attention; unchanged for a full-attention sdpa target."""
    if mask is None:
        return mask
    window = sliding_window(model)
    eager = model.config._attn_implementation == "eager"
    if window is None and not eager:
        return mask
    masks = {t: mask for t in layer_types(model) or {"full_attention"}}
    if window is not None:
        past = mask.shape[-1] - mask.shape[-2]
        q_pos = position_ids[0].to(mask.device)
        kv_pos = torch.cat([torch.arange(past, device=mask.device), q_pos])
        masks[SLIDING] = mask & (q_pos[:, None] - kv_pos[None, :] < window)[None, None]
    if eager:
        low = torch.finfo(model.dtype).min
        masks = {
            t: torch.zeros(m.shape, dtype=model.dtype, device=m.device).masked_fill(~m, low)
            for t, m in masks.items()
        }
    return masks if window is not None else masks["full_attention"]
