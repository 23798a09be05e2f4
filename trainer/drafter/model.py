"""The drafter: speculators' DFlashDraftModel built from the target's config, with the target's
embedding, head and final norm (frozen). Heavy side."""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.config.run import RunConfig


def resolve_attn_impl(cfg: RunConfig, device: torch.device) -> str:
    """drafter.attn_implementation on `device`; flex attention has no backward on CPU."""
    name = cfg.drafter.attention_on(cuda=device.type == "cuda")
    if name == "simple_flex_attention" and device.type != "cuda":
        raise ValueError("drafter.attn_implementation simple_flex_attention has no backward on CPU: use sdpa")
    return name


def loss_implementation(device: torch.device) -> str:
    """speculators' fused loss needs Triton (CUDA); the eager one runs anywhere. The fused one is made
    ready for the drafter's compiled forward first (`separate_fused_kernel_configs`)."""
    if device.type != "cuda":
        return "eager"
    separate_fused_kernel_configs()
    return "fused"


def separate_fused_kernel_configs() -> None:
    """speculators 0.9.0 decorates the fused loss's forward and backward Triton kernels with one
    `triton.autotune` object, so both Autotuners hold the same `configs` list. The drafter's forward is
    compiled on CUDA and calls the loss inside it; dynamo tracks that list once and refuses it the
    second time ("ListVariable(length=21) is already tracked for mutation"): every `dflash train` with
    the default (fused) loss died in its first step (found by bench/gpu on an H200, torch 2.11; torch
    2.13's dynamo raises the same). Each kernel gets a copy of the same configs: nothing else changes."""
    from speculators.losses import fused

    seen: set[int] = set()
    for kernel in (fused.loss_forward_kernel, fused.loss_backward_kernel):
        configs = getattr(kernel, "configs", None)
        if isinstance(configs, list):
            if id(configs) in seen:
                kernel.configs = list(configs)
            seen.add(id(kernel.configs))


def draft_layer_config(cfg: RunConfig):
    """The draft decoder config, seeded from the target's (speculators' own builder)."""
    from speculators.train.cli import create_transformer_layer_config

    d = cfg.drafter
    full = d.full_attention_layers
    if full is None:
        full = list(range(d.num_layers)) if d.sliding_window is None else [d.num_layers - 1]
    tl = create_transformer_layer_config(
        str(cfg.target.path),
        num_layers=d.num_layers,
        draft_arch="qwen3",
        hidden_act=None,
        sliding_window=d.sliding_window,
        full_attention_indices=full,
    )
    if d.intermediate_size is not None:
        tl.intermediate_size = d.intermediate_size
    return tl


def build_drafter(cfg: RunConfig, device: torch.device, head_dtype: torch.dtype | None = None):
    """A fresh drafter (its layers random, or the target's last ones with `drafter.init: target`; or
    warm-started from `drafter.warm_start`), trainable params fp32; with
    `drafter.draft_vocab_size`, its heads are the target's rows of the data's most frequent
    supervised tokens (trainer/drafter/vocab.py). `head_dtype`: store the frozen heads in that dtype
    (bf16 under bf16 autocast, see cast_frozen_heads)."""
    import logging

    from speculators.models.dflash import DFlashDraftModel

    logging.getLogger("speculators").setLevel(logging.WARNING)
    tl = draft_layer_config(cfg)
    vocab = int(tl.vocab_size)
    mapping = {}
    if cfg.drafter.draft_vocab_size is not None:  # the data's most frequent supervised tokens
        from trainer.drafter.vocab import draft_vocab_for

        dv = draft_vocab_for(cfg.data.path, cfg.drafter.draft_vocab_size, vocab)
        mapping, vocab = {"t2d": dv.t2d, "d2t": dv.d2t}, dv.size
    model = DFlashDraftModel.from_training_args(
        tl,
        **mapping,
        draft_vocab_size=vocab,
        block_size=cfg.drafter.block_size,
        verifier_name_or_path=str(cfg.target.path),
        target_layer_ids=cfg.drafter.aux_ids,
        mask_token_id=cfg.drafter.mask_token_id,
        draft_attn_impl=resolve_attn_impl(cfg, device),
    )
    model.draft_vocab_coverage = dv.coverage if mapping else 1.0  # share of supervised tokens kept
    if list(model.target_layer_ids) != list(cfg.drafter.aux_ids):  # never silently rewired
        raise RuntimeError(f"drafter wired to {model.target_layer_ids}, config asks {cfg.drafter.aux_ids}")
    share_frozen_head(model)
    if head_dtype is not None:
        cast_frozen_heads(model, head_dtype)
    if cfg.drafter.init == "target":  # preflight refused a target it cannot copy; this checks again
        from trainer.drafter.target_init import init_from_target
        from trainer.target.info import TargetInfo

        layers = TargetInfo.from_folder(cfg.target.path).num_layers
        init_from_target(model, cfg.target.path, layers, cfg.drafter.intermediate_size)
    if cfg.drafter.warm_start is not None:
        load_trainable_weights(model, Path(cfg.drafter.warm_start) / "model.safetensors")
    return model.to(device)


