"""What an evaluation holds beside the target (light side: stdlib only), and how transformers' `device_map`
places the target's layers when the drafter sits on the first GPU. trainer/layout/inference.py plans
the harness with it; `dflash plan`, `dflash eval` and preflight count the same bytes.

The drafter as `dflash eval` loads it (trainer/eval/models.py `load_drafter`): speculators'
DFlashDraftModel in **fp32** on the harness's device (the first GPU: `HookedTarget.device`, where the
target's features are gathered), with

- its trainable tensors (decoder layers, fc, hidden_norm, norm: `Shapes.drafter_trainable`);
- the frozen ones read from the target: embed_tokens (vocab x hidden), the head (vocab x hidden; with
  the whole vocabulary lm_head and verifier_lm_head hold the same target lm_head, and load_drafter
  makes them one tensor: the harness never reads verifier_lm_head; a draft vocabulary keeps two
  draft_vocab x hidden heads) and verifier_norm (`Shapes.drafter_frozen`); with a draft vocabulary
  the t2d (vocab, bool) and d2t (draft_vocab, int64) maps; the rotary tables (2 x head_dim / 2 fp32).

Kept in fp32 on purpose: the drafter's dtype cannot change which tokens are committed (every one is the
target's own greedy token: the lossless check is the same), but it does change which drafts the drafter
proposes at near-ties, so tau in bf16 would not be the number earlier reports measured.
32B-class drafters: 4 B x (vocab x hidden x 2) ~ 5.8 GiB of frozen tensors + ~2.3 GiB per 1-layer
drafter (Qwen3-32B, drafter.num_layers 1).

Its working set during one prompt of `tokens` positions (the prefill is the peak): the aux layers'
outputs gathered to the first GPU (target dtype), their concatenation (target dtype) and its fp32 copy,
fc and hidden_norm's outputs (fp32), the drafter's own KV cache over the context (fp32, every draft
layer) and one block's logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.layout.sizing import Shapes

GIB = float(2**30)
EVAL_DRAFTER_BYTES = 4  # load_drafter: `.float()`


def eval_drafter_weight_bytes(s: Shapes) -> int:
    """The drafter's tensors as `load_drafter` holds them (see the module docstring)."""
    maps = (s.vocab + 8 * s.draft_vocab) if s.draft_vocab else 0  # t2d bool, d2t int64
    rotary = 2 * (s.head_dim // 2) * 4  # inv_freq and original_inv_freq (transformers' Qwen3 rotary)
    return EVAL_DRAFTER_BYTES * (s.drafter_trainable + s.drafter_frozen) + maps + rotary


def eval_drafter_working_bytes(s: Shapes, tokens: int, block: int) -> int:
    """The drafter's side of one prompt of `tokens` positions at block size `block` (fp32)."""
    kv = s.kv_heads * s.head_dim
    features = s.n_aux * s.hidden * tokens * (2 * s.target_dtype_bytes + 4)
    projected = 2 * tokens * s.hidden * 4  # fc, hidden_norm
    cache = (s.draft_layers + 1) * 2 * tokens * kv * 4  # every layer's K/V + one layer's projections
    logits = block * s.head_rows * 4
    return features + projected + cache + logits


def eval_drafter(s: Shapes, tokens: int, block: int) -> dict[str, Any]:
    """The drafter's bytes on the harness's first GPU, by part, and the shapes they came from."""
    return {
        "drafter_weights": eval_drafter_weight_bytes(s),
        "drafter_working": eval_drafter_working_bytes(s, tokens, block),
        "layers": s.draft_layers,
        "draft_vocab_size": s.draft_vocab,
        "dtype": "float32",
    }


def drafter_shapes(folder: Path, target: Shapes) -> tuple[Shapes, int] | None:
    """(Shapes, block size) of a speculators DFlash checkpoint folder, from its config.json (the
    target's shapes where it names none); None for a folder in another format (z-lab/SpecForge: eval
    converts it first) or without a readable config."""
    try:
        raw = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    tl = raw.get("transformer_layer_config")
    if not isinstance(tl, dict) or "speculators_model_type" not in raw:
        return None
    hidden = int(tl.get("hidden_size") or target.hidden)
    heads = int(tl.get("num_attention_heads") or target.heads)
    vocab = int(tl.get("vocab_size") or target.vocab)
    draft_vocab = raw.get("draft_vocab_size")
    s = Shapes(
        target_params=target.target_params,
        target_dtype_bytes=target.target_dtype_bytes,
        hidden=hidden,
        vocab=vocab,
        intermediate=int(tl.get("intermediate_size") or target.intermediate),
        heads=heads,
        kv_heads=int(tl.get("num_key_value_heads") or target.kv_heads),
        head_dim=int(tl.get("head_dim") or hidden // heads),
        attention_bias=bool(tl.get("attention_bias", False)),
        draft_layers=int(tl.get("num_hidden_layers") or 1),
        n_aux=len(raw.get("aux_hidden_state_layer_ids") or []) or target.n_aux,
        draft_vocab=int(draft_vocab) if draft_vocab and int(draft_vocab) != vocab else None,
    )
    return s, int(raw.get("block_size") or 8)


def device_map_fill(
    modules: list[int], caps: list[float], main_reserve: float, balanced: bool = True
) -> list[float] | None:
    """Bytes of weights per GPU as transformers' `device_map="auto"` places `modules` (the target's
    no-split units in order: embedding, each decoder layer, final norm, lm_head) under `max_memory`
    `caps` (transformers/integrations/accelerate.py, get_balanced_memory then infer_auto_device_map):
    every GPU but the last is capped at total / n + 1.25 x the largest unit, the first GPU keeps the
    largest unit free (`main_reserve`: room for an offloaded layer), and each unit goes to the first
    GPU, in order, that still has room. None when some unit finds no GPU (the load would offload to the
    CPU or fail)."""
    n = len(caps)
    total = float(sum(modules))
    largest = float(max(modules))
    limits = list(caps)
    if balanced and n > 1:
        per_gpu = total / n + 1.25 * largest
        limits = [min(per_gpu, c) for c in caps[:-1]] + [caps[-1]]
    limits[0] -= main_reserve
    placed = [0.0] * n
    gpu = 0
    for size in modules:
        while gpu < n and placed[gpu] + size > limits[gpu]:
            gpu += 1
        if gpu == n:
            return None
        placed[gpu] += size
    return placed
