"""The GPU check's stages that need no vLLM: `dflash train` with the target hooked in process (plain,
with `train.loss_chunk_rows`, and at `train.shard` optimizer / full in a process group of one), the
online-overhead timing, and `dflash eval` on the harness. Each stage is `fn(ctx, sampler, timeout)
-> record`; it raises to fail (check.py records the error and goes on with the next one).

A record holds the stage's own figures, its measured peak (the trainer's `torch.cuda.max_memory_allocated`
from its step events; process RSS on a CPU) beside the memory model's prediction for the same run
config, and `problems`: what ran but is wrong (a non-finite loss, flex attention run uncompiled, a
shard level that did not take effect, a lossless mismatch)."""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

from common import GIB, REPO, Ctx, PeakSampler, Skip, dflash_cmd, predict, ratio, run_logged

PERSISTENT_PARTS = ("target_weights", "drafter_trainable", "drafter_optimizer", "drafter_frozen")
UNCOMPILED_FLEX = "flex_attention called without torch.compile"  # torch/nn/attention/flex_attention.py


def datasheet_tflops(device_name: str | None) -> float | None:
    """Dense bf16 TFLOP/s of this GPU from `dflash plan`'s catalog (None off the catalog, or on a CPU)."""
    from trainer.layout.hardware import resolve_gpu
    from trainer.layout.recipe import PlanError

    if not device_name:
        return None
    try:
        return float(resolve_gpu(device_name)[1]["bf16_tflops"])
    except PlanError:
        return None


def step_flops(shape: dict, recipe: dict, target: bool = True) -> float:
    """Matmul FLOPs of one step (approximate; attention causal): the target's no-grad forward over the
    batch (`target`: in process), the drafter's forward+backward (3x its forward) over anchors*block
    query tokens, its fc over every token, and the frozen heads (drafter logits forward + input
    gradient, verifier logits forward)."""
    from trainer.layout.sizing import Shapes

    t, q = recipe["tokens"], recipe["anchors"] * recipe["block_size"]
    h, v = shape["hidden_size"], shape["vocab_size"]
    heads, hd = shape["num_attention_heads"], shape["head_dim"]
    s = Shapes(
        target_params=0,
        target_dtype_bytes=2,
        hidden=h,
        vocab=v,
        intermediate=shape["intermediate_size"],
        heads=heads,
        kv_heads=shape["num_key_value_heads"],
        head_dim=hd,
        draft_layers=recipe["draft_layers"],
    )
    layer = s.decoder_layer_params()
    tgt = shape["num_hidden_layers"] * (2 * layer * t + 2 * t * t * heads * hd)  # QK and AV, causal half
    drafter_layers = (
        recipe["draft_layers"] * 3 * (2 * layer * q + 4 * q * (t / 2 + recipe["block_size"]) * heads * hd)
    )
    fc = 3 * 2 * s.n_aux * h * h * t
    heads_flops = 2 * v * h * q * 3
    return float((tgt if target else 0) + drafter_layers + fc + heads_flops)


