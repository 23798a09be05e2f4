"""How a node's GPUs hold the target for inference: `dflash eval` (the harness and `--engine vllm|both`)
and `dflash regenerate --backend vllm`. `dflash plan` reports it beside the training layout; eval and
regenerate plan the same way on the GPUs they see, and a flag overrides the choice. Light side: stdlib
only (torch only inside `visible_gpus`).

- vLLM's offline engine (trainer/vllm_engine.py): the smallest tensor-parallel size (of
  `vllm_tensor_parallel_sizes`, one that vLLM can shard the heads by: `split.tp_divides`) whose GPU
  holds, outside the thin margin (recipe's `is_thin`), its weight share, the KV cache of
  `inference_sequences` sequences of `inference_tokens_per_sequence` tokens and the runtime reserve
  (`split.vllm_gpu_bytes`, the training split's server model) within vLLM's `gpu_memory_utilization`
  (0.92: `vllm.LLM`'s default in vLLM 0.32, which the project does not change).
- The harness (transformers, trainer/eval/models.py): the whole target on one GPU when weights, one
  sequence's KV cache and the forward's working set (sizing's `target_mlp_copies`, the logits, the
  CUDA reserve) fit the `usable_share` budget; else the fewest GPUs over which `device_map="auto"`
  spreads the layers, `max_memory` per GPU = the budget less the working set and that GPU's share of
  the KV cache (accelerate places weights only).

A size that does not divide the heads or exceeds the GPUs is refused (PlanError, exit 2) before any
model loads.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from trainer.layout.recipe import (
    ASSUMPTIONS,
    DTYPE_BYTES,
    GIB,
    PlanError,
    TargetShape,
    is_thin,
    read_target,
)
from trainer.layout.split import tp_divides, vllm_gpu_bytes


def kv_bytes_per_token(t: TargetShape) -> int:
    return 2 * t.layers * t.kv_heads * t.head_dim * DTYPE_BYTES[t.dtype]


def plan_engine(t: TargetShape, memory_gib: float, count: int) -> dict[str, Any]:
    """vLLM's tensor-parallel size for eval and regeneration on `count` GPUs of `memory_gib`."""
    a = ASSUMPTIONS
    tokens = a["inference_sequences"] * a["inference_tokens_per_sequence"]
    budget = memory_gib * GIB * a["offline_engine_gpu_memory_utilization"]
    if count < 1:
        return {"tensor_parallel_size": 1, "fits": True, "per_gpu_gib": None, "tried": [],
                "reason": "no GPU: vLLM's CPU engine, tensor parallel size 1"}  # fmt: skip
    tried, fitting = [], []
    for tp in a["vllm_tensor_parallel_sizes"]:
        if tp > count or not tp_divides(t, tp):
            continue
        parts = {k: v for k, v in vllm_gpu_bytes(t, tp, tokens, 0).items() if k != "hidden_state_rows"}
        need = sum(parts.values())
        tried.append({"tensor_parallel_size": tp, "per_gpu_gib": round(need / GIB, 1)})
        if need <= budget:
            fitting.append((tp, parts, need))
    # the smallest size outside the thin margin, else the smallest that fits at all
    for tp, parts, need in [f for f in fitting if not is_thin(f[2], budget)][:1] or fitting[:1]:
        thin = [
            f"; TP {f[0]} would fill ~{f[2] / GIB:.1f} GiB: within the thin margin"
            for f in fitting
            if f[0] < tp
        ]
        return {
            "tensor_parallel_size": tp,
            "fits": True,
            "per_gpu_gib": round(need / GIB, 1),
            "per_gpu_breakdown_gib": {k: round(v / GIB, 2) for k, v in parts.items()},
            "tried": tried,
            "reason": (
                f"TP {tp}: the smallest size whose GPU holds, with room, its share of the "
                f"{t.params * DTYPE_BYTES[t.dtype] / GIB:.1f} GiB target and the KV cache of "
                f"{a['inference_sequences']} x {a['inference_tokens_per_sequence']} tokens, "
                f"~{need / GIB:.1f} GiB of {budget / GIB:.1f} GiB "
                f"(gpu_memory_utilization {a['offline_engine_gpu_memory_utilization']})" + "".join(thin)
            ),
        }
    return {
        "tensor_parallel_size": None,
        "fits": False,
        "per_gpu_gib": tried[-1]["per_gpu_gib"] if tried else None,
        "tried": tried,
        "reason": (
            f"no tensor-parallel size up to {count} GPU(s) that divides the {t.heads} attention heads holds "
            f"the target in {budget / GIB:.1f} GiB per GPU"
        ),
    }


def harness_working_bytes(t: TargetShape, tokens: int) -> float:
    """What one harness forward over `tokens` positions holds beyond the weights and the KV cache: the
    MLP working set (sizing's `target_mlp_copies`), the logits (fp32) and the CUDA reserve."""
    wb = DTYPE_BYTES[t.dtype]
    return (
        tokens * t.intermediate * ASSUMPTIONS["target_mlp_copies"] * wb
        + tokens * t.vocab * 4
        + ASSUMPTIONS["runtime_reserve_gib_cuda"] * GIB
    )


