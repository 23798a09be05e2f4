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

from trainer.layout.eval_memory import device_map_fill, drafter_shapes, eval_drafter
from trainer.layout.hybrid import forward_working_bytes, transformers_state_bytes
from trainer.layout.recipe import (
    ASSUMPTIONS,
    GIB,
    PlanError,
    Recipe,
    TargetShape,
    is_thin,
    read_target,
    shapes,
)
from trainer.layout.split import tp_divides, vllm_gpu_bytes


def kv_bytes_per_token(t: TargetShape) -> int:
    """K and V of one token over the full-attention layers (a hybrid's linear layers keep none)."""
    return 2 * t.full_layers * t.kv_heads * t.head_dim * t.dtype_bytes


def harness_cache_bytes(t: TargetShape, tokens: int) -> int:
    """transformers' cache for one sequence of `tokens`: K/V per token of the full-attention layers and,
    for a hybrid target, the linear layers' conv and recurrent state (trainer/layout/hybrid.py)."""
    return tokens * kv_bytes_per_token(t) + transformers_state_bytes(t.linear, t.dtype_bytes)


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
        parts = vllm_gpu_bytes(t, tp, tokens, 0, sequences=a["inference_sequences"])
        parts = {k: v for k, v in parts.items() if k != "hidden_state_rows"}
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
                f"{t.weight_bytes / GIB:.1f} GiB target and the KV cache of "
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
    MLP working set (sizing's `target_mlp_copies`; a hybrid's Gated DeltaNet layer's when larger), the
    logits (fp32) and the CUDA reserve."""
    wb = t.dtype_bytes
    return (
        max(
            tokens * t.intermediate * ASSUMPTIONS["target_mlp_copies"] * wb,
            forward_working_bytes(t.linear, tokens, wb),
        )
        + tokens * t.vocab * 4
        + ASSUMPTIONS["runtime_reserve_gib_cuda"] * GIB
    )


def target_units(t: TargetShape) -> list[int]:
    """The target's bytes as `device_map` places them, unit by unit in load order: the embedding, each
    decoder layer (a no-split module), the final norm, the lm_head (none when tied)."""
    wb = t.dtype_bytes
    embed = t.vocab * t.hidden
    rest = max(0, t.params - embed * (1 if t.tied else 2) - t.hidden)
    units = [embed * wb] + [rest // t.layers * wb] * t.layers + [t.hidden * wb]
    return units + ([] if t.tied else [embed * wb])


def plan_harness(
    t: TargetShape,
    memory_gib: float,
    count: int,
    gpus: int | None = None,
    drafter: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The harness's target on one GPU, or spread by `device_map` over the fewest GPUs that hold it
    (`gpus`: that many, set by hand), with the drafter (trainer/layout/eval_memory.py `eval_drafter`:
    fp32 weights and its working set) on the first GPU, whose `max_memory` is lowered by that much."""
    tokens = ASSUMPTIONS["inference_tokens_per_sequence"]
    budget = memory_gib * GIB * ASSUMPTIONS["usable_share"]
    weights = t.weight_bytes
    kv = harness_cache_bytes(t, tokens)
    working = harness_working_bytes(t, tokens)
    d = (drafter["drafter_weights"] + drafter["drafter_working"]) if drafter else 0
    drafter_part = {} if not drafter else {"drafter": _drafter_summary(drafter)}
    if count < 1:
        return {"gpus": 0, "device_map": None, "max_memory_gib": None, "fits": True, "per_gpu_gib": None,
                "reason": "no GPU: the harness runs on the CPU", **drafter_part}  # fmt: skip
    units = target_units(t)
    sizes = [gpus] if gpus else list(range(1, count + 1))
    layouts = {n: _spread(units, n, budget, working, kv, d) for n in sizes}
    needs = {n: max(lay["needs"]) if lay else float("inf") for n, lay in layouts.items()}
    roomy = [n for n in sizes if needs[n] <= budget and not is_thin(needs[n], budget)]
    fitting = [n for n in sizes if needs[n] <= budget]
    said = f" + the drafter {d / GIB:.1f} GiB on GPU 0" if d else ""
    for n in roomy[:1] or fitting[:1] or ([gpus] if gpus and layouts[gpus] else []):
        need, lay = needs[n], layouts[n]
        caps = lay["caps"]
        return {
            "gpus": n,
            "device_map": "auto" if n > 1 else None,
            "max_memory_gib": {i: round(c / GIB, 2) for i, c in enumerate(caps)} if n > 1 else None,
            "fits": need <= budget,
            "per_gpu_gib": round(need / GIB, 1),
            "per_gpu_needs_gib": [round(x / GIB, 1) for x in lay["needs"]],
            **drafter_part,
            "reason": (
                f"{weights / GIB:.1f} GiB of weights + {kv / GIB:.1f} GiB KV cache "
                f"({tokens} tokens{_state(t)}) over "
                f"{n} GPU(s) + {working / GIB:.1f} GiB working set{said}: ~{need / GIB:.1f} GiB of "
                f"{budget / GIB:.1f} GiB on the fullest"
                + (
                    ""
                    if n == 1
                    else "; device_map auto, max_memory "
                    + ", ".join(f"{c / GIB:.1f}" for c in caps)
                    + " GiB per GPU for weights"
                )
                + ("" if need <= budget else "; DOES NOT FIT: expect out-of-memory")
            ),
        }
    lay = layouts[sizes[-1]]
    return {
        "gpus": None,
        "device_map": None,
        "max_memory_gib": None,
        "fits": False,
        "per_gpu_gib": round(max(lay["needs"]) / GIB, 1) if lay else None,
        **drafter_part,
        "reason": (
            f"even {sizes[-1]} GPUs do not hold the {weights / GIB:.1f} GiB target with its working set"
            + (f" and the {d / GIB:.1f} GiB drafter (fp32, on GPU 0)" if d else "")
        ),
    }


def _state(t: TargetShape) -> str:
    if t.linear is None:
        return ""
    state = transformers_state_bytes(t.linear, t.dtype_bytes)
    return (
        f"; {t.full_layers} full-attention layers, {t.linear.layers} linear-attention layers' "
        f"state {state / 2**20:.0f} MiB per sequence"
    )


def _drafter_summary(drafter: dict[str, Any]) -> dict[str, Any]:
    return {
        "weights_gib": round(drafter["drafter_weights"] / GIB, 2),
        "working_gib": round(drafter["drafter_working"] / GIB, 2),
        "dtype": drafter.get("dtype", "float32"),
        "layers": drafter.get("layers"),
        "gpu": 0,
    }


def _spread(
    units: list[int], n: int, budget: float, working: float, kv: float, drafter: float
) -> dict[str, Any] | None:
    """`n` GPUs holding the target as device_map places it, the drafter on GPU 0: each GPU's
    `max_memory` for weights and what each then holds; None when the weights do not all find a GPU."""
    weights = float(sum(units))
    if n == 1:
        return {"caps": [budget - working - kv - drafter], "needs": [weights + kv + working + drafter]}
    caps = [budget - working - kv / n - (drafter if i == 0 else 0) for i in range(n)]
    if caps[0] <= max(units):
        return None
    placed = device_map_fill(units, caps, max(units))
    if placed is None:
        return None
    needs = [p + kv * p / weights + working + (drafter if i == 0 else 0) for i, p in enumerate(placed)]
    return {"caps": caps, "needs": needs}


def plan_inference(t: TargetShape, memory_gib: float, count: int, r: Recipe | None = None) -> dict[str, Any]:
    """`dflash plan`'s section for eval and regeneration; the harness counts the recipe's drafter."""
    drafter = None
    if r is not None:
        drafter = eval_drafter(shapes(t, r), ASSUMPTIONS["inference_tokens_per_sequence"], r.block)
    return {
        "engine": plan_engine(t, memory_gib, count),
        "harness": plan_harness(t, memory_gib, count, drafter=drafter),
    }


def folder_drafter(t: TargetShape, folders: list[Path]) -> dict[str, Any] | None:
    """The largest of the drafters in `folders` as eval loads it (eval_memory.eval_drafter); None when
    none is a speculators folder whose config.json can be read (not counted: a converted format)."""
    base = shapes(t, Recipe(draft_layers=1, n_aux=5, block=8, anchors=1, tokens=1, optimizer="adamw"))
    found = [drafter_shapes(f, base) for f in folders]
    sizes = [eval_drafter(s, ASSUMPTIONS["inference_tokens_per_sequence"], b) for s, b in filter(None, found)]
    return max(sizes, key=lambda d: d["drafter_weights"] + d["drafter_working"], default=None)


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
    target_dir: Path,
    asked: int | None,
    device: str,
    gpus: tuple[int, float] | None = None,
    drafters: list[Path] | None = None,
) -> dict[str, Any]:
    """The keyword arguments the harness gives `from_pretrained` (empty: one device, as before) and
    why; `asked`: `--harness-gpus` (None: the plan's); `drafters`: the folders evaluated, the largest
    counted on GPU 0 beside the target. PlanError for more GPUs than are visible, or none that hold it."""
    count, memory = gpus if gpus is not None else visible_gpus()
    if device == "cpu" or count < 1:
        if asked not in (None, 1):
            raise PlanError(f"--harness-gpus {asked}: no GPU is in use (--device {device})")
        return {"load_kwargs": {}, "gpus": 0, "reason": "the CPU"}
    if asked is not None and asked > count:
        raise PlanError(f"--harness-gpus {asked}: more than the {count} GPU(s) this process sees")
    t = read_target(target_dir)
    plan = plan_harness(t, memory, count, asked, folder_drafter(t, list(drafters or [])))
    if plan["gpus"] is None:
        raise PlanError(
            f"the harness: {plan['reason']}: run it where more GPUs are visible, or --engine vllm "
            "(tensor parallelism, the drafter in the target's dtype)"
        )
    kwargs = {}
    if plan["device_map"]:
        kwargs = {
            "device_map": "auto",
            "max_memory": {i: f"{math.floor(g * 1024)}MiB" for i, g in plan["max_memory_gib"].items()},
        }
    return {"load_kwargs": kwargs, "gpus": plan["gpus"], "reason": plan["reason"]}
