"""Hybrid targets (Qwen3.5 / Qwen3.6, Qwen3-Next: Gated DeltaNet linear attention beside full attention):
what their linear-attention layers hold. A full-attention layer keeps K and V per token; a linear one keeps,
per sequence, a conv state and a recurrent state whatever the length. Light side: stdlib only.

Read from the code that holds them:

- transformers 5.x (`cache_utils.LinearAttentionLayer`, `models/qwen3_5/modeling_qwen3_5.py`), the eval
  harness's cache: `conv_states` (batch, conv_dim, linear_conv_kernel_dim) in the model's dtype (the
  projected q/k/v it is cut from), conv_dim = 2 x key heads x key head dim + value heads x value head dim;
  `recurrent_states` (batch, value heads, key head dim, value head dim) in **float32** (the reference
  `torch_chunk_gated_delta_rule` computes in fp32; fla's `chunk_gated_delta_rule_fwd_h` allocates its final
  state `dtype=torch.float32` too). tests/unit/test_hybrid_memory.py measures both on a tiny model.
- The no-cache forward of the hooked source (`use_cache=False`): no state survives a layer; one GDN layer's
  transient set is its projections over the tokens (q/k/v mixed and convolved, q and k repeated to the
  value heads, z, the core output) in the model's dtype, plus fla's per-chunk states `h`
  (ceil(tokens / 64), value heads, key dim, value dim) in the model's dtype. Arithmetic, not measured on
  a GPU.
- vLLM 0.32 (`MambaStateShapeCalculator.gated_delta_net_state_shape`, `MambaStateDtypeCalculator`,
  `Platform._align_hybrid_block_size`, `MambaSpec.max_memory_usage_bytes`): per linear layer and sequence a
  conv state (conv_dim / tp, kernel - 1 + speculative tokens) in the model's dtype and a temporal state
  (value heads / tp, value dim, key dim) in the config's `mamba_ssm_dtype` (Qwen3_5's config hook; else
  the model's dtype); the attention block grows to the smallest multiple of 16 tokens whose page holds one
  linear layer's state, which is padded to that page; a sequence takes ceil(tokens / block) pages per
  full-attention layer and (2 + speculative tokens) pages per linear layer (mamba_cache_mode "align":
  prefix caching is on by default for hybrid models; 1 + speculative tokens with it off).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}
GDN_CHUNK = 64  # the chunk of fla's and transformers' chunked gated delta rule
RECURRENT_STATE_BYTES = 4  # transformers' recurrent_states: float32 (reference path and fla alike)
VLLM_BLOCK_ALIGNMENT = 16  # CacheConfig.DEFAULT_BLOCK_SIZE; FlashAttention's kernel block multiple
VLLM_STATE_PAGES = {"align": 2, "none": 1}  # per linear layer and sequence, plus one per speculative token
VLLM_MAMBA_CACHE_MODE = "align"  # prefix caching is on by default for hybrid models (vLLM 0.32)

ASSUMPTIONS: dict[str, Any] = {
    "linear_attention_state": (
        "per sequence and linear-attention layer: conv (conv_dim x kernel, model dtype) + recurrent "
        "(value heads x key dim x value dim, fp32) in transformers; vLLM pages (block alignment "
        f"{VLLM_BLOCK_ALIGNMENT}, {VLLM_STATE_PAGES[VLLM_MAMBA_CACHE_MODE]} per layer and sequence in "
        f"mamba_cache_mode {VLLM_MAMBA_CACHE_MODE})"
    ),
}


@dataclass(frozen=True)
class LinearAttention:
    """The linear-attention (Gated DeltaNet) layers of a hybrid target, from its (text) config."""

    layers: int
    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    ssm_dtype: str = ""  # text_config.mamba_ssm_dtype: vLLM's recurrent-state dtype ("": the model's)

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_heads * self.key_head_dim + self.value_heads * self.value_head_dim

    @property
    def value_dim(self) -> int:
        return self.value_heads * self.value_head_dim

    @property
    def recurrent_elements(self) -> int:
        return self.value_heads * self.key_head_dim * self.value_head_dim


def layer_types(conf: dict[str, Any]) -> list[str]:
    """The config's `layer_types`, or what transformers derives without it for the Gated DeltaNet families
    (every `full_attention_interval`-th layer full, default 4); [] for a model that names none."""
    types = conf.get("layer_types")
    if isinstance(types, list):
        return [str(t) for t in types]
    if "linear_num_value_heads" in conf and "num_hidden_layers" in conf:
        every = int(conf.get("full_attention_interval") or 4)
        n = int(conf["num_hidden_layers"])
        return ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    return []


def read_linear_attention(conf: dict[str, Any]) -> LinearAttention | None:
    """The linear-attention layers of a config read by trainer/target/info.py (text_config merged); None for a
    model without any. Defaults are transformers' Qwen3_5TextConfig's."""
    n = sum(1 for t in layer_types(conf) if t == "linear_attention")
    if not n:
        return None
    return LinearAttention(
        layers=n,
        key_heads=int(conf.get("linear_num_key_heads") or 16),
        value_heads=int(conf.get("linear_num_value_heads") or 32),
        key_head_dim=int(conf.get("linear_key_head_dim") or 128),
        value_head_dim=int(conf.get("linear_value_head_dim") or 128),
        conv_kernel=int(conf.get("linear_conv_kernel_dim") or 4),
        ssm_dtype=str(conf.get("mamba_ssm_dtype") or ""),
    )


def transformers_state_bytes(la: LinearAttention | None, dtype_bytes: int) -> int:
    """One sequence's linear-attention state in transformers' cache, all linear layers together."""
    if la is None:
        return 0
    conv = la.conv_dim * la.conv_kernel * dtype_bytes
    return la.layers * (conv + la.recurrent_elements * RECURRENT_STATE_BYTES)


def forward_working_bytes(la: LinearAttention | None, tokens: int, dtype_bytes: int) -> int:
    """One GDN layer's transient working set in a no-grad forward over `tokens` positions (module
    docstring): the mixed and convolved q/k/v, q and k repeated to the value heads, z and the core
    output, and fla's per-chunk states."""
    if la is None:
        return 0
    repeated = 2 * la.value_heads * la.key_head_dim
    per_token = 2 * la.conv_dim + repeated + 2 * la.value_dim
    chunks = math.ceil(tokens / GDN_CHUNK) * la.recurrent_elements
    return (tokens * per_token + chunks) * dtype_bytes


