"""`dflash plan`'s answer to the renting question: how many hours regeneration and training take on the
planned node(s), and what they cost at `--price-per-hour` (per node). Light side: stdlib only.

- samples: `--samples` when given, else `--regenerate-samples` (the dataset regeneration writes is the
  one training reads), else the seeds' 902K (`SEEDS_SAMPLES`); the plan says which.
- regeneration (`dflash regenerate` through the regenerate_job role: one vLLM engine per
  `--tensor-parallel-size` GPUs of one node, `--regenerate-concurrency` requests in flight each, default
  the role's `REGENERATE_CONCURRENCY`): a MODEL,
  not a measurement. A decode step of an engine reads each GPU's share of the weights and of the KV cache
  of the sequences in flight (mean context: half of `--mean-tokens`) from HBM at `hbm_efficiency` of the
  GPU's datasheet bandwidth (`GPU_CATALOG`'s `hbm_gb_s`), and cannot beat the compute of those tokens at
  the plan's `mfu`; each step writes one token per sequence in flight. Every token of a sample is counted
  as generated (prompts are prefilled far faster): an upper bound on the work. Regeneration runs on one
  node (`regenerate.yml -l HOST`).
- training: `--samples` x `--mean-tokens` x `--epochs` tokens at the time budget's rate (`step_rate`:
  modelled from the GPU kind at the plan's `mfu`, or measured with `--rate-from RUN_DIR`).
- cost: hours x `--price-per-hour` x the nodes that run it (regeneration 1, training `--nodes`).
"""

from __future__ import annotations

import math
from typing import Any

from trainer.layout.recipe import ASSUMPTIONS, PlanError, TargetShape

SEEDS_SAMPLES = 902_000  # the seeds' dataset (--samples' default when nothing else says)
REGENERATE_CONCURRENCY = 16  # requests in flight per engine: regenerate_job_concurrency's and --concurrency's
# share of the datasheet HBM bandwidth a decode step reaches (an assumption, not calibrated on a GPU)
HBM_EFFICIENCY = 0.6


def training_samples(args) -> tuple[int, str]:
    """(samples the epochs count, where that number comes from)."""
    if args.samples is not None:
        return args.samples, "--samples"
    if args.regenerate_samples:
        return args.regenerate_samples, "--regenerate-samples (the dataset regeneration writes)"
    return SEEDS_SAMPLES, "the seeds' 902K (no --samples, no --regenerate-samples)"


def regenerate_rate(
    t: TargetShape, spec: dict[str, Any], tp: int, mean_tokens: float, kv_per_token: int, c: int
) -> dict[str, Any] | None:
    """Generated tokens/s of one vLLM engine on `tp` GPUs of `spec` with `c` sequences in flight; None
    when the catalog has no bandwidth or FLOPS for the GPU."""
    bw, tflops = spec.get("hbm_gb_s"), spec.get("bf16_tflops")
    if not bw or not tflops:
        return None
    weights = t.weight_bytes / tp
    kv = c * (mean_tokens / 2) * kv_per_token / tp
    memory_s = (weights + kv) / (bw * 1e9 * HBM_EFFICIENCY)
    compute_s = c * 2 * t.params / (tp * tflops * 1e12 * ASSUMPTIONS["mfu"])
    step_s = max(memory_s, compute_s)
    return {
        "tokens_per_s_per_engine": round(c / step_s, 1),
        "step_ms": round(step_s * 1e3, 2),
        "bound": "memory" if memory_s >= compute_s else "compute",
        "bytes_per_step_per_gpu": int(weights + kv),
    }


def plan_regeneration(
    t: TargetShape,
    gpu: str,
    spec: dict[str, Any],
    count: int,
    engine: dict[str, Any],
    samples: int,
    mean_tokens: float,
    kv_per_token: int,
    concurrency: int | None = None,
) -> dict[str, Any]:
    """Hours for `dflash regenerate` to write `samples` on one node, with the plan's engine layout and
    `concurrency` requests in flight per engine (default: the role's)."""
    c = concurrency or REGENERATE_CONCURRENCY
    tp = engine.get("tensor_parallel_size")
    out: dict[str, Any] = {
        "samples": samples,
        "mean_tokens": mean_tokens,
        "generated_tokens": int(samples * mean_tokens),
        "tensor_parallel_size": tp,
        "engines": count // tp if tp and engine.get("fits") else 0,
        "concurrency": c,
        "nodes": 1,
        "tokens_per_s": None,
        "hours": None,
    }
    if not out["engines"]:
        out["source"] = "no vLLM engine fits these GPUs (see the eval line)"
        return out
    rate = regenerate_rate(t, spec, tp, mean_tokens, kv_per_token, c)
    if rate is None:
        out["source"] = f"no modelled rate: the catalog has no HBM bandwidth for GPU {gpu!r}"
        return out
    tok_s = rate["tokens_per_s_per_engine"] * out["engines"]
    out.update(rate)
    out["tokens_per_s"] = round(tok_s, 1)
    out["hours"] = round(out["generated_tokens"] / tok_s / 3600, 1)
    out["source"] = (
        f"modelled, not measured: each decode step reads every GPU's share of the weights and of the KV "
        f"cache of {c} sequences (mean context {mean_tokens / 2:g} tokens) at "
        f"{HBM_EFFICIENCY:.0%} of {gpu}'s {spec['hbm_gb_s']} GB/s HBM (datasheet), or the compute at mfu "
        f"{ASSUMPTIONS['mfu']}, whichever is slower ({rate['bound']}-bound here); every token counted as "
        "generated; monitor a regenerate job for the measured tokens/s"
    )
    return out


