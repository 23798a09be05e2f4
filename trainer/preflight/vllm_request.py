"""What a run's vLLM server is asked for (context length, layer ids, dtype), checked against the target
before anything starts: preflight reports the problems (`source_gate`), and the owned server's command
(`owned_server_command`) is built from the same `ServerRequest`, so the two never disagree.

The target's context limit is derived as vLLM 0.32 derives it (`vllm/config/model.py`
`_get_and_verify_max_len`, `model_arch_config_convertor.py` `derive_max_model_len_and_key`): the smallest
of the length keys of the (text) config, `model_max_length` taking precedence, times the RoPE scaling
factor of the rope types whose `max_position_embeddings` is not already scaled; a `model_max_length`
above that is allowed too, and `VLLM_ALLOW_LONG_MAX_MODEL_LEN` lifts the limit. A server whose
`--max-model-len` is above it refuses to load ("User-specified max_model_len ... is greater than the
derived max_model_len").
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trainer.layout.server_tap import longest_document, server_layer_ids
from trainer.target.info import TargetInfo, read_config

if TYPE_CHECKING:
    from trainer.config.run import RunConfig

# vLLM's keys for a model's context length, the smallest present wins (derive_max_model_len_and_key)
LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
# rope types whose max_position_embeddings is already the scaled length: their factor is not applied
SCALED_ROPE_TYPES = {"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"}
ALLOW_LONG_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"
# model types vLLM refuses in float16 (vllm/config/model.py _FLOAT16_NOT_SUPPORTED_MODELS)
FLOAT16_REFUSED = {"gemma2", "gemma3", "gemma3_text", "glm4"}


@dataclass(frozen=True)
class ContextLimit:
    """The longest --max-model-len vLLM loads the target with (None: no limit) and what sets it."""

    tokens: int | None
    why: str


def _rope_factor(conf: dict[str, Any]) -> tuple[float, str]:
    """The factor vLLM multiplies the derived length by, and its rope type ('' when 1)."""
    params = conf.get("rope_scaling") or conf.get("rope_parameters")  # transformers' precedence
    if not isinstance(params, dict) or not params:
        return 1.0, ""
    layers = list(params.values()) if all(isinstance(v, dict) for v in params.values()) else [params]
    factor, kind = 1.0, ""
    for p in (p for p in layers if isinstance(p, dict)):
        rope_type = str(p.get("rope_type") or p.get("type") or "default")
        if rope_type not in SCALED_ROPE_TYPES and p.get("factor") is not None:
            factor, kind = float(p["factor"]), rope_type
    return factor, kind


def context_limit(conf: dict[str, Any], environ: dict[str, str] | None = None) -> ContextLimit:
    """vLLM's limit on --max-model-len for a model config read by `read_config` (text_config merged)."""
    env = os.environ if environ is None else environ
    if env.get(ALLOW_LONG_ENV, "").strip().lower() in ("1", "true"):
        return ContextLimit(None, f"{ALLOW_LONG_ENV} is set")
    found = {k: conf[k] for k in LENGTH_KEYS if isinstance(conf.get(k), (int, float))}
    if not found:
        return ContextLimit(None, "the config names no context length")
    key = "model_max_length" if "model_max_length" in found else min(found, key=lambda k: found[k])
    factor, kind = (1.0, "") if "gemma3" in str(conf.get("model_type", "")) else _rope_factor(conf)
    tokens, why = int(found[key] * factor), f"{key} {found[key]:g}"
    if factor != 1.0:
        why += f" x rope factor {factor:g} ({kind})"
    mml = conf.get("model_max_length")
    if isinstance(mml, (int, float)) and mml > tokens:
        tokens, why = int(mml), f"model_max_length {mml:g}"
    return ContextLimit(tokens, why)


