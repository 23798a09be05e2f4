"""What `dflash plan` weighs: the target's shapes, the run's recipe, the plan's assumptions, and the one
fit test every layout uses (the lightest `train.shard` level whose estimate fits a budget). The bytes
themselves come from `trainer/layout/sizing.py`, the memory model `dflash preflight` uses too.
Light side: stdlib only.

Every assumption is a named constant, echoed in `dflash plan --json` under `assumptions`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from trainer.errors import DflashError
from trainer.layout.hybrid import ASSUMPTIONS as HYBRID_ASSUMPTIONS
from trainer.layout.hybrid import LinearAttention
from trainer.layout.sizing import ASSUMPTIONS as SIZING_ASSUMPTIONS
from trainer.layout.sizing import Shapes, per_device_bytes
from trainer.target.info import ModelConfigError, TargetInfo, read_config, stored_bytes

GIB = float(2**30)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8": 1}

ASSUMPTIONS = {
    "usable_share": 0.92,  # of a GPU's memory the estimate may fill (fragmentation, NCCL buffers)
    "thin_margin_share": 0.97,  # a fit above this share of the budget is flagged as thin
    "memory_model": "trainer/layout/sizing.py",
    **SIZING_ASSUMPTIONS,
    **HYBRID_ASSUMPTIONS,
    # train.shard unset (--shard auto): the lightest that fits, outside the thin margin
    "shard_auto_order": ["optimizer", "full"],
    "share_target_embedding": True,  # the key's default: the drafter reads its target copy's embedding
    "mfu": 0.35,  # model FLOPs utilisation of the target forward (bf16)
    # --source vllm (target.source: vllm): a vLLM server on k GPUs (TP t x DP r) holds the target
    "vllm_gpu_memory_utilization": 0.85,  # target.vllm.gpu_memory_utilization's default
    "vllm_runtime_gib": 3.0,  # per server GPU: CUDA context, eager prefill activations, workspaces
    "vllm_tensor_parallel_sizes": [1, 2, 4, 8],  # a size must also divide the attention heads
    # KV cache the server must have room for: one batch of every trainer rank at once (the requests
    # prefetched beyond that wait in vLLM's queue; a smaller cache costs throughput, not a crash)
    "vllm_kv_batches_per_rank": 1,
    "drafter_compute_share": 0.25,  # drafter forward+backward time relative to the target forward
    # eval and regeneration (trainer/layout/inference.py): vLLM's offline engine and the harness
    "offline_engine_gpu_memory_utilization": 0.92,  # vllm.LLM's default (vLLM 0.32), left as it is
    "inference_sequences": 16,  # sequences the engine's KV cache holds at once (regenerate's --batch-size)
    "inference_tokens_per_sequence": 4096,  # prompt + response, planned
}

AUTO_SHARD_ORDER = tuple(ASSUMPTIONS["shard_auto_order"])


class PlanError(DflashError, ValueError):
    """Bad plan input (unknown GPU, unreadable config); the message says what to pass."""


@dataclass(frozen=True)
class TargetShape:
    hidden: int
    layers: int
    vocab: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    params: int
    params_source: str
    dtype: str
    linear: LinearAttention | None = None  # a hybrid's linear-attention layers (layout/hybrid.py)

    @property
    def full_layers(self) -> int:
        """The layers that keep K and V per token (all but the linear-attention ones)."""
        return self.layers - (self.linear.layers if self.linear else 0)

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one weight (or K/V value) in the target's dtype."""
        return DTYPE_BYTES[self.dtype]

    @property
    def weight_bytes(self) -> int:
        """The target's weights in its dtype."""
        return self.params * self.dtype_bytes


def read_target(config_path: Path, dtype: str = "bfloat16") -> TargetShape:
    """The target's shapes from its config.json (or the folder holding it), read by trainer/target/info.py.
    Its parameter count comes from `model.safetensors.index.json`'s `metadata.total_size` when that file
    sits beside it, else from safetensors headers, else from the config's shapes."""
    config_path = Path(config_path)
    if config_path.is_dir():
        config_path = config_path / "config.json"
    if not config_path.is_file():
        raise PlanError(f"target config {config_path} does not exist (pass the target's config.json)")
    try:
        info = TargetInfo.from_config(read_config(config_path), config_path)
    except ModelConfigError as exc:
        raise PlanError(str(exc)) from None
    if dtype not in DTYPE_BYTES:
        raise PlanError(f"dtype {dtype!r}: use one of {', '.join(DTYPE_BYTES)}")
    # the weights beside a config.json (its model folder); a copy under another name stands alone
    stored = stored_bytes(config_path.parent) if config_path.name == "config.json" else None
    if stored is not None:
        nbytes, source = stored
        params = nbytes // DTYPE_BYTES.get(info.stored_dtype, 2)
    else:
        # the one formula (trainer/layout/sizing.py), without attention biases as in every plan estimate
        params = replace(info, attention_bias=False).config_params
        source = "estimated from config.json shapes (dense attention + gated MLP per layer)"
    return TargetShape(
        info.hidden,
        info.num_layers,
        info.vocab,
        info.intermediate,
        info.heads,
        info.kv_heads,
        info.head_dim,
        info.tied_embeddings,
        int(params),
        source,
        dtype,
        info.linear,
    )


