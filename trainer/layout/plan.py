"""`dflash plan`: how one node's GPUs hold the target (GPUs per copy, data-parallel width), a per-GPU
memory estimate with its reason, and the offline-vs-online arithmetic. Light side: stdlib only.

Inputs: the target's config.json, read by trainer/target.py (its parameter count comes from
`model.safetensors.index.json`'s `metadata.total_size` when that file sits beside it, else from
safetensors headers, else from the config's shapes), and the GPUs: a catalog name (`--gpu A100-40GB
--gpu-count 8`) or a host's recon facts (`--facts reports/<host>/recon.json`, written by the gpu_facts
role).

Layout rule: the smallest number of GPUs per copy n (a divisor of the GPU count) for which the
per-GPU estimate fits in `usable_share` of a GPU's memory; data-parallel width = count // n. The
estimate is that of the copy's first GPU (it holds 1/n of the target's layers AND the drafter, its
optimizer, features and loss) from `trainer/layout/sizing.py`, the one memory model `dflash preflight`
uses too: it models the trainer as it runs (fp32 drafter, DDP + ZeRO-1 or FSDP2 by `train.shard`,
[anchors x block, vocab] logits unless `train.loss_chunk_rows`, fused loss on CUDA). `--shard auto`
(the default) takes, for each GPUs-per-copy count, the lightest level that fits (optimizer, then
full). When no
layout fits (exit 1), the reason names the largest parts; then, and for a fit within 3 % of the
budget (`thin_margin`), `fits_with_anchors` lists the largest `--anchors` each layout would fit with.

Every assumption is a named constant and is echoed in the JSON under `assumptions`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

from trainer.errors import DflashError
from trainer.layout.sizing import ASSUMPTIONS as SIZING_ASSUMPTIONS
from trainer.layout.sizing import Shapes, per_device_bytes
from trainer.target import ModelConfigError, TargetInfo, read_config, stored_bytes

GIB = float(2**30)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8": 1}

# name -> (nvidia-smi name, memory GiB, dense bf16 TFLOPS, interconnect)
GPU_CATALOG: dict[str, dict[str, Any]] = {
    name: {"smi_name": smi, "memory_gib": gib, "bf16_tflops": tflops, "link": link}
    for name, smi, gib, tflops, link in (
        ("A100-40GB", "NVIDIA A100-SXM4-40GB", 40.0, 312, "NVLink 600 GB/s"),
        ("A100-80GB", "NVIDIA A100-SXM4-80GB", 80.0, 312, "NVLink 600 GB/s"),
        ("H100-80GB", "NVIDIA H100 80GB HBM3", 79.6, 989, "NVLink 900 GB/s"),
        ("H200", "NVIDIA H200", 140.4, 989, "NVLink 900 GB/s"),
        ("B200", "NVIDIA B200", 179.1, 2250, "NVLink 1800 GB/s"),
        (
            "RTX-PRO-6000-96GB",
            "NVIDIA RTX PRO 6000 Blackwell Server Edition",
            95.6,
            500,
            "PCIe 5.0 x16 (~64 GB/s)",
        ),
    )
}
GPU_ALIASES = {
    "PRO6000": "RTX-PRO-6000-96GB",
    "RTX-PRO-6000": "RTX-PRO-6000-96GB",
    "PRO6000-96GB": "RTX-PRO-6000-96GB",
    "H200-141GB": "H200",
    "B200-183GB": "B200",
    "A100": "A100-40GB",
    "H100": "H100-80GB",
}

ASSUMPTIONS = {
    "usable_share": 0.92,  # of a GPU's memory the estimate may fill (fragmentation, NCCL buffers)
    "thin_margin_share": 0.97,  # a fit above this share of the budget is flagged as thin
    "memory_model": "trainer/layout/sizing.py",
    **SIZING_ASSUMPTIONS,
    # --shard auto: the lightest that fits, outside the thin margin
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


def read_target(config_path: Path, dtype: str = "bfloat16") -> TargetShape:
    """The target's shapes from its config.json (or the folder holding it), read by trainer/target.py."""
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
    stored = stored_bytes(config_path.parent)
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
    )


def resolve_gpu(name: str) -> tuple[str, dict[str, Any]]:
    key = name.strip()
    key = GPU_ALIASES.get(key.upper(), key)
    for cat_name, spec in GPU_CATALOG.items():
        if key.upper() == cat_name.upper() or key == spec["smi_name"]:
            return cat_name, spec
    known = ", ".join(GPU_CATALOG)
    raise PlanError(f"unknown GPU {name!r}: use one of {known} (or --gpu-memory-gib with any name)")


