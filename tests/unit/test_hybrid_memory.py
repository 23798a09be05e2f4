"""The planner's figures for hybrid targets (trainer/layout/hybrid.py): the Qwen3.6-27B fixture's numbers
against a hand computation, and the state bytes against what transformers' Qwen3_5 cache really holds
after a forward of a tiny model built on the spot."""

import json
import math
from pathlib import Path

import pytest
import torch._dynamo  # noqa: F401  (before any test imports ansible, whose sys.intern patch breaks it)

from trainer.layout.hybrid import forward_working_bytes, transformers_state_bytes, vllm_page
from trainer.layout.inference import harness_cache_bytes, kv_bytes_per_token, plan_inference
from trainer.layout.recipe import Recipe, per_gpu_bytes, read_target
from trainer.layout.split import tp_divides, vllm_gpu_bytes

QWEN = Path(__file__).resolve().parents[1] / "fixtures" / "targets" / "qwen3.6-27b"
GIB = 2**30


def test_the_fixture_counts_16_full_and_48_linear_layers():
    t = read_target(QWEN)
    la = t.linear
    assert (t.layers, t.full_layers, la.layers) == (64, 16, 48)
    heads = (la.key_heads, la.value_heads, la.key_head_dim, la.value_head_dim, la.conv_kernel)
    assert heads == (16, 48, 128, 128, 4)
    assert la.ssm_dtype == "float32" and la.conv_dim == 2 * 16 * 128 + 48 * 128 == 10240


def test_harness_cache_by_hand():
    """transformers: K+V per token of the 16 full layers only; per sequence, 48 x (conv bf16 + state fp32)."""
    t = read_target(QWEN)
    assert kv_bytes_per_token(t) == 2 * 16 * 4 * 256 * 2 == 65_536  # 64 layers would be 262,144
    per_layer = 10240 * 4 * 2 + 48 * 128 * 128 * 4  # conv_states (B, conv_dim, 4) bf16 + recurrent fp32
    assert per_layer == 3_227_648
    assert transformers_state_bytes(t.linear, 2) == 48 * per_layer == 154_927_104  # 147.75 MiB
    assert harness_cache_bytes(t, 4096) == 4096 * 65_536 + 154_927_104
    h = plan_inference(t, 80.0, 1)["harness"]
    assert h["gpus"] == 1 and "48 linear-attention layers' state 148 MiB per sequence" in h["reason"]


def test_vllm_cache_by_hand():
    """vLLM 0.32 at TP 1: a linear layer's page = conv (10240, 3) bf16 + temporal (48, 128, 128) fp32
    (mamba_ssm_dtype); the attention block the smallest multiple of 16 tokens whose page (4096 B a token
    a layer) holds it: 784 tokens; a 4096-token sequence takes 6 blocks x 16 full layers and 2 pages x 48
    linear layers (prefix caching's align mode)."""
    t = read_target(QWEN)
    state = 10240 * 3 * 2 + 48 * 128 * 128 * 4
    assert state == 3_207_168 and math.ceil(state / (16 * 4096)) * 16 == 784
    assert vllm_page(t.linear, 4096, 1, "bfloat16") == (784, 784 * 4096)
    per_sequence = (16 * math.ceil(4096 / 784) + 48 * 2) * 784 * 4096
    kv = vllm_gpu_bytes(t, 1, 16 * 4096, 0, sequences=16)["kv_cache"]
    assert kv == 16 * per_sequence == 9_865_003_008  # 9.19 GiB, not the 16 GiB of 64 KV layers
    engine = plan_inference(t, 80.0, 1)["engine"]
    assert engine["tensor_parallel_size"] == 1 and engine["per_gpu_breakdown_gib"]["kv_cache"] == 9.19
    # TP 4: KV heads 4 -> 1 a GPU, conv (2560, 3), temporal (12, 128, 128)
    state4 = 2560 * 3 * 2 + 12 * 128 * 128 * 4
    assert vllm_page(t.linear, 1024, 4, "bfloat16") == (784, 784 * 1024) and state4 <= 784 * 1024
    assert tp_divides(t, 8) and not tp_divides(t, 3)


def test_hooked_forward_counts_the_larger_layer_working_set():
    """No cache in the hooked forward: its transient set is the larger of an MLP's and a GDN layer's."""
    t = read_target(QWEN)
    tokens = 8192
    gdn = (tokens * (2 * 10240 + 2 * 48 * 128 + 2 * 6144) + tokens // 64 * 48 * 128 * 128) * 2
    assert forward_working_bytes(t.linear, tokens, 2) == gdn
    parts = per_gpu_bytes(t, 1, 1, Recipe(5, 5, 16, 512, tokens, optimizer="adamw"), "none")
    assert parts["target_forward"] == max(gdn, tokens * 17408 * 3 * 2)


@pytest.fixture(scope="module")
def tiny_qwen35(tmp_path_factory):
    """A tiny Qwen3_5 (the VLM wrapper's config saved as the planner reads it) and its text model."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen3_5Config, Qwen3_5ForCausalLM

    text = {
        "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 96, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 8, "linear_value_head_dim": 12, "linear_conv_kernel_dim": 4,
        "vocab_size": 128, "dtype": "bfloat16",
    }  # fmt: skip
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 64}
    folder = tmp_path_factory.mktemp("qwen35")
    Qwen3_5Config(text_config=text, vision_config=vision).save_pretrained(folder)
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5Config(text_config=text).text_config).to(torch.bfloat16).eval()
    return folder, model


def test_state_bytes_equal_what_transformers_cache_holds(tiny_qwen35):
    import torch

    folder, model = tiny_qwen35
    assert "text_config" in json.loads((folder / "config.json").read_text())
    t = read_target(folder)
    assert (t.full_layers, t.linear.layers) == (1, 3)  # transformers' default: every fourth layer full
    tokens = 11
    with torch.no_grad():
        out = model(input_ids=torch.arange(tokens)[None] % 128, use_cache=True)
    cache = out.past_key_values
    state, kv = 0, 0
    for layer in cache.layers:
        if hasattr(layer, "conv_states"):
            tensors = [layer.conv_states[0], layer.recurrent_states[0]]
            assert layer.conv_states[0].dtype == torch.bfloat16
            assert layer.recurrent_states[0].dtype == torch.float32
            state += sum(x.numel() * x.element_size() for x in tensors)
        else:
            kv += sum(x.numel() * x.element_size() for x in (layer.keys, layer.values))
    assert state == transformers_state_bytes(t.linear, 2) > 0
    assert kv == tokens * kv_bytes_per_token(t)
    assert harness_cache_bytes(t, tokens) == state + kv
