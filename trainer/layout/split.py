"""The vLLM split (`target.source: vllm`): a vLLM server on k = TP x DP GPUs holds the target and streams
hidden states; the node's other GPUs each run one trainer rank with no target in process. Light side:
stdlib only.
"""

from __future__ import annotations

import math
from typing import Any

from trainer.layout.hybrid import tp_divides_linear, vllm_cache_bytes
from trainer.layout.recipe import (
    ASSUMPTIONS,
    GIB,
    Recipe,
    TargetShape,
    lightest_level,
    per_gpu_bytes,
    shard_levels,
)


def tp_divides(t: TargetShape, tp: int) -> bool:
    """Whether vLLM can shard the target `tp` ways: the attention heads split evenly
    (vllm/config/model.py: "must be divisible by tensor parallel size") and the KV heads either split
    evenly or are replicated a whole number of times (its QKVParallelLinear); a hybrid's linear-attention
    key and value heads split evenly (trainer/layout/hybrid.py)."""
    return (
        tp >= 1
        and t.heads % tp == 0
        and (t.kv_heads % tp == 0 or tp % t.kv_heads == 0)
        and tp_divides_linear(t.linear, tp)
    )


def vllm_gpu_bytes(
    t: TargetShape, tp: int, tokens_in_flight: int, n_aux: int, sequences: int | None = None
) -> dict[str, float]:
    """Bytes on one GPU of a vLLM server holding the target with tensor parallelism `tp`: its weight
    share, the KV cache of the prompts in flight (the prefetched batches of every trainer rank), the
    extracted hidden-state rows (n_aux + the last state, on the first GPU) and a runtime reserve.
    A hybrid target's cache is vLLM's paged one (trainer/layout/hybrid.py `vllm_cache_bytes`) over
    `sequences` requests (default: the tokens in requests of `inference_tokens_per_sequence`)."""
    wb = t.dtype_bytes
    kv_per_token = 2 * t.layers * t.kv_heads * t.head_dim * wb
    kv = tokens_in_flight * kv_per_token / tp
    if t.linear is not None:
        n = sequences or math.ceil(tokens_in_flight / ASSUMPTIONS["inference_tokens_per_sequence"])
        per_layer = 2 * max(1, t.kv_heads // tp) * t.head_dim * wb  # vLLM replicates KV heads past tp
        per_sequence = math.ceil(tokens_in_flight / n)
        kv = vllm_cache_bytes(t.linear, t.full_layers, per_layer, tp, t.dtype, n, per_sequence)
    return {
        "target_weights": t.params * wb / tp,
        "kv_cache": kv,
        "hidden_state_rows": tokens_in_flight * (n_aux + 1) * t.hidden * wb,
        "runtime_reserve": ASSUMPTIONS["vllm_runtime_gib"] * GIB,
    }


def choose_disaggregated(t: TargetShape, memory_gib: float, count: int, r: Recipe) -> dict[str, Any]:
    """`target.source: vllm`: k = TP x DP GPUs serve the target, the other count - k train the
    drafter (one rank each, the target not in process). The smallest TP whose server fits; then the
    server's DP that balances the two sides' throughput (the target forward on k GPUs against the
    drafter step, `drafter_compute_share` of it, on count - k), the trainer side's shard level the
    lightest that fits."""
    a = ASSUMPTIONS
    server_budget = memory_gib * GIB * r.vllm_memory_share
    trainer_budget = memory_gib * GIB * a["usable_share"]
    tried: list[dict[str, Any]] = []
    if count < 2:
        return {
            "fits": False,
            "reason": "a vLLM source needs at least 2 GPUs (one serves, one trains)",
            "tried": tried,
        }
    share = a["drafter_compute_share"]
    for tp in a["vllm_tensor_parallel_sizes"]:
        if tp > count - 1 or not tp_divides(t, tp):
            continue
        best = None
        for replicas in range(1, (count - 1) // tp + 1):
            k = tp * replicas
            m = count - k
            in_flight = a["vllm_kv_batches_per_rank"] * m * r.tokens
            server = vllm_gpu_bytes(t, tp, in_flight, r.n_aux)
            s_need = sum(server.values())
            fit = lightest_level(
                shard_levels(r, m),
                lambda level: per_gpu_bytes(t, 1, m, r, level, target_in_process=False),
                trainer_budget,
            )
            shard, trainer, t_need = fit.shard, fit.parts, fit.need
            tried.append(
                {
                    "vllm_gpus": k,
                    "tensor_parallel": tp,
                    "trainer_gpus": m,
                    "shard": shard,
                    "server_gib": round(s_need / GIB, 1),
                    "trainer_gib": round(t_need / GIB, 1),
                }
            )
            if s_need > server_budget or t_need > trainer_budget:
                continue
            balance = min(k, m / share)  # target forwards vs drafter steps per unit of time
            if best is None or balance > best[0]:
                best = (balance, replicas, k, m, shard, server, trainer, s_need, t_need)
        if best is None:
            continue
        _, replicas, k, m, shard, server, trainer, s_need, t_need = best
        gpus = list(range(count))
        return {
            "fits": True,
            "tensor_parallel": tp,
            "data_parallel": replicas,
            "server_gpus": gpus[m:],
            "trainer_gpus": gpus[:m],
            "trainer_data_parallel": m,
            "shard": shard,
            "server_bytes": server,
            "trainer_bytes": trainer,
            "server_need": s_need,
            "trainer_need": t_need,
            "reason": (
                f"vLLM on GPUs {m}..{count - 1} (TP {tp}, DP {replicas}: the smallest TP whose shard of the "
                f"{t.weight_bytes / GIB:.1f} GiB target fits, "
                f"~{s_need / GIB:.1f} GiB of the {server_budget / GIB:.1f} GiB server budget); "
                f"{m} trainer rank(s) on GPUs 0..{m - 1}, train.shard {shard}, ~{t_need / GIB:.1f} GiB each "
                f"of {trainer_budget / GIB:.1f} GiB (headroom {1 - t_need / (memory_gib * GIB):.0%}); "
                f"DP {replicas} balances the target forward against the drafter step "
                f"({share:.0%} of its cost)"
            ),
            "tried": tried,
        }
    return {
        "fits": False,
        "reason": (
            f"no split fits both the server budget ({r.vllm_memory_share:.0%} = "
            f"{server_budget / GIB:.1f} GiB per GPU) and the trainer budget "
            f"({a['usable_share']:.0%} = {trainer_budget / GIB:.1f} GiB per GPU): more GPUs, GPUs with "
            "more memory, or a smaller batch (train.max_anchors, train.max_tokens_per_batch)"
        ),
        "tried": tried,
    }


def disaggregated_layout(split: dict[str, Any], memory_gib: float) -> dict[str, Any]:
    """`choose_disaggregated`'s answer in the fields of `choose_layout`'s (per-GPU figures: a trainer
    rank's), the server under `vllm`."""
    if not split["fits"]:
        return {
            "gpus_per_copy": None,
            "data_parallel": 0,
            "shard": None,
            "fits": False,
            "per_gpu_bytes": {},
            "per_gpu_memory_gb": None,
            "per_gpu_memory_gib": None,
            "reason": split["reason"],
            "tried": split["tried"],
            "vllm": None,
        }
    need = split["trainer_need"]
    return {
        "gpus_per_copy": 1,
        "data_parallel": split["trainer_data_parallel"],
        "shard": split["shard"],
        "fits": True,
        "per_gpu_bytes": split["trainer_bytes"],
        "per_gpu_memory_gb": round(need / 1e9, 1),
        "per_gpu_memory_gib": round(need / GIB, 1),
        "headroom_share": round(1 - need / (memory_gib * GIB), 3),
        "reason": split["reason"],
        "tried": split["tried"],
        "vllm": {
            "tensor_parallel_size": split["tensor_parallel"],
            "data_parallel_size": split["data_parallel"],
            "gpus": split["server_gpus"],
            "trainer_gpus": split["trainer_gpus"],
            "per_gpu_memory_gib": round(split["server_need"] / GIB, 1),
            "per_gpu_breakdown_gib": {k: round(v / GIB, 2) for k, v in split["server_bytes"].items()},
            "headroom_share": round(1 - split["server_need"] / (memory_gib * GIB), 3),
        },
    }