@dataclass(frozen=True)
class ServerRequest:
    """What the run's server is started with, and the problems that would make vLLM refuse it (or
    the source refuse the server) and the warnings: (code, message, fix), as preflight reports them.
    A target.vllm.max_model_len above the target's limit is capped to it when the run still fits."""

    max_model_len: int
    needed: int  # the run's longest document + 1 (its one generated token)
    limit: ContextLimit
    layer_ids: list[int]
    dtype: str
    problems: list[tuple[str, str, str]] = field(default_factory=list)
    warnings: list[tuple[str, str, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_model_len": self.max_model_len,
            "needed": self.needed,
            "limit": self.limit.tokens,
            "limit_from": self.limit.why,
            "layer_ids": self.layer_ids,
            "dtype": self.dtype,
        }


def server_dtype(cfg: RunConfig, cpu: bool, conf: dict[str, Any] | None = None) -> str:
    """target.dtype, auto: float32 on a host without CUDA (vLLM's CPU fp32 equals the hooked target's
    features) except for a Gated DeltaNet hybrid, which vLLM's CPU kernels run in bfloat16 only
    (trainer/preflight/vllm_family.py); bfloat16 on GPUs."""
    from trainer.preflight.vllm_family import engine_dtype

    if cfg.target.dtype != "auto":
        return cfg.target.dtype
    if cpu and engine_dtype(read_config(cfg.target.path) if conf is None else conf, "auto", cpu) != "auto":
        return "bfloat16"
    return "float32" if cpu else "bfloat16"


def server_request(cfg: RunConfig, cpu: bool, conf: dict[str, Any] | None = None) -> ServerRequest:
    """The run's server request, checked against the target's config.json (read here unless given)."""
    conf = read_config(cfg.target.path) if conf is None else conf
    info = TargetInfo.from_config(conf, cfg.target.path / "config.json")
    longest = longest_document(cfg)
    needed, chosen = longest + 1, cfg.target.vllm.max_model_len
    limit = context_limit(conf)
    capped = chosen is not None and limit.tokens is not None and chosen > limit.tokens >= needed
    req = ServerRequest(
        max_model_len=limit.tokens if capped else chosen or needed,
        needed=needed,
        limit=limit,
        layer_ids=server_layer_ids(cfg.drafter.aux_ids, info.num_layers),
        dtype=server_dtype(cfg, cpu, conf),
    )
    allows = f"the target allows {limit.tokens} ({limit.why})"
    if capped:
        req.warnings.append((
            "config.vllm_context_capped",
            f"target.vllm.max_model_len {chosen} is above what vLLM loads this target with ({allows}): "
            f"the server is started with {limit.tokens}, which holds the run's longest document",
            f"set target.vllm.max_model_len to <= {limit.tokens}, or null (the run's need, {needed})",
        ))  # fmt: skip
    if limit.tokens is not None and needed > limit.tokens:
        cut = limit.tokens - 1
        if cfg.data.max_length < cfg.train.max_tokens_per_batch:
            knob, value = "data.max_length", cfg.data.max_length
            fix = " (longer samples are dropped)"
        else:
            knob, value = "train.max_tokens_per_batch", cfg.train.max_tokens_per_batch
            fix = f" (longer samples are cut to it), or data.max_length to <= {cut} (they are dropped)"
        req.problems.append((
            "config.vllm_context_too_long",
            f"{knob} {value} needs max_model_len {needed} (the longest document + its one generated "
            f"token) but {allows}",
            f"lower {knob} to <= {cut}{fix}",
        ))  # fmt: skip
    if chosen is not None and chosen < needed <= (limit.tokens or needed):
        req.problems.append((
            "config.vllm_context_too_short",
            f"target.vllm.max_model_len {chosen} cannot hold the run's longest document ({longest} tokens, "
            "min(data.max_length, train.max_tokens_per_batch)) + its one generated token",
            f"raise target.vllm.max_model_len to >= {needed} or set it to null",
        ))  # fmt: skip
    model_type = str(conf.get("model_type", ""))
    if req.dtype == "float16" and model_type in FLOAT16_REFUSED:
        req.problems.append((
            "config.vllm_dtype",
            f"target.dtype float16: vLLM refuses float16 for model type {model_type} (numerical "
            "instability)",
            "set target.dtype to bfloat16, float32 or auto",
        ))  # fmt: skip
    return req