def summarise_run(ctx: Ctx, cfg: Path, log_text: str, target_in_process: bool = True) -> dict:
    """The figures of a finished `dflash train` (its step events) beside the memory model's prediction."""
    import torch

    from trainer.config.run import load_config
    from trainer.store.events import load_events

    run = load_config(cfg)
    events = load_events(run.out_dir / "events.jsonl")
    steps = [e for e in events if e["event"] == "step"]
    if not steps:
        raise RuntimeError(f"dflash train wrote no step events into {run.out_dir}")
    warm = steps[len(steps) // 3 :] or steps  # the first third: compilation, allocator growth
    step_s = statistics.median(e["step_s"] for e in warm)
    pred = predict(cfg, ctx.cuda)
    parts = pred["predicted_by_part_gib"]
    peak = max(e.get("gpu_peak_gb" if ctx.cuda else "rss_gb") or 0.0 for e in steps)  # GiB (2**30)
    persistent = steps[-1].get("gpu_allocated_gb")
    predicted_persistent = round(sum(parts[k] for k in PERSISTENT_PARTS), 3)
    flops = step_flops(ctx.shape, ctx.recipe, target=target_in_process)
    datasheet = datasheet_tflops(torch.cuda.get_device_name(0)) if ctx.cuda else None
    achieved = flops / step_s / 1e12
    start = next((e for e in events if e["event"] == "run_start"), {})
    rec = {
        "steps": len(steps),
        "step_s_median": step_s,
        "target_s_median": statistics.median(e.get("target_s") or 0.0 for e in warm),
        "drafter_s_median": statistics.median(e.get("drafter_s") or 0.0 for e in warm),
        "tokens_per_s": statistics.median(e["tokens_per_s"] for e in warm),
        "loss_first": steps[0]["loss"],
        "loss_last": steps[-1]["loss"],
        "all_finite": all(e["loss"] is not None and e["grad_norm"] is not None for e in steps),
        "attention": run.drafter.attention_on(ctx.cuda),
        "shard": start.get("layout", {}).get("shard"),
        "optimizer": start.get("layout", {}).get("optimizer"),
        "step_tflops": flops / 1e12,
        "achieved_tflops": achieved,
        "mfu_vs_datasheet": achieved / datasheet if datasheet else None,
        "mfu_vs_measured_matmul": ratio(achieved, ctx.matmul_tflops),
        "peak_memory_source": "torch.cuda.max_memory_allocated" if ctx.cuda else "process RSS (CPU)",
        "peak_memory_gib": peak,
        **pred,
        "measured_over_predicted": ratio(peak, pred["predicted_allocated_gib"]),
        "persistent_memory_gib": persistent,
        "predicted_persistent_gib": predicted_persistent,
        "persistent_over_predicted": ratio(persistent, predicted_persistent),
        "flex_uncompiled_warning": UNCOMPILED_FLEX in log_text,
    }
    problems = []
    if not rec["all_finite"]:
        problems.append("a step's loss or gradient norm was not finite")
    if rec["flex_uncompiled_warning"]:
        problems.append("flex attention ran without torch.compile (the unfused path: the whole score matrix)")
    rec["problems"] = problems
    return rec


def train_run(
    ctx: Ctx,
    name: str,
    sampler: PeakSampler,
    timeout: float,
    extra: dict | None = None,
    one_rank: bool = False,
    steps: int | None = None,
    ranks: int = 1,
) -> dict:
    cfg = ctx.run_config(name, steps or ctx.mode.other_steps, extra)
    cmd = dflash_cmd("train", "--config", str(cfg))
    if one_rank:  # rank 0 of a process group of one: the shard levels' distributed code (one_rank.py)
        cmd = [sys.executable, str(REPO / "bench" / "gpu" / "one_rank.py"), "train", "--config", str(cfg)]
    if ranks > 1:  # as the product's unit starts data-parallel ranks (trainer_service_exec: torchrun)
        cmd = torchrun_cmd(ranks, "train", "--config", str(cfg))
    text = run_logged(f"dflash train ({name})", cmd, ctx.work / f"{name}.log", timeout, sampler)
    return summarise_run(
        ctx, cfg, text, target_in_process=(extra or {}).get("target", {}).get("source") != "vllm"
    )


def hooked(ctx: Ctx, sampler: PeakSampler, timeout: float) -> dict:
    """`dflash train` as a node runs it: the target hooked in this process, the drafter's default
    attention (flex on CUDA, compiled by speculators), the whole-vocabulary loss."""
    return train_run(ctx, "hooked", sampler, timeout, steps=ctx.mode.steps)


def chunked(ctx: Ctx, sampler: PeakSampler, timeout: float) -> dict:
    """`train.loss_chunk_rows`: the heads and the loss over row chunks (trainer/training/chunked_loss.py),
    with the default attention: flex attention on CUDA, which must run compiled."""
    rows = ctx.recipe["chunk_rows"]
    rec = train_run(ctx, "chunked", sampler, timeout, {"train": {"loss_chunk_rows": rows}})
    rec["loss_chunk_rows"] = rows
    ref = ctx.done.get("hooked", {})
    if ref.get("status") == "ok":  # same seed, data and first batch: the first losses agree
        rec["loss_first_vs_hooked"] = rec["loss_first"] - ref["loss_first"]
        rec["peak_vs_hooked"] = ratio(rec["peak_memory_gib"], ref["peak_memory_gib"])
    return rec


def _sharded(ctx: Ctx, name: str, level: str, sampler: PeakSampler, timeout: float) -> dict:
    rec = train_run(ctx, name, sampler, timeout, {"train": {"shard": level}}, one_rank=True)
    if rec["shard"] != level:
        rec["problems"].append(
            f"run_start says shard {rec['shard']!r}, not {level!r}: the level did not take"
        )
    return rec


def zero1(ctx: Ctx, sampler: PeakSampler, timeout: float) -> dict:
    """`train.shard: optimizer` (DDP + ZeroRedundancyOptimizer) at world size 1 (NCCL on CUDA)."""
    return _sharded(ctx, "zero1", "optimizer", sampler, timeout)


def fsdp2(ctx: Ctx, sampler: PeakSampler, timeout: float) -> dict:
    """`train.shard: full` (FSDP2 `fully_shard`, bf16 parameters, fp32 reduce) at world size 1."""
    return _sharded(ctx, "fsdp2", "full", sampler, timeout)


def torchrun_cmd(ranks: int, *args: str) -> list[str]:
    """`torchrun --standalone --nproc-per-node=N -m trainer.cli ARGS`, the product's one-node launch."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    return [*launch, "--shutdown-timeout=20", "-m", "trainer.cli", *args]


def need_gpus(ctx: Ctx, n: int, what: str) -> None:
    """Skip (with the reason printed and in the report) unless `n` CUDA devices are visible."""
    if not ctx.cuda:
        raise Skip(f"{what} needs {n} CUDA devices: this is a CPU run")
    import torch

    have = torch.cuda.device_count()
    if have < n:
        raise Skip(f"{what} needs {n} GPUs, {have} visible (a {have}-GPU node cannot show it)")


def dp2(ctx: Ctx, sampler: PeakSampler, timeout: float) -> dict:
    """Two data-parallel ranks (torchrun, NCCL), one GPU each, as the unit starts them: the ranks must
    reach each other (the bootstrap of NCCL and gloo under the unit's IP filter) and agree each step."""
    need_gpus(ctx, 2, "2 data-parallel ranks")
    rec = train_run(ctx, "dp2", sampler, timeout, ranks=2)
    rec["world_size"] = _layout(ctx, "dp2").get("world_size")
    if rec["world_size"] != 2:
        rec["problems"].append(f"run_start says world size {rec['world_size']}, not 2")
    return rec


def copy2(ctx: Ctx, sampler: PeakSampler, timeout: float) -> dict:
    """`target.gpus_per_copy: 2`: one rank, its target copy split layer-wise over GPUs 0 and 1."""
    need_gpus(ctx, 2, "target.gpus_per_copy 2")
    rec = train_run(ctx, "copy2", sampler, timeout, {"target": {"gpus_per_copy": 2}})
    devices = _layout(ctx, "copy2").get("target_devices") or []
    rec["target_devices"] = devices
    if len(set(devices)) != 2:
        rec["problems"].append(f"run_start's target devices are {devices}, not two GPUs")
    return rec


def _layout(ctx: Ctx, name: str) -> dict:
    from trainer.store.events import load_events

    events = load_events(ctx.work / name / "events.jsonl")
    return next((e for e in events if e["event"] == "run_start"), {}).get("layout", {})


def write_prompts(ctx: Ctx) -> Path:
    import numpy as np

    rng = np.random.default_rng(1)
    path = ctx.work / "prompts.jsonl"
    n, vocab = ctx.mode.eval_prompts, ctx.shape["vocab_size"]
    rows = [{"input_ids": rng.integers(10, vocab - 10, size=32).tolist()} for _ in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def eval_cmd(ctx: Ctx, drafter: Path, out: Path, *extra: str) -> list[str]:
    return dflash_cmd(
        "eval",
        "--drafter", str(drafter),
        "--target", str(ctx.target),
        "--prompts", str(write_prompts(ctx)),
        "--device", "cuda" if ctx.cuda else "cpu",
        "--max-new-tokens", str(ctx.mode.eval_tokens),
        "--check-lossless", "all",
        "--ignore-eos",
        "--out", str(out),
        *extra,
    )  # fmt: skip


def trained_drafter(ctx: Ctx) -> Path:
    """The run folder of the first training stage that finished (eval needs a checkpoint)."""
    for name in ("hooked", "chunked", "zero1", "fsdp2", "dp2", "copy2", "vllm"):
        if ctx.done.get(name, {}).get("status") == "ok":
            return ctx.work / name
    raise RuntimeError("no training stage finished: there is no checkpoint to evaluate")


def summarise_eval(r: dict) -> dict:
    """The figures of one drafter's `dflash eval` report (trainer/eval/run.py)."""
    ll = r["lossless"]
    rec = {
        "device": r["device"],
        "tau": r["tau"],
        "lossless_checked": ll["checked"],
        "lossless_matched": ll["matched"],
        "lossless_near_ties": len(ll.get("near_ties") or []),
        "lossless_ok": ll["ok"],
        "tokens_per_s": r["tokens_per_s"],
        "target_alone_tokens_per_s": ll["target_tokens_per_s"],
        "warnings": r["warnings"],
        "problems": [],
    }
    if ll["ok"] is not True:  # near-ties (bf16 rounding at a top-2 gap under the tolerance) are not problems
        rec["problems"].append(
            f"lossless {ll['matched']}/{ll['checked']} exact, {len(ll['mismatches'])} mismatch(es): "
            "the decode differs from the verifier's own choice or from greedy beyond a near-tie"
        )
    return rec


def weights_prediction(ctx: Ctx) -> dict:
    """What the memory model says eval holds: the target's weights and the drafter's (it has no eval
    part: the KV caches of one prompt are small beside them)."""
    pred = predict(ctx.work / "hooked.yaml", ctx.cuda) if (ctx.work / "hooked.yaml").is_file() else None
    if pred is None:
        return {}
    p = pred["predicted_by_part_gib"]
    weights = p["target_weights"] + p["drafter_frozen"] + p["drafter_trainable"]
    return {"predicted_weights_gib": round(weights, 3)}


def harness_eval(ctx: Ctx, sampler: PeakSampler, timeout: float) -> dict:
    """`dflash eval` on the harness (target and drafter in this process), every prompt checked lossless
    against the target's own greedy decoding. Peak: the device's, sampled (everything on it)."""
    out = ctx.work / "eval" / "report.json"
    run_logged(
        "dflash eval", eval_cmd(ctx, trained_drafter(ctx), out), ctx.work / "eval.log", timeout, sampler
    )
    rec = {"prompts": ctx.mode.eval_prompts, **summarise_eval(json.loads(out.read_text()))}
    return {**rec, **weights_prediction(ctx)}


def overhead(ctx: Ctx, sampler: PeakSampler, timeout: float) -> dict:
    """The online step against its two parts timed alone on the same batches (bench/online_overhead.py
    part a), in this process: last, so that its memory cannot crowd another stage."""
    from online_overhead import part_a

    if ctx.cuda:
        import torch

        torch.cuda.reset_peak_memory_stats()  # the target build and the matmul came before
    else:
        sampler.watch(os.getpid())  # this process's RSS: the check's own and the stage's
    a = part_a(
        ctx.target,
        ctx.recipe["tokens"],
        ctx.mode.reps,
        ctx.work / "overhead",
        drafter=ctx.drafter_section(),
        anchors=ctx.recipe["anchors"],
    )
    if ctx.cuda:
        import torch

        peak = torch.cuda.max_memory_allocated() / GIB
        torch.cuda.empty_cache()
    else:
        peak = None
    return {
        "online_step_s": a["online_step_s"],
        "target_capture_s": a["target_capture_s"],
        "drafter_step_s": a["drafter_step_s"],
        "online_over_parts": a["ratio"],
        "peak_memory_gib": peak,
        "problems": [],
    }
