"""In-process hidden states: the target loaded with transformers, frozen, hooked.

Aux id k (speculators convention) is the output of decoder layer k-1 (id 0: the embeddings).
The verifier's last hidden state is the *input* of the final norm (HF's last `hidden_states`
entry is post-norm in transformers 5). The forward stops as soon as the last needed feature is
captured: the final norm, the lm_head (never even loaded: the base model is loaded) and any
layer past the deepest needed one are skipped.

A target too big for one GPU is split layer-wise over several devices (`devices`): contiguous
layer ranges per device, activations moved between them by pre-hooks.

A multimodal wrapper (Qwen3.5/3.6 ship as `Qwen3_5ForConditionalGeneration`: config.json with a
`text_config` and a `vision_config`, weights `model.language_model.*` and `model.visual.*`) is loaded as
its language model alone (`load_language_model`): the model is built from the text config, so the vision
tower is never built nor read, and transformers' key renaming maps `model.language_model.*` onto it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from trainer.errors import DflashError
from trainer.sources.base import Captured


class TargetLoadError(DflashError, ValueError):
    """A target whose language model cannot be loaded as asked; the message says what is missing."""


class _StopForward(Exception):
    pass


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def layerwise_assignment(num_layers: int, num_devices: int) -> list[int]:
    """Device index for each decoder layer: contiguous, balanced ranges (earlier devices also hold
    the embeddings, so they take the smaller share when the split is uneven)."""
    if num_devices < 1:
        raise ValueError("need at least one device")
    base, extra = divmod(num_layers, num_devices)
    sizes = [base + (1 if d >= num_devices - extra else 0) for d in range(num_devices)]
    out: list[int] = []
    for d, n in enumerate(sizes):
        out.extend([d] * n)
    return out


def _to_device(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_to_device(o, device) for o in obj)
    if isinstance(obj, list):
        return [_to_device(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


def language_model_config(target_path: Path):
    """The text config of a multimodal wrapper (a config whose language model is a sub-config, e.g.
    Qwen3_5Config's `text_config` beside its `vision_config`), None for a plain causal LM's config."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(target_path))
    text = config.get_text_config(decoder=True)
    return None if text is config else text


def load_language_model(auto_cls, target_path: Path, **kwargs) -> nn.Module:
    """`auto_cls.from_pretrained(target_path, **kwargs)` (AutoModel: the decoder stack without the head;
    AutoModelForCausalLM: with it) built from the language model's config alone for a multimodal
    wrapper (module doc): no vision (or audio) tower is built or loaded. TargetLoadError when a weight of
    the language model is not in the checkpoint (a wrapper whose names transformers does not map onto
    its text model would otherwise load random weights silently)."""
    text = language_model_config(target_path)
    if text is None:
        return auto_cls.from_pretrained(str(target_path), **kwargs)
    model, info = auto_cls.from_pretrained(str(target_path), config=text, output_loading_info=True, **kwargs)
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise TargetLoadError(
            f"{target_path}: loading the language model ({type(model).__name__}) of this "
            f"{type(text).__name__} wrapper finds {len(missing)} weight(s) missing from the checkpoint, "
            f"e.g. {missing[:3]}: transformers does not map this checkpoint's names onto its text model"
        )
    return model


def base_model(model: nn.Module) -> nn.Module:
    """The decoder stack (has .layers and .norm), whatever wrapper transformers returned."""
    for cand in (model, getattr(model, "model", None), getattr(model, "language_model", None)):
        if cand is not None and hasattr(cand, "layers") and hasattr(cand, "norm"):
            return cand
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "language_model"):
        return base_model(inner.language_model)
    raise TypeError(f"{type(model).__name__}: cannot find the decoder layers and final norm")


def aux_module(base: nn.Module, aux_id: int) -> nn.Module:
    """The module of the decoder stack `base` (see base_model) whose output is aux id `aux_id`,
    speculators' layer-id convention (id k = HF hidden_states[k]): the embeddings for 0, decoder
    layer k-1 for k >= 1."""
    return base.embed_tokens if aux_id == 0 else base.layers[aux_id - 1]