def load_sdpa_drafter(folder: Path, config, **from_pretrained):
    """`DFlashDraftModel.from_pretrained(folder, config=config, **from_pretrained)` with sdpa attention
    throughout, for inference (eval, export, salvage's CPU forward).

    A reloaded drafter otherwise comes back with flex attention (speculators' default), which CPU
    lacks and the eval harness does not use: `config` is set to sdpa before the layers are built,
    and the model's attention choice, its mask function and every layer's config are set to sdpa
    again after loading. Returns what from_pretrained returns ((model, info) with
    `output_loading_info=True`)."""
    from speculators.models.dflash import DFlashDraftModel
    from torch.nn.attention.flex_attention import create_mask

    config.transformer_layer_config._attn_implementation = "sdpa"
    loaded = DFlashDraftModel.from_pretrained(str(folder), config=config, **from_pretrained)
    model = loaded[0] if from_pretrained.get("output_loading_info") else loaded
    model._attn_impl = "sdpa"
    model._create_mask_fn = create_mask
    for layer in model.layers:
        layer.self_attn.config._attn_implementation = "sdpa"
    return loaded


def share_frozen_head(model) -> bool:
    """With the full vocabulary, speculators loads the target's lm_head into both lm_head and
    verifier_lm_head, both frozen and neither saved: one tensor serves both (saves vocab x hidden
    fp32 per rank). A reduced draft vocabulary keeps its own lm_head. Returns whether it shared."""
    if model.use_draft_vocab:
        return False
    head, verifier = model.lm_head.weight, model.verifier_lm_head.weight
    if head.requires_grad or verifier.requires_grad or not torch.equal(head, verifier):
        raise RuntimeError("lm_head and verifier_lm_head differ or are trainable: cannot share them")
    model.lm_head.weight = verifier
    return True