def plan_harness(t: TargetShape, memory_gib: float, count: int, gpus: int | None = None) -> dict[str, Any]:
    """The harness's target on one GPU, or spread by `device_map` over the fewest GPUs that hold it
    (`gpus`: that many, set by hand)."""
    tokens = ASSUMPTIONS["inference_tokens_per_sequence"]
    budget = memory_gib * GIB * ASSUMPTIONS["usable_share"]
    weights = t.params * DTYPE_BYTES[t.dtype]
    kv = tokens * kv_bytes_per_token(t)
    working = harness_working_bytes(t, tokens)
    if count < 1:
        return {"gpus": 0, "device_map": None, "max_memory_gib": None, "fits": True, "per_gpu_gib": None,
                "reason": "no GPU: the harness runs on the CPU"}  # fmt: skip
    sizes = [gpus] if gpus else list(range(1, count + 1))
    needs = {n: (weights + kv) / n + working for n in sizes}
    # the fewest GPUs outside the thin margin, else the fewest that fit at all
    roomy = [n for n in sizes if needs[n] <= budget and not is_thin(needs[n], budget)]
    for n in roomy[:1] or sizes:
        need = needs[n]
        if need <= budget or gpus:
            share = round((budget - working - kv / n) / GIB, 2)
            return {
                "gpus": n,
                "device_map": "auto" if n > 1 else None,
                "max_memory_gib": {i: share for i in range(n)} if n > 1 else None,
                "fits": need <= budget,
                "per_gpu_gib": round(need / GIB, 1),
                "reason": (
                    f"{weights / GIB:.1f} GiB of weights + {kv / GIB:.1f} GiB KV cache "
                    f"({tokens} tokens) over {n} GPU(s) + {working / GIB:.1f} GiB working set: "
                    f"~{need / GIB:.1f} GiB of {budget / GIB:.1f} GiB each"
                    + ("" if n == 1 else f"; device_map auto, max_memory {share} GiB per GPU for weights")
                    + ("" if need <= budget else "; DOES NOT FIT: expect out-of-memory")
                ),
            }
    return {
        "gpus": None,
        "device_map": None,
        "max_memory_gib": None,
        "fits": False,
        "per_gpu_gib": round(((weights + kv) / count + working) / GIB, 1),
        "reason": f"even {count} GPUs do not hold the {weights / GIB:.1f} GiB target with its working set",
    }


def plan_inference(t: TargetShape, memory_gib: float, count: int) -> dict[str, Any]:
    """`dflash plan`'s section for eval and regeneration."""
    return {"engine": plan_engine(t, memory_gib, count), "harness": plan_harness(t, memory_gib, count)}


def visible_gpus() -> tuple[int, float]:
    """(count, memory GiB of the smallest) of the CUDA devices this process sees; (0, 0.0) without."""
    import torch

    if not torch.cuda.is_available():
        return 0, 0.0
    n = torch.cuda.device_count()
    return n, min(torch.cuda.get_device_properties(i).total_memory for i in range(n)) / GIB


def resolve_engine_tp(
    target_dir: Path, asked: int | None, flag: str, gpus: tuple[int, float] | None = None
) -> tuple[int, str]:
    """The engine's tensor-parallel size for `target_dir` (`asked`: the flag's value, None: the plan's)
    and why; PlanError for a size vLLM cannot use here. `gpus`: (count, GiB), default the visible ones."""
    count, memory = gpus if gpus is not None else visible_gpus()
    if count < 1:
        if asked not in (None, 1):
            raise PlanError(f"{flag} {asked}: no GPU is in use (vLLM's CPU engine runs unsharded here)")
        return 1, "no GPU: vLLM's CPU engine"
    t = read_target(target_dir)
    if asked is not None:
        if asked > count:
            raise PlanError(f"{flag} {asked}: more than the {count} GPU(s) this process sees")
        if not tp_divides(t, asked):
            raise PlanError(
                f"{flag} {asked}: vLLM cannot shard {t.heads} attention heads ({t.kv_heads} KV heads) "
                f"{asked} ways; use one of "
                + ", ".join(str(k) for k in range(1, count + 1) if tp_divides(t, k))
            )
        return asked, f"{flag} {asked}, set by hand"
    plan = plan_engine(t, memory, count)
    if not plan["fits"]:
        raise PlanError(f"{flag}: {plan['reason']}")
    return plan["tensor_parallel_size"], plan["reason"]


def resolve_harness(
    target_dir: Path, asked: int | None, device: str, gpus: tuple[int, float] | None = None
) -> dict[str, Any]:
    """The keyword arguments the harness gives `from_pretrained` (empty: one device, as before) and
    why; `asked`: `--harness-gpus` (None: the plan's). PlanError for more GPUs than are visible."""
    count, memory = gpus if gpus is not None else visible_gpus()
    if device == "cpu" or count < 1:
        if asked not in (None, 1):
            raise PlanError(f"--harness-gpus {asked}: no GPU is in use (--device {device})")
        return {"load_kwargs": {}, "gpus": 0, "reason": "the CPU"}
    if asked is not None and asked > count:
        raise PlanError(f"--harness-gpus {asked}: more than the {count} GPU(s) this process sees")
    plan = plan_harness(read_target(target_dir), memory, count, asked)
    if plan["gpus"] is None:
        raise PlanError(f"the harness: {plan['reason']} (--engine vllm shards it with tensor parallelism)")
    kwargs = {}
    if plan["device_map"]:
        kwargs = {
            "device_map": "auto",
            "max_memory": {i: f"{math.floor(g * 1024)}MiB" for i, g in plan["max_memory_gib"].items()},
        }
    return {"load_kwargs": kwargs, "gpus": plan["gpus"], "reason": plan["reason"]}