def train_default(key: str) -> Any:
    """The run config's default of `train.<key>` (trainer/config/train.py, its one home; pydantic, no
    torch, imported only when asked)."""
    from trainer.config.train import TrainConfig

    return TrainConfig.model_fields[key].get_default(call_default_factory=True)


@dataclass(frozen=True)
class Recipe:
    """The run's shape as the memory model needs it (the run config's keys, or `dflash plan`'s flags).
    `shard` None: the plan picks the lightest `train.shard` level that fits (`AUTO_SHARD_ORDER`)."""

    draft_layers: int
    n_aux: int
    block: int
    anchors: int
    tokens: int
    loss_chunk_rows: int = 0
    shard: str | None = None
    activation_checkpointing: bool = False
    draft_vocab: int | None = None  # drafter.draft_vocab_size
    optimizer: str = field(default_factory=lambda: train_default("optimizer"))  # train.optimizer
    draft_intermediate: int | None = None  # drafter.intermediate_size (None: the target's)
    share_embedding: bool = ASSUMPTIONS["share_target_embedding"]  # train.share_target_embedding
    activation_bytes: int | None = None  # 4 with train.precision float32 (None: bf16 autocast)
    dense_attention: bool | None = None  # drafter.attn_implementation sdpa/eager (None: flex on CUDA)
    vllm_memory_share: float = ASSUMPTIONS["vllm_gpu_memory_utilization"]  # target.vllm's key


def shapes(t: TargetShape, r: Recipe) -> Shapes:
    return Shapes.of(
        t,
        t.params,
        DTYPE_BYTES[t.dtype],
        draft_layers=r.draft_layers,
        draft_intermediate=r.draft_intermediate,
        n_aux=r.n_aux,
        draft_vocab=r.draft_vocab,
    )


def per_gpu_bytes(
    t: TargetShape, n: int, dp: int, r: Recipe, shard: str, target_in_process: bool = True
) -> dict[str, float]:
    return per_device_bytes(
        shapes(t, r),
        gpus_per_copy=n,
        data_parallel=dp,
        tokens=r.tokens,
        anchors=r.anchors,
        block=r.block,
        device="cuda",
        shard=shard,
        activation_bytes=r.activation_bytes,
        loss_chunk_rows=r.loss_chunk_rows,
        activation_checkpointing=r.activation_checkpointing,
        optimizer=r.optimizer,
        share_embedding=r.share_embedding,
        target_in_process=target_in_process,
        dense_attention=r.dense_attention,
    )


def largest_parts(parts: dict[str, float]) -> str:
    big = sorted(parts.items(), key=lambda kv: -kv[1])[:3]
    return ", ".join(f"{k} {v / GIB:.1f} GiB" for k, v in big)


def shard_levels(r: Recipe, dp: int) -> tuple[str, ...]:
    """The train.shard levels to try at data-parallel width `dp`, lightest first."""
    if r.shard is not None:
        return (r.shard,)
    return AUTO_SHARD_ORDER if dp > 1 else ("none",)  # one rank per copy set: nothing to shard over


class LevelFit(NamedTuple):
    """The train.shard level `lightest_level` chose, what it needs, and every level it tried."""

    shard: str
    parts: dict[str, float]
    need: float
    thin: bool  # it fits, but above `thin_margin_share` of the budget
    tried: list[tuple[str, float]]  # (level, need) in the order tried


def is_thin(need: float, budget: float) -> bool:
    """A fit above `thin_margin_share` of the budget: too close to the model's error to trust."""
    return need <= budget and need > ASSUMPTIONS["thin_margin_share"] * budget


def lightest_level(
    levels: tuple[str, ...], parts_of: Callable[[str], dict[str, float]], budget: float
) -> LevelFit:
    """The lightest train.shard level whose estimate fits outside the thin margin; else the lightest that
    fits at all; else the heaviest tried."""
    tried, chosen = [], None
    for shard in levels:
        parts = parts_of(shard)
        need = sum(parts.values())
        tried.append((shard, need))
        if need <= budget and not is_thin(need, budget):
            return LevelFit(shard, parts, need, False, tried)
        if need <= budget and chosen is None:
            chosen = (shard, parts, need)
    shard, parts, need = chosen or (shard, parts, need)
    return LevelFit(shard, parts, need, is_thin(need, budget), tried)


def describe(t: TargetShape) -> dict[str, Any]:
    return {
        "params": t.params,
        "params_source": t.params_source,
        "hidden": t.hidden,
        "layers": t.layers,
        **({"linear_attention_layers": t.linear.layers} if t.linear else {}),
        "vocab": t.vocab,
        "dtype": t.dtype,
    }