def gpus_from_facts(path: Path) -> tuple[str, dict[str, Any], int]:
    """(catalog name or the smi name, spec, count) from a recon.json written by the gpu_facts role."""
    try:
        facts = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError(f"recon facts {path}: {exc}") from None
    gpus = facts.get("gpus", facts)
    count = int(gpus.get("count") or 0)
    if count == 0:
        raise PlanError(f"{path}: this host has no GPU; the plan is for GPU nodes (the CPU path needs none)")
    if gpus.get("mixed"):
        raise PlanError(f"{path}: mixed GPU models {gpus['models']}: plan each model separately")
    try:
        name, spec = resolve_gpu(gpus["model"])
        spec = {**spec, "memory_gib": float(gpus["memory_gib_min"])}
    except PlanError:
        name, spec = gpus["model"], uncatalogued_gpu(gpus["model"], float(gpus["memory_gib_min"]))
    return name, spec, count


def uncatalogued_gpu(name: str, memory_gib: float) -> dict[str, Any]:
    """The spec of a GPU outside GPU_CATALOG: its memory only."""
    return {"smi_name": name, "memory_gib": memory_gib, "bf16_tflops": None, "link": "unknown"}


def shapes(t: TargetShape, draft_layers: int, n_aux: int, draft_vocab: int | None = None) -> Shapes:
    return Shapes(
        target_params=t.params,
        target_dtype_bytes=DTYPE_BYTES[t.dtype],
        hidden=t.hidden,
        vocab=t.vocab,
        intermediate=t.intermediate,
        heads=t.heads,
        kv_heads=t.kv_heads,
        head_dim=t.head_dim,
        draft_layers=draft_layers,
        n_aux=n_aux,
        draft_vocab=draft_vocab,
    )


def drafter_params(t: TargetShape, layers: int, n_aux: int) -> int:
    return shapes(t, layers, n_aux).drafter_trainable


@dataclass(frozen=True)
class Recipe:
    """The run's shape as the memory model needs it (the `dflash plan` flags / train.* keys).
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
    optimizer: str = "adamw"  # train.optimizer


def per_gpu_bytes(
    t: TargetShape, n: int, dp: int, r: Recipe, shard: str, target_in_process: bool = True
) -> dict[str, float]:
    return per_device_bytes(
        shapes(t, r.draft_layers, r.n_aux, r.draft_vocab),
        gpus_per_copy=n,
        data_parallel=dp,
        tokens=r.tokens,
        anchors=r.anchors,
        block=r.block,
        device="cuda",
        shard=shard,
        loss_chunk_rows=r.loss_chunk_rows,
        activation_checkpointing=r.activation_checkpointing,
        optimizer=r.optimizer,
        share_embedding=ASSUMPTIONS["share_target_embedding"],
        target_in_process=target_in_process,
    )


def max_anchors_that_fit(t: TargetShape, n: int, dp: int, r: Recipe, shard: str, budget: float) -> int:
    """The largest anchors <= `r.anchors` whose estimate fits `budget` (0: none does)."""
    lo, hi = 0, r.anchors
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(per_gpu_bytes(t, n, dp, replace(r, anchors=mid), shard).values()) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _largest(parts: dict[str, float]) -> str:
    big = sorted(parts.items(), key=lambda kv: -kv[1])[:3]
    return ", ".join(f"{k} {v / GIB:.1f} GiB" for k, v in big)


def _levels(r: Recipe, dp: int) -> tuple[str, ...]:
    """The train.shard levels to try at data-parallel width `dp`, lightest first."""
    if r.shard is not None:
        return (r.shard,)
    return AUTO_SHARD_ORDER if dp > 1 else ("none",)  # one rank per copy set: nothing to shard over


class LevelFit(NamedTuple):
    """The train.shard level `_lightest_level` chose, what it needs, and every level it tried."""

    shard: str
    parts: dict[str, float]
    need: float
    thin: bool  # it fits, but above `thin_margin_share` of the budget
    tried: list[tuple[str, float]]  # (level, need) in the order tried


def _is_thin(need: float, budget: float) -> bool:
    """A fit above `thin_margin_share` of the budget: too close to the model's error to trust."""
    return need <= budget and need > ASSUMPTIONS["thin_margin_share"] * budget


