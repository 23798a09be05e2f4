"""Rolling back a hybrid target's cache after a rejected draft (heavy side).

A hybrid target (Qwen3.5/3.6, Qwen3-Next: three of every four layers Gated DeltaNet linear attention)
keeps, per linear-attention layer, a conv state (the last `conv_kernel` inputs of its causal conv) and a
recurrent state (one [heads, d_k, d_v] matrix), not a KV entry per token. A verify forward over
`[anchor, drafts]` advances those states past every draft; when only the first `keep` tokens are
accepted the states must be those after `keep` tokens, and transformers cannot crop them
(`LinearAttentionCacheLayerMixin.crop`: the recurrent state is a sum over every token, and its torch
rules, `torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule`, return the final state
only, no state per token).

What this module does, per verify forward on a cache (`arm` before it, `rollback` after it):
1. snapshot each linear-attention layer's conv and recurrent states (a copy of a few MB per layer on a
   27B target: 48 x 0.8 M fp32/bf16 elements), and record the input each linear-attention mixer
   receives in the forward (a forward pre-hook: [1, n, hidden] per layer);
2. after the verify, when `keep < n`: the attention layers' KV are cropped to the kept positions, the
   linear layers' states are restored from the snapshot, and **only the linear-attention mixers** are
   run again, each on its own recorded input's first `keep` rows, from the restored state: that is
   exactly what those mixers computed (causally) for the kept tokens, so the states come out as a
   forward over the kept tokens alone would leave them. Nothing else is recomputed: no attention
   layer, no MLP, no norm, no head; the mixers' outputs are thrown away.
   When every token is kept (`keep == n`) nothing is re-run.

Why this and not the alternatives (measured in docs/evaluate.md, "Hybrid targets"):
- re-running the whole target over the kept prefix costs a second forward of `keep` tokens per round
  (every weight read again); the mixers are a fraction of it (their projections, not the MLPs);
- a verify forward token by token through the linear layers costs n sequential steps per layer;
- keeping a state per token inside the forward needs the gated delta rule rewritten (the torch
  reference and the fla kernels return only the final state): a second implementation to keep equal
  to transformers'. Re-running the mixers uses transformers' own module code and kernels, whatever
  they are (torch reference on CPU, fla / causal-conv1d on CUDA), so the states are the ones the
  model itself would compute.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

RERUN_OWN = ("hidden_states", "cache_params", "attention_mask")  # the re-run's own arguments


class RollbackError(RuntimeError):
    """A cache layer this module cannot roll back (a layer kind it does not know)."""


def linear_mixers(model: nn.Module) -> dict[int, nn.Module]:
    """The linear-attention (state-space) mixers of `model` by decoder layer index: modules with an int
    `layer_idx` whose forward takes `cache_params` (transformers' convention for Gated DeltaNet, Mamba
    and conv mixers, which keep conv/recurrent states in the cache). Empty for a dense target."""
    out: dict[int, nn.Module] = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and "cache_params" in inspect.signature(module.forward).parameters:
            out[idx] = module
    return out


def _is_linear_layer(layer) -> bool:
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    return isinstance(layer, LinearAttentionCacheLayerMixin)


def _is_attention_layer(layer) -> bool:
    from transformers.cache_utils import CacheLayerMixin

    return isinstance(layer, CacheLayerMixin)


class RecurrentRollback:
    """Snapshot/restore of a hybrid target's linear-attention states around a verify forward (module
    doc). `mixers`: linear_mixers(model)."""

    def __init__(self, mixers: dict[int, nn.Module]):
        self.mixers = mixers
        self._armed = False
        self._inputs: dict[int, tuple[torch.Tensor, dict]] = {}
        self._snap: dict[int, tuple[dict, dict]] = {}
        for idx, module in mixers.items():
            module.register_forward_pre_hook(self._recorder(idx), with_kwargs=True)

    def _recorder(self, idx: int):
        def hook(_module, args, kwargs):
            if self._armed:
                x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                self._inputs[idx] = (x, kwargs)

        return hook

    def arm(self, cache) -> None:
        """Before a forward continuing `cache` (None: a fresh one, nothing to roll back to)."""
        self._inputs.clear()
        self._snap.clear()
        self._armed = cache is not None
        if cache is None:
            return
        for i, layer in enumerate(cache.layers):
            if not _is_linear_layer(layer):
                continue
            if i not in self.mixers or _is_attention_layer(layer):  # LinearAttentionAndFullAttentionLayer
                raise RollbackError(
                    f"cache layer {i} ({type(layer).__name__}): a linear-attention layer this harness cannot "
                    "roll back (no mixer of that layer index, or one cache layer holding both kinds)"
                )
            conv = {k: v.clone() for k, v in layer.conv_states.items() if v is not None}
            rec = {k: v.clone() for k, v in layer.recurrent_states.items() if v is not None}
            self._snap[i] = (conv, rec)

    @torch.no_grad()
    def rollback(self, cache, past: int, keep: int, forwarded: int) -> None:
        """After the armed forward of `forwarded` tokens at positions past..past+forwarded-1: keep the
        first `keep` of them in every layer of `cache`."""
        self._armed = False
        drop = forwarded - keep
        if drop > 0:
            for i, layer in enumerate(cache.layers):
                if i in self._snap:
                    continue
                if _is_linear_layer(layer):
                    raise RollbackError(f"cache layer {i} ({type(layer).__name__}) cannot be rolled back")
                if layer.get_seq_length() > past + keep:
                    layer.crop(-(layer.get_seq_length() - past - keep))
            for i, (conv, rec) in self._snap.items():
                layer = cache.layers[i]
                for k, v in conv.items():
                    layer.conv_states[k].copy_(v)
                for k, v in rec.items():
                    layer.recurrent_states[k].copy_(v)
                x, kwargs = self._inputs[i]
                rest = {k: v for k, v in kwargs.items() if k not in RERUN_OWN}
                mask = kwargs.get("attention_mask")
                if isinstance(mask, torch.Tensor) and mask.dim() == 2:
                    mask = mask[:, :keep]
                self.mixers[i](hidden_states=x[:, :keep], cache_params=cache, attention_mask=mask, **rest)
        self._inputs.clear()
        self._snap.clear()
