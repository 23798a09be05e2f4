"""`drafter.init: target`: the drafter's layers start as copies of the target's last layers.

A DFlash drafter layer is a decoder layer of the target's own shapes (speculators builds its config
from the target's) whose keys and values also read the target's hidden states. With `init: target`,
draft layer j starts as target layer L - n + j (L target layers, n draft layers): attention
projections, MLP and both norms (q_norm/k_norm too where the target has them; a Llama target has none
and they stay ones). Around them, what makes the copies see what they saw in the target:

- the drafter's final norm is the target's final norm (the head it feeds is the target's);
- `fc` passes the deepest aux layer through unchanged (an identity block, the other aux layers' blocks
  zero, all trainable), and `hidden_norm` is the first copied layer's input norm: the context the
  copied layers attend to starts as the target's own residual stream near that depth, normalised as
  the target normalises it.

`plan_target_init` is light (the safetensors headers only): preflight uses it to refuse a target
whose last layers are not plain attention layers (a linear-attention or gated layer: a key missing or a
shape unlike the drafter's) before anything loads. `init_from_target` is heavy: it reads those
tensors and copies them into a built drafter, checking every shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.errors import DflashError

# every plain decoder layer has these (Llama, Qwen2/3, Mistral, ...); the drafter's layer too
LAYER_PARTS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
# copied where the target has them (Qwen3's q/k norms, Qwen2's attention biases); else left as built
OPTIONAL_PARTS = (
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "self_attn.q_proj.bias",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.bias",
    "self_attn.o_proj.bias",
)
FIX = "set drafter.init: random (the default), or a target whose last layers are plain attention layers"


class DrafterInitError(DflashError, ValueError):
    """`drafter.init: target` cannot copy the target's layers (exit 2, before training)."""


@dataclass
class TargetInitPlan:
    """Which target tensor each drafter tensor starts as, the target layers copied, and what is wrong."""

    sources: dict[str, str] = field(default_factory=dict)  # drafter tensor name -> target key
    layers: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def layer_prefix(tensors: dict[str, Any], last: int) -> str | None:
    """The key prefix of the target's decoder layers (`model.`, `model.language_model.`, ...): from
    the shortest key naming the last layer's input norm."""
    tail = f"layers.{last}.input_layernorm.weight"
    keys = [k for k in tensors if k == tail or k.endswith("." + tail)]
    return min(keys, key=len)[: -len(tail)] if keys else None


def plan_target_init(
    tensors: dict[str, dict[str, Any]], target_layers: int, draft_layers: int, intermediate: int | None = None
) -> TargetInitPlan:
    """The copy plan from the target's safetensors headers (`tensors`: name -> {"shape": ...}).
    `intermediate`: the drafter's MLP width when set apart from the target's (then the MLP cannot be
    copied)."""
    plan = TargetInitPlan()
    if draft_layers > target_layers:
        plan.problems.append(f"the drafter has {draft_layers} layers, the target only {target_layers}")
        return plan
    prefix = layer_prefix(tensors, target_layers - 1)
    if prefix is None:
        plan.problems.append(
            f"the target's weights have no layers.{target_layers - 1}.input_layernorm.weight: its last "
            "layer is not a plain decoder layer"
        )
        return plan
    first = target_layers - draft_layers
    plan.layers = list(range(first, target_layers))
    for j, src in enumerate(plan.layers):
        for part in LAYER_PARTS + OPTIONAL_PARTS:
            key = f"{prefix}layers.{src}.{part}"
            if key in tensors:
                plan.sources[f"layers.{j}.{part}"] = key
            elif part in LAYER_PARTS:
                plan.problems.append(f"the target has no {key} (layer {src} is not a plain attention layer)")
    plan.sources["hidden_norm.weight"] = f"{prefix}layers.{first}.input_layernorm.weight"
    if f"{prefix}norm.weight" in tensors:
        plan.sources["norm.weight"] = f"{prefix}norm.weight"
    else:
        plan.problems.append(f"the target has no final norm {prefix}norm.weight")
    up = tensors.get(f"{prefix}layers.{first}.mlp.up_proj.weight")
    if intermediate is not None and up is not None and int(up["shape"][0]) != intermediate:
        plan.problems.append(
            f"drafter.intermediate_size is {intermediate}, the target's MLP is {up['shape'][0]} wide: "
            "its layers cannot be copied (remove drafter.intermediate_size)"
        )
    return plan


def init_from_target(model, target: Path, target_layers: int, intermediate: int | None = None) -> list[int]:
    """Copy the target's last layers into `model` (a built DFlashDraftModel) as the plan says; fc
    passes the deepest aux layer through. Returns the target layers copied. Raises DrafterInitError on
    a missing tensor or a shape unlike the drafter's (nothing is copied then)."""
    import torch
    from safetensors import safe_open

    from trainer.target.info import read_weight_headers

    headers = read_weight_headers(Path(target))
    plan = plan_target_init(headers.tensors, target_layers, len(model.layers), intermediate)
    problems = plan.problems + [m for _, m in headers.problems]
    if problems:
        raise DrafterInitError(f"drafter.init: target: {'; '.join(problems)}; {FIX}")
    params = dict(model.named_parameters())
    wanted = {key: name for name, key in plan.sources.items()}
    loaded: dict[str, torch.Tensor] = {}
    for path in headers.files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in set(f.keys()) & set(wanted):
                loaded[wanted[key]] = f.get_tensor(key)
    wrong = [
        f"{name} is {tuple(src.shape)} in the target, {tuple(params[name].shape)} in the drafter"
        for name, src in loaded.items()
        if tuple(src.shape) != tuple(params[name].shape)
    ]
    if wrong:
        raise DrafterInitError(f"drafter.init: target: {'; '.join(wrong[:4])}; {FIX}")
    with torch.no_grad():
        for name, src in loaded.items():
            params[name].copy_(src.to(params[name].dtype))
        fc = model.fc.weight  # [hidden, n_aux * hidden]
        hidden = fc.shape[0]
        deepest = max(range(len(model.target_layer_ids)), key=lambda i: model.target_layer_ids[i])
        fc.zero_()
        fc[:, deepest * hidden : (deepest + 1) * hidden] = torch.eye(hidden, dtype=fc.dtype)
    return plan.layers