def _lightest_level(levels: tuple[str, ...], parts_of, budget: float) -> LevelFit:
    """The lightest train.shard level whose estimate fits outside the thin margin; else the lightest that
    fits at all; else the heaviest tried."""
    tried, chosen = [], None
    for shard in levels:
        parts = parts_of(shard)
        need = sum(parts.values())
        tried.append((shard, need))
        if need <= budget and not _is_thin(need, budget):
            return LevelFit(shard, parts, need, False, tried)
        if need <= budget and chosen is None:
            chosen = (shard, parts, need)
    shard, parts, need = chosen or (shard, parts, need)
    return LevelFit(shard, parts, need, _is_thin(need, budget), tried)


def choose_layout(
    t: TargetShape, memory_gib: float, count: int, r: Recipe, override: int | None = None
) -> dict[str, Any]:
    """The fewest GPUs per copy whose estimate fits, at the lightest shard level that fits outside the thin
    margin (else the lightest that fits)."""
    budget = memory_gib * GIB * ASSUMPTIONS["usable_share"]
    tried = []
    candidates = [override] if override else [n for n in range(1, count + 1) if count % n == 0]
    if override and count % override:
        raise PlanError(f"gpus_per_copy {override} does not divide the GPU count {count}")

    def anchors_for(m: int, shard: str) -> int:
        return max_anchors_that_fit(t, m, count // m, r, shard, budget)

    for n in candidates:
        dp = count // n
        fit = _lightest_level(_levels(r, dp), lambda level: per_gpu_bytes(t, n, dp, r, level), budget)
        shard, parts, need, thin = fit.shard, fit.parts, fit.need, fit.thin
        tried += [{"gpus_per_copy": n, "shard": lv, "per_gpu_gib": round(x / GIB, 1)} for lv, x in fit.tried]
        if need <= budget or override:
            fits = need <= budget
            smaller = (
                [(m, k) for m in candidates if m < n and (k := anchors_for(m, shard)) > 0] if thin else []
            )
            reason = (
                f"target {t.params / 1e9:.1f}B params x {DTYPE_BYTES[t.dtype]} B = "
                f"{t.params * DTYPE_BYTES[t.dtype] / GIB:.1f} GiB; "
                + ("" if n == 1 else f"fewer than {n} GPUs per copy need more than the budget; ")
                + f"with {n} per copy and train.shard {shard} each GPU needs ~{need / GIB:.1f} GiB of "
                f"{memory_gib:.1f} GiB (budget {ASSUMPTIONS['usable_share']:.0%} = {budget / GIB:.1f} GiB)"
                + ("" if not override else f"; gpus_per_copy={override} set by hand")
                + (
                    f"; THIN MARGIN: within {1 - ASSUMPTIONS['thin_margin_share']:.0%} of the budget, and "
                    "the memory model is not calibrated on a GPU: lower --anchors (train.max_anchors) "
                    "for margin" + "".join(f"; {m} per copy fits with --anchors {k}" for m, k in smaller)
                    if thin
                    else ""
                )
                + ("" if fits else "; DOES NOT FIT: expect out-of-memory")
            )
            return {
                "gpus_per_copy": n,
                "data_parallel": dp,
                "shard": shard,
                "fits": fits,
                "per_gpu_bytes": parts,
                "per_gpu_memory_gb": round(need / 1e9, 1),
                "per_gpu_memory_gib": round(need / GIB, 1),
                "headroom_share": round(1 - need / (memory_gib * GIB), 3),
                "reason": reason,
                "tried": tried,
                "thin_margin": thin,
                "fits_with_anchors": [{"gpus_per_copy": m, "anchors": k} for m, k in smaller],
            }
    fitting = [(n, k) for n in candidates if (k := anchors_for(n, _levels(r, count // n)[-1])) > 0]
    hint = (
        "; " + ", ".join(f"{n} per copy fits with --anchors {k} (train.max_anchors)" for n, k in fitting[:3])
        if fitting
        else "; no --anchors fits: use GPUs with more memory, a smaller dtype or fewer tokens per batch"
    )
    return {
        "gpus_per_copy": None,
        "data_parallel": 0,
        "shard": None,
        "fits": False,
        "per_gpu_bytes": parts,
        "per_gpu_memory_gb": round(need / 1e9, 1),
        "per_gpu_memory_gib": round(need / GIB, 1),
        "reason": f"even {count} GPUs per copy need ~{need / GIB:.1f} GiB on the copy's first GPU "
        f"(train.shard {shard}; largest: {_largest(parts)}), over the "
        f"{budget / GIB:.1f} GiB budget with --anchors {r.anchors} x --block-size {r.block}" + hint,
        "fits_with_anchors": [{"gpus_per_copy": n, "anchors": k} for n, k in fitting],
        "tried": tried,
    }


def vllm_gpu_bytes(t: TargetShape, tp: int, tokens_in_flight: int, n_aux: int) -> dict[str, float]:
    """Bytes on one GPU of a vLLM server holding the target with tensor parallelism `tp`: its weight
    share, the KV cache of the prompts in flight (the prefetched batches of every trainer rank), the
    extracted hidden-state rows (n_aux + the last state, on the first GPU) and a runtime reserve."""
    wb = DTYPE_BYTES[t.dtype]
    kv_per_token = 2 * t.layers * t.kv_heads * t.head_dim * wb
    return {
        "target_weights": t.params * wb / tp,
        "kv_cache": tokens_in_flight * kv_per_token / tp,
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
    server_budget = memory_gib * GIB * a["vllm_gpu_memory_utilization"]
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
        if tp > count - 1 or t.heads % tp or t.kv_heads % tp and tp % t.kv_heads:
            continue
        best = None
        for replicas in range(1, (count - 1) // tp + 1):
            k = tp * replicas
            m = count - k
            in_flight = a["vllm_kv_batches_per_rank"] * m * r.tokens
            server = vllm_gpu_bytes(t, tp, in_flight, r.n_aux)
            s_need = sum(server.values())
            fit = _lightest_level(
                _levels(r, m),
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
                f"{t.params * DTYPE_BYTES[t.dtype] / GIB:.1f} GiB target fits, "
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
            f"no split fits both the server budget ({a['vllm_gpu_memory_utilization']:.0%} = "
            f"{server_budget / GIB:.1f} GiB per GPU) and the trainer budget "
            f"({a['usable_share']:.0%} = {trainer_budget / GIB:.1f} GiB per GPU): more GPUs, GPUs with "
            "more memory, or a smaller batch (--anchors, --tokens-per-batch)"
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


def offline_arithmetic(
    t: TargetShape,
    n_aux: int,
    samples: int,
    mean_tokens: float,
    epochs: float,
    count: int,
    gpus_per_copy: int | None,
) -> dict[str, Any]:
    a = ASSUMPTIONS
    wb = DTYPE_BYTES[t.dtype]
    per_token = n_aux * t.hidden * wb
    total_tokens = samples * mean_tokens
    out: dict[str, Any] = {
        "bytes_per_token": per_token,
        "offline_storage_bytes": int(per_token * total_tokens),
        "offline_storage_tb": round(per_token * total_tokens / 1e12, 1),
        "formula": f"{n_aux} aux layers x {t.hidden} hidden x {wb} B x {mean_tokens:g} tokens "
        f"x {samples} samples",
        "per_hardware": [],
    }
    flops_per_token = 2 * t.params * (1 + a["drafter_compute_share"])
    for name, spec in GPU_CATALOG.items():
        tok_s_gpu = spec["bf16_tflops"] * 1e12 * a["mfu"] / flops_per_token
        tok_s = tok_s_gpu * count
        out["per_hardware"].append(
            {
                "gpu": name,
                "gpus": count,
                "tokens_per_s": round(tok_s),
                "stream_bandwidth_gb_s": round(tok_s * per_token / 1e9, 2),
                "link": spec["link"],
                "wall_hours": round(total_tokens * epochs / tok_s / 3600, 1),
            }
        )
    out["online_note"] = (
        "online training recomputes the target forward each epoch instead of storing hidden states; an "
        "online split (target GPUs streaming to drafter GPUs) moves stream_bandwidth_gb_s over the link"
    )
    return out


# What the hosts of one multi-node run must share: one layout is planned for all of them, NCCL needs
# one driver/CUDA pairing, and a slower or smaller GPU would pace (or not fit) the whole run.
GROUP_FIELDS = ("model", "count", "memory_gib_min", "compute_cap", "driver", "driver_cuda")


def group_mismatches(facts_files: list[Path]) -> list[str]:
    """How the hosts' recon facts differ in GROUP_FIELDS (empty: they can run as one)."""
    rows = []
    for path in facts_files:
        try:
            facts = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise PlanError(f"recon facts {path}: {exc}") from None
        host = facts.get("host")
        host = (host.get("name") if isinstance(host, dict) else host) or Path(path).parent.name
        rows.append((host, facts.get("gpus", facts)))
    problems = []
    for field in GROUP_FIELDS:
        seen = {host: gpus.get(field) for host, gpus in rows}
        if len({json.dumps(v) for v in seen.values()}) > 1:
            problems.append(f"{field}: " + ", ".join(f"{h} {v}" for h, v in seen.items()))
    return problems


def node_count(args) -> int:
    facts = args.facts or []
    nodes = args.nodes if args.nodes is not None else max(1, len(facts))
    if nodes < 1:
        raise PlanError(f"--nodes must be >= 1, got {nodes}")
    if len(facts) > 1 and nodes != len(facts):
        raise PlanError(f"--nodes {nodes} with {len(facts)} --facts files: give one per node")
    if len(facts) > 1:
        bad = group_mismatches([Path(f) for f in facts])
        if bad:
            raise PlanError("the hosts cannot run as one multi-node run, they differ in " + "; ".join(bad))
    return nodes


def make_plan(args) -> dict[str, Any]:
    target = read_target(Path(args.target_config), args.dtype)
    nodes = node_count(args)
    if args.facts:
        gpu_name, spec, count = gpus_from_facts(Path(args.facts[0]))
        if args.gpu_count:
            count = args.gpu_count
    else:
        if not args.gpu or not args.gpu_count:
            raise PlanError("pass --gpu NAME --gpu-count N, or --facts reports/<host>/recon.json")
        if args.gpu_memory_gib:
            gpu_name, spec = args.gpu, uncatalogued_gpu(args.gpu, args.gpu_memory_gib)
        else:
            gpu_name, spec = resolve_gpu(args.gpu)
        count = args.gpu_count
    if count < 1:
        raise PlanError(f"--gpu-count must be >= 1, got {count}")
    if args.loss_chunk_rows < 0:
        raise PlanError(f"--loss-chunk-rows must be >= 0 (0: no chunking), got {args.loss_chunk_rows}")
    if args.draft_vocab_size is not None and not 2 <= args.draft_vocab_size < target.vocab:
        raise PlanError(
            f"--draft-vocab-size {args.draft_vocab_size}: at least 2 and below the target's vocabulary "
            f"({target.vocab})"
        )
    n_aux = args.aux_layers
    recipe = Recipe(
        draft_layers=args.draft_layers,
        n_aux=n_aux,
        block=args.block_size,
        anchors=args.anchors,
        tokens=args.tokens_per_batch,
        loss_chunk_rows=args.loss_chunk_rows,
        shard=None if args.shard == "auto" else args.shard,
        activation_checkpointing=args.activation_checkpointing,
        draft_vocab=args.draft_vocab_size,
        optimizer=args.optimizer,
    )
    source = args.source
    if source == "vllm" and args.gpus_per_copy:
        raise PlanError("--gpus-per-copy is the hooked layout's: it does not combine with --source vllm")
    layout = choose_layout(target, spec["memory_gib"], count, recipe, args.gpus_per_copy)
    split = None
    if source == "vllm" or (source == "auto" and not layout["fits"] and not args.gpus_per_copy):
        split = choose_disaggregated(target, spec["memory_gib"], count, recipe)
        if source == "auto" and split["fits"]:
            split["reason"] = (
                "the target in each trainer process does not fit ("
                + layout["reason"]
                + "): a vLLM server holds it instead; "
                + split["reason"]
            )
        if split["fits"] or source == "vllm":
            layout = disaggregated_layout(split, spec["memory_gib"])
        else:
            layout["reason"] += (
                "; nor does a vLLM server beside the trainers (--source vllm): " + split["reason"]
            )
    plan = {
        "gpu": gpu_name,
        "gpu_count": count,
        "nodes": nodes,
        "world_size": nodes * layout["data_parallel"],
        "gpu_memory_gib": spec["memory_gib"],
        "target": {
            "params": target.params,
            "params_source": target.params_source,
            "hidden": target.hidden,
            "layers": target.layers,
            "vocab": target.vocab,
            "dtype": target.dtype,
        },
        "source": "vllm" if split is not None and (split["fits"] or source == "vllm") else "hooked",
        "vllm": layout.get("vllm"),
        "gpus_per_copy": layout["gpus_per_copy"],
        "data_parallel": layout["data_parallel"],
        "shard": layout["shard"],
        "fits": layout["fits"],
        "headroom_share": layout.get("headroom_share"),
        "per_gpu_memory_gb": layout["per_gpu_memory_gb"],
        "per_gpu_memory_gib": layout["per_gpu_memory_gib"],
        "per_gpu_breakdown_gib": {k: round(v / GIB, 2) for k, v in layout["per_gpu_bytes"].items()},
        "reason": layout["reason"],
        "tried": layout["tried"],
        "thin_margin": layout.get("thin_margin", False),
        "fits_with_anchors": layout.get("fits_with_anchors", []),
        "drafter": {
            "layers": args.draft_layers,
            "aux_layers": n_aux,
            "block_size": args.block_size,
            "anchors": args.anchors,
            "tokens_per_batch": args.tokens_per_batch,
            "loss_chunk_rows": args.loss_chunk_rows,
            "activation_checkpointing": args.activation_checkpointing,
            "draft_vocab_size": args.draft_vocab_size,
            "optimizer": args.optimizer,
        },
        "assumptions": ASSUMPTIONS,
    }
    arith = offline_arithmetic(
        target, n_aux, args.samples, args.mean_tokens, args.epochs, count * nodes, layout["gpus_per_copy"]
    )
    plan["offline_storage_bytes"] = arith["offline_storage_bytes"]
    plan["offline_vs_online"] = arith
    return plan


def _tried_text(t: dict[str, Any]) -> str:
    """One layout `choose_layout` or `choose_disaggregated` tried, in words."""
    if "gpus_per_copy" in t:
        return f"{t['gpus_per_copy']} per copy, shard {t['shard']}: {t['per_gpu_gib']} GiB"
    return (
        f"vLLM TP {t['tensor_parallel']} on {t['vllm_gpus']} GPUs ({t['server_gib']} GiB each) + "
        f"{t['trainer_gpus']} trainer GPUs, shard {t['shard']} ({t['trainer_gib']} GiB each)"
    )


def render_text(p: dict[str, Any]) -> str:
    t = p["target"]
    lines = [
        (
            f"target   {t['params'] / 1e9:.2f}B params ({t['params_source']}), hidden {t['hidden']}, "
            f"{t['layers']} layers, {t['dtype']}"
        ),
        f"gpus     {p['gpu_count']} x {p['gpu']} ({p['gpu_memory_gib']} GiB each)"
        + (f" per node, {p['nodes']} nodes: {p['world_size']} trainer ranks" if p["nodes"] > 1 else ""),
        (
            f"layout   target.source vllm: GPUs {p['vllm']['gpus']} serve the target (TP "
            f"{p['vllm']['tensor_parallel_size']}, DP {p['vllm']['data_parallel_size']}, "
            f"~{p['vllm']['per_gpu_memory_gib']} GiB each), GPUs {p['vllm']['trainer_gpus']} train "
            f"(data-parallel {p['data_parallel']}, train.shard {p['shard']})"
            if p.get("vllm")
            else f"layout   {p['gpus_per_copy']} GPU(s) per target copy, data-parallel {p['data_parallel']}, "
            f"train.shard {p['shard']}"
            if p["gpus_per_copy"] is not None
            else "layout   NONE FITS (tried " + ", ".join(map(_tried_text, p["tried"])) + ")"
        ),
        (
            f"memory   ~{p['per_gpu_memory_gib']} GiB per {'trainer ' if p.get('vllm') else ''}GPU: "
            + ", ".join(f"{k} {v}" for k, v in p["per_gpu_breakdown_gib"].items())
            if p["per_gpu_memory_gib"] is not None
            else "memory   per GPU of each split tried: see layout"
        ),
        f"why      {p['reason']}",
    ]
    o = p["offline_vs_online"]
    lines.append(f"offline  {o['offline_storage_tb']} TB of hidden states ({o['formula']})")
    lines.append(f"         {o['online_note']}")
    lines.append(
        f"per hardware ({p['gpu_count'] * p['nodes']} GPUs; assumptions: mfu {p['assumptions']['mfu']}, "
        f"drafter {p['assumptions']['drafter_compute_share']:.0%} of the target forward):"
    )
    for h in o["per_hardware"]:
        lines.append(
            f"  {h['gpu']:18} {h['tokens_per_s']:>9} tok/s  stream {h['stream_bandwidth_gb_s']:>7} GB/s "
            f"over {h['link']:24} ~{h['wall_hours']} h"
        )
    return "\n".join(lines)


def cmd_plan(args) -> int:
    plan = make_plan(args)
    print(json.dumps(plan, indent=1) if args.json else render_text(plan))
    return 0 if plan["gpus_per_copy"] is not None else 1
