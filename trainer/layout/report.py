"""`dflash plan`'s arithmetic beyond the layout (offline storage of hidden states, tokens/s and wall time
per GPU kind) and its text report. Light side: stdlib only.
"""

from __future__ import annotations

from typing import Any

from trainer.layout.disk import render as render_disk
from trainer.layout.hardware import GPU_CATALOG
from trainer.layout.recipe import ASSUMPTIONS, TargetShape
from trainer.layout.renting import render as render_renting


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
    wb = t.dtype_bytes
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


def budget_arithmetic(
    budget: str,
    rate: dict[str, Any],
    tokens_per_step: int,
    max_steps: int,
    dataset_tokens: float,
) -> dict[str, Any]:
    """A time budget (`train.time_budget`, `--time-budget`) in tokens, steps and epochs at `rate`
    (`tokens_per_s`, and `seconds_per_step` when measured; `source` says measured or modelled). An upper
    bound: loading, checkpoints and the stop margin come off the budget."""
    from trainer.config.duration import parse_duration

    seconds = parse_duration(budget)
    tok_s = rate["tokens_per_s"]
    sps = rate.get("seconds_per_step") or tokens_per_step / tok_s
    steps = min(max_steps, int(seconds / sps))
    tokens = steps * tok_s * sps  # modelled: full batches (tokens_per_step); measured: as they came
    return {
        "budget": budget,
        "budget_s": seconds,
        "rate_source": rate["source"],
        "tokens_per_s": round(tok_s, 1),
        "seconds_per_step": round(sps, 4),
        "expected_steps": steps,
        "ended_by": "max_steps" if steps == max_steps else "time_budget",
        "expected_tokens": int(tokens),
        "dataset_tokens": int(dataset_tokens),
        "epochs": round(tokens / dataset_tokens, 3) if dataset_tokens else None,
    }


def flat_keys(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"shard": "full"}} -> {"train.shard": "full"}: a run config's keys as its docs name them."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat_keys(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


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
    if p["apply"]:
        lines.append("apply    " + ", ".join(f"{k} {v}" for k, v in flat_keys(p["apply"]).items()))
    if p.get("inference"):
        e, h = p["inference"]["engine"], p["inference"]["harness"]
        lines.append(
            "eval     vLLM (dflash eval --engine vllm, regenerate --backend vllm): "
            + (f"--tensor-parallel-size {e['tensor_parallel_size']}" if e["fits"] else "DOES NOT FIT")
            + f" ({e['reason']})"
        )
        lines.append(
            "         harness (dflash eval): "
            + (f"--harness-gpus {h['gpus']}" if h["fits"] else "DOES NOT FIT")
            + f" ({h['reason']})"
        )
    if p.get("eval_child"):
        c = p["eval_child"]
        lines.append(
            "         the run's eval: (tau while training): "
            + (f"eval.device {c['device']}" if c["fits"] else "NO PLACE")
            + f" ({c['reason']})"
        )
    if p.get("disk"):
        lines.append(f"disk     ~{p['disk']['total_gb']} GB per node (rent at least this much):")
        lines += render_disk(p["disk"], indent="  ")
        for n in p["disk"].get("nodes", []):
            verdict = "TOO SMALL for the total" if n["short"] else "holds the total"
            lines.append(f"  {n['host']}: {n['size_gb']} GB filesystem at {n['path']} (recon): {verdict}")
    if p.get("time_budget"):
        b = p["time_budget"]
        lines.append(
            f"budget   {b['budget']}: <= {b['expected_tokens']:,} tokens, {b['expected_steps']:,} steps "
            f"({b['ended_by']} ends it), {b['epochs']} epochs of {b['dataset_tokens']:,} tokens, at "
            f"{b['tokens_per_s']:,} tok/s, {b['seconds_per_step']} s/step, {b['rate_source']}"
        )
    if p.get("cost"):
        lines += render_renting(p)
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