def vllm_page(
    la: LinearAttention, kv_bytes_per_token_layer: int, tp: int, dtype: str, speculative: int = 0
) -> tuple[int, int]:
    """(attention block size in tokens, page bytes) of vLLM's hybrid cache at tensor parallel `tp`:
    `kv_bytes_per_token_layer` is one full-attention layer's K+V for one token on one GPU."""
    wb = DTYPE_BYTES[dtype]
    ssm = DTYPE_BYTES[la.ssm_dtype] if la.ssm_dtype in DTYPE_BYTES else wb
    conv = la.conv_dim // tp * (la.conv_kernel - 1 + speculative) * wb
    state = conv + la.value_heads // tp * la.value_head_dim * la.key_head_dim * ssm
    a = VLLM_BLOCK_ALIGNMENT
    block = max(a, a * math.ceil(state / (a * kv_bytes_per_token_layer)))
    return block, block * kv_bytes_per_token_layer


def vllm_cache_bytes(
    la: LinearAttention,
    full_layers: int,
    kv_bytes_per_token_layer: int,
    tp: int,
    dtype: str,
    sequences: int,
    tokens_per_sequence: int,
    speculative: int = 0,
) -> int:
    """What vLLM's cache takes on one GPU for `sequences` of `tokens_per_sequence` tokens (module
    docstring): whole blocks per full-attention layer, state pages per linear layer."""
    block, page = vllm_page(la, kv_bytes_per_token_layer, tp, dtype, speculative)
    attention = full_layers * math.ceil(tokens_per_sequence / block)
    states = la.layers * (VLLM_STATE_PAGES[VLLM_MAMBA_CACHE_MODE] + speculative)
    return sequences * (attention + states) * page


def tp_divides_linear(la: LinearAttention | None, tp: int) -> bool:
    """vLLM shards the key and value heads of the linear layers `tp` ways (`divide` asserts it)."""
    return la is None or (la.key_heads % tp == 0 and la.value_heads % tp == 0)