def plan_training(samples: int, source: str, mean_tokens: float, epochs: float, rate: dict | None) -> dict:
    tokens = samples * mean_tokens * epochs
    out: dict[str, Any] = {
        "samples": samples,
        "samples_source": source,
        "mean_tokens": mean_tokens,
        "epochs": epochs,
        "tokens": int(tokens),
        "tokens_per_s": None,
        "hours": None,
        "rate_source": None,
    }
    if rate is not None:
        out["tokens_per_s"] = round(rate["tokens_per_s"], 1)
        out["hours"] = round(tokens / rate["tokens_per_s"] / 3600, 1)
        out["rate_source"] = rate["source"]
    return out


def check_price(price: float | None) -> None:
    if price is not None and (not math.isfinite(price) or price < 0):
        raise PlanError(f"--price-per-hour must be a finite amount of at least 0, got {price}")


def plan_cost(regen: dict[str, Any] | None, train: dict[str, Any], nodes: int, price: float | None) -> dict:
    """Each step's node-hours and, with `price` (per node and hour), money: hours x price x nodes."""
    check_price(price)
    steps = []
    for name, part, n in (("regeneration", regen, 1), ("training", train, nodes)):
        if part is None or part.get("hours") is None:
            continue
        cost = round(part["hours"] * price * n, 2) if price is not None else None
        steps.append({"step": name, "hours": part["hours"], "nodes": n, "cost": cost})
    hours = round(sum(s["hours"] for s in steps), 1)
    node_hours = round(sum(s["hours"] * s["nodes"] for s in steps), 1)
    return {
        "price_per_hour": price,
        "steps": steps,
        "hours": hours,
        "node_hours": node_hours,
        "total": round(sum(s["cost"] for s in steps), 2) if price is not None else None,
    }


def render(p: dict[str, Any]) -> list[str]:
    """The plan's `regen`, `train` and `cost` lines."""
    lines = []
    g = p.get("regeneration")
    if g:
        if g["hours"] is None:
            lines.append(f"regen    {g['samples']:,} samples: no estimate ({g['source']})")
        else:
            lines.append(
                f"regen    ~{g['hours']} h: {g['samples']:,} samples x {g['mean_tokens']:g} tokens on "
                f"{g['engines']} vLLM engine(s) of TP {g['tensor_parallel_size']} (one node), "
                f"{g['concurrency']} in flight each: ~{g['tokens_per_s']:,.0f} tok/s"
            )
            lines.append(f"         ({g['source']})")
    t = p["training"]
    if t["hours"] is None:
        lines.append(
            f"train    {t['samples']:,} samples ({t['samples_source']}): no modelled rate for this GPU"
        )
    else:
        lines.append(
            f"train    ~{t['hours']} h: {t['epochs']:g} epoch(s) of {t['samples']:,} samples "
            f"({t['samples_source']}) x {t['mean_tokens']:g} tokens at ~{t['tokens_per_s']:,.0f} tok/s, "
            f"{t['rate_source']}"
        )
    c = p["cost"]
    parts = ", ".join(
        f"{s['step']} {s['hours']} h x {s['nodes']} node(s)"
        + (f" = {s['cost']:,.2f}" if s["cost"] is not None else "")
        for s in c["steps"]
    )
    if c["price_per_hour"] is None:
        lines.append(f"cost     {c['node_hours']} node-hours ({parts}); --price-per-hour P gives the money")
    else:
        lines.append(
            f"cost     ~{c['total']:,.2f} at {c['price_per_hour']:g} per node-hour: {parts} (estimates: add "
            "provisioning, downloads and margin)"
        )
    return lines