class HookedTransformersSource:
    def __init__(
        self,
        target_path: Path,
        aux_ids: list[int],
        dtype: str = "auto",
        out_device: torch.device | str = "cpu",
        devices: list[torch.device] | None = None,
        attn_implementation: str | None = None,  # transformers' choice: sdpa, else eager (gpt-oss)
        need_last: bool = True,
    ):
        from transformers import AutoModel
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # the base model loads without lm_head: that is the point
        self.out_device = torch.device(out_device)
        self.devices = [torch.device(d) for d in (devices or [self.out_device])]
        self.dtype = resolve_dtype(dtype, self.devices[0])
        model = load_language_model(
            AutoModel, target_path, dtype=self.dtype, attn_implementation=attn_implementation
        )
        self.model = base_model(model)
        self.model.eval().requires_grad_(False)
        self.config = self.model.config
        self.num_layers = len(self.model.layers)
        self.hidden_size = int(self.config.hidden_size)
        self.aux_ids = list(aux_ids)
        self.need_last = need_last
        bad = [k for k in self.aux_ids if not 0 <= k <= self.num_layers]
        if bad:
            raise ValueError(f"aux ids {bad} outside the target's depth [0, {self.num_layers}]")
        self._place()
        self._store: dict[int | str, torch.Tensor] = {}
        self._install_hooks()

    @property
    def embedding_weight(self) -> torch.Tensor:
        """The target's input embedding (on the first device, where the drafter runs)."""
        return self.model.embed_tokens.weight

    # ------------------------------------------------------------------ placement
    def _place(self) -> None:
        layer_dev = layerwise_assignment(self.num_layers, len(self.devices))
        self.layer_devices = [self.devices[i] for i in layer_dev]
        first, last = self.devices[0], self.devices[-1]
        for name, child in self.model.named_children():
            if name != "layers":
                child.to(last if name == "norm" else first)
        for layer, dev in zip(self.model.layers, self.layer_devices):
            layer.to(dev)
        if len(set(self.devices)) > 1:
            for layer, dev in zip(self.model.layers, self.layer_devices):
                layer.register_forward_pre_hook(
                    lambda _m, args, kwargs, d=dev: (_to_device(args, d), _to_device(kwargs, d)),
                    with_kwargs=True,
                )
            self.model.norm.register_forward_pre_hook(lambda _m, args, d=last: _to_device(args, d))

    # ------------------------------------------------------------------ hooks
    def _install_hooks(self) -> None:
        wanted = sorted(set(self.aux_ids))
        deepest = max(wanted) if wanted else 0
        stop_at_norm = self.need_last
        for k in wanted:
            module = aux_module(self.model, k)
            stop_here = (not stop_at_norm) and k == deepest
            module.register_forward_hook(self._make_hook(k, stop_here))
        if self.need_last:
            self.model.norm.register_forward_pre_hook(self._norm_pre_hook)

    def _make_hook(self, key: int, stop: bool):
        def hook(_module, _args, output):
            out = output[0] if isinstance(output, tuple) else output
            self._store[key] = out
            if stop:
                raise _StopForward

        return hook

    def _norm_pre_hook(self, _module, args):
        self._store["last"] = args[0]
        raise _StopForward

    # ------------------------------------------------------------------ capture
    def batches(self, sampler):
        """The loop draws straight from the sampler: a hooked capture runs when it is asked for."""
        return sampler

    @torch.no_grad()
    def capture(self, input_ids: torch.Tensor, position_ids: torch.Tensor, ticket=None) -> Captured:
        self._store.clear()
        first = self.devices[0]
        try:
            self.model(
                input_ids=input_ids.to(first),
                position_ids=position_ids.to(first),
                use_cache=False,
            )
        except _StopForward:
            pass
        else:  # pragma: no cover - a model whose forward skipped our stop point
            raise RuntimeError("target forward finished without reaching the capture stop point")
        aux = torch.cat([self._store[k].to(self.out_device) for k in self.aux_ids], dim=-1)
        last = self._store["last"].to(self.out_device) if self.need_last else None
        self._store.clear()
        return Captured(aux=aux, last=last)
