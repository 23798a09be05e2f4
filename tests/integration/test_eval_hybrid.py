"""Hybrid targets (Qwen3.5/3.6: Gated DeltaNet linear attention in 3 of every 4 layers, shipped as the
multimodal `Qwen3_5ForConditionalGeneration`), with a tiny one built on the spot (tests/families.py):

- the wrapper is read as its language model: its checkpoint holds `model.language_model.*` and
  `model.visual.*`, and neither the hooked source (training) nor the eval target builds or loads a
  vision weight;
- the rollback of a verify forward (trainer/eval/recurrent.py) leaves the cache exactly as a forward over
  the kept tokens alone would (1, 3 or 6 of a verify's tokens kept: the rollback after a partial
  acceptance).

The user's journey on this family (`dflash init` -> preflight -> `dflash train` (hooked) -> `dflash eval`
chain and tree, lossless -> export -> reload) is the family matrix's `qwen3.5` row
(tests/integration/test_families.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.families import build_qwen3_5_text, build_qwen3_5_vlm
from trainer.target.info import read_weight_headers

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> Path:
    return build_qwen3_5_vlm(tmp_path_factory.mktemp("qwen3_5") / "vlm")


@pytest.fixture(scope="module")
def text_target(tmp_path_factory) -> Path:
    return build_qwen3_5_text(tmp_path_factory.mktemp("qwen3_5") / "text")


def _language_numel(folder: Path, head: bool) -> int:
    tensors = read_weight_headers(folder).tensors
    keep = [n for n in tensors if n.startswith("model.language_model.") or (head and n == "lm_head.weight")]
    return sum(int(np.prod(tensors[n]["shape"])) for n in keep)


def test_the_vlm_wrapper_is_read_as_its_language_model(vlm, one_thread):
    from safetensors import safe_open

    from trainer.eval.models import HookedTarget
    from trainer.sources.hooked import HookedTransformersSource

    names = set(read_weight_headers(vlm).tensors)
    assert any(n.startswith("model.visual.") for n in names), "the fixture has no vision tower"
    assert any(n.startswith("model.language_model.layers.") for n in names)
    archs = json.loads((vlm / "config.json").read_text())["architectures"]
    assert archs == ["Qwen3_5ForConditionalGeneration"]

    target = HookedTarget(vlm, [1, 2], CPU)
    source = HookedTransformersSource(vlm, [1, 2], out_device=CPU)
    for model, head in ((target.model, True), (source.model, False)):
        params = dict(model.named_parameters())
        assert not [n for n in params if "visual" in n]
        assert not [m for m in model.modules() if "Vision" in type(m).__name__]
        assert sum(p.numel() for p in params.values()) == _language_numel(vlm, head)
    # the weights are the checkpoint's, not a fresh init
    with safe_open(str(vlm / "model.safetensors"), "pt") as f:
        stored = f.get_tensor("model.language_model.layers.0.linear_attn.in_proj_qkv.weight")
    assert torch.equal(source.model.layers[0].linear_attn.in_proj_qkv.weight, stored)
    assert torch.equal(target.base.layers[0].linear_attn.in_proj_qkv.weight, stored)
    assert target.hybrid and sorted(target.rollback.mixers) == [0, 1, 2]


def _states(cache) -> list[torch.Tensor]:
    out = []
    for layer in cache.layers:
        if hasattr(layer, "recurrent_states"):
            out += [layer.conv_states[0], layer.recurrent_states[0]]
        else:
            out += [layer.keys, layer.values]
    return out


@pytest.mark.parametrize("keep", [1, 3, 6])
def test_a_rollback_leaves_the_cache_a_forward_over_the_kept_tokens_would(text_target, keep, one_thread):
    from trainer.eval.models import HookedTarget

    target = HookedTarget(text_target, [1, 2], CPU)
    prompt = torch.tensor([[5, 17, 99, 300, 41, 8, 77]])
    block = torch.tensor([[12, 250, 3, 480, 66, 9]])
    _, _, cache = target.forward(prompt)
    greedy, _, cache = target.forward(block, cache)
    target.keep(cache, prompt.shape[1], keep, block.shape[1])
    _, _, fresh = target.forward(prompt)
    _, _, fresh = target.forward(block[:, :keep], fresh)
    assert cache.get_seq_length() == fresh.get_seq_length() == prompt.shape[1] + keep
    for got, want in zip(_states(cache), _states(fresh)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # and the next forward continues as after the kept tokens alone
    nxt = torch.tensor([[int(greedy[keep - 1])]])
    torch.testing.assert_close(target.forward(nxt, cache)[1], target.forward(nxt, fresh)[1])