class TargetEmbedding(torch.nn.Module):
    """The drafter's frozen input embedding read from the co-located target's own tensor (its
    output cast to the drafter's dtype): no second vocab x hidden copy. The tensor is not a
    parameter or buffer of the drafter (the target owns it), so nothing saves, moves, shards or
    reduces it through the drafter; `weight` still answers for code that reads it."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self._target_weight = (weight,)  # a tuple: not registered by nn.Module
        self.out_dtype = dtype
        self.num_embeddings, self.embedding_dim = weight.shape

    @property
    def weight(self) -> torch.Tensor:
        return self._target_weight[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.weight).to(self.out_dtype)


def share_target_embedding(model, weight: torch.Tensor | None, rows: int = 4096) -> str | None:
    """Replace the drafter's fp32 copy of the target's embedding by the target's own tensor when
    every value is equal once upcast (a bf16 target's embedding upcasts exactly: the lookups are
    bit-identical). Returns None when shared, else why not (the copy is kept)."""
    if weight is None:
        return "the target is not in this process"
    own = model.embed_tokens.weight
    if tuple(own.shape) != tuple(weight.shape) or own.device != weight.device:
        return f"the target's embedding is {tuple(weight.shape)} on {weight.device}, the drafter's " + (
            f"{tuple(own.shape)} on {own.device}"
        )
    with torch.no_grad():
        for s in range(0, own.shape[0], rows):
            if not torch.equal(own[s : s + rows], weight[s : s + rows].to(own.dtype)):
                return (
                    f"the target's embedding ({weight.dtype}) differs from the drafter's copy from row "
                    f"{s} (the target loaded in another dtype than its weights?)"
                )
    model.embed_tokens = TargetEmbedding(weight, own.dtype)
    return None


def trainable_state(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def read_trainable_weights(model, path: Path) -> dict[str, torch.Tensor]:
    """Every trainable tensor of `model` from a speculators model.safetensors, by name; names and
    shapes must match (an FSDP-sharded model's parameters have their full shapes)."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    want = trainable_state(model)
    missing = sorted(set(want) - set(tensors))
    if missing:
        raise ValueError(
            f"{path}: missing trainable tensors {missing[:5]}{'...' if len(missing) > 5 else ''}"
        )
    for name, param in want.items():
        src = tensors[name]
        if tuple(src.shape) != tuple(param.shape):
            raise ValueError(
                f"{path}: {name} has shape {tuple(src.shape)}, the drafter needs {tuple(param.shape)}"
            )
    return {name: tensors[name] for name in want}


def check_same_draft_vocab(model, path: Path) -> None:
    """A resume continues the run's own draft vocabulary: the checkpoint's d2t must be the one the
    drafter was built with from the data (a changed data.path or draft_vocab_size would silently score
    other tokens with the trained layers)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        saved = f.get_tensor("d2t") if "d2t" in f.keys() else None
    ours = model.d2t if model.use_draft_vocab else None
    if saved is None and ours is None:
        return
    if saved is None or ours is None or not torch.equal(saved.to(ours.device), ours):
        theirs = "none" if saved is None else f"{saved.shape[0]} tokens"
        mine = "none" if ours is None else f"{ours.shape[0]} tokens"
        raise ValueError(
            f"{path}: the checkpoint's draft vocabulary ({theirs}) is not the one this run's data and "
            f"drafter.draft_vocab_size give ({mine}): resume with the run's own data and "
            "drafter.draft_vocab_size, or start a new out_dir"
        )


def load_trainable_weights(model, path: Path) -> None:
    """Load every trainable tensor from a speculators model.safetensors; shapes must match."""
    params = trainable_state(model)
    with torch.no_grad():
        for name, src in read_trainable_weights(model, path).items():
            params[name].copy_(src.to(params[name].dtype))


def count_trainable(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def cast_frozen_heads(model, dtype: torch.dtype) -> None:
    """Store the frozen lm_head / verifier_lm_head in `dtype` (kept shared when they are).

    Only for a run under autocast to that dtype: autocast casts these weights to it for every matmul
    anyway, so the logits and gradients are bit-identical, while the fp32 copy and the cast autocast
    keeps alive for the backward (a frozen weight's cast is not cached) are gone: 4 + 2 bytes become 2
    per vocab x hidden element. The embedding stays fp32: it is the model's first parameter, whose
    dtype transformers writes into the checkpoint's config.json, and its output feeds the fp32
    residual stream."""
    shared = model.lm_head.weight is model.verifier_lm_head.weight
    with torch.no_grad():
        for module in (model.verifier_lm_head, model.lm_head):
            if module is model.lm_head and shared:
                module.weight = model.verifier_lm_head.weight
            elif module.weight.dtype != dtype:
                module.weight = torch.nn.Parameter(module.weight.detach().to(dtype), requires_grad=False)
