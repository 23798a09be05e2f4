#!/usr/bin/env python3
"""The GPU check: what `dflash train` and `dflash eval` really do on this machine's GPU, in one call.

For each target shape (random weights, bf16, built on the GPU: no download):
  1. `dflash train` for a few dozen steps with the seeds' recipe shape (5 draft layers, block 16,
     512 anchors, 4096 tokens): tokens/s, step time, MFU, and the trainer's peak device memory
     (`torch.cuda.max_memory_allocated`, from its step events) beside the memory model's prediction
     for the same shapes (trainer/layout/sizing.py via preflight's estimate_memory): the calibration ratio;
  2. the online step time / (target capture alone + drafter step alone) on the same batches
     (bench/online_overhead.py part a, timed with a device synchronize around each region);
  3. `dflash eval --device cuda` on a few prompts with the lossless check on every prompt.
Then one JSON report (REPORT in the folder named by --out, else $OUT, else reports/gpu-check) and a
short table. A stage that would overrun --budget-s is skipped and the report says so.

--cpu-smoke runs the same stages with a tiny target and recipe on the CPU (fp32), writing the same
report keys, so that the test suite keeps this script working between the times a GPU is lent.

Usage: python3 bench/gpu/check.py [--cpu-smoke] [--out DIR] [--shapes qwen3-8b[,qwen3-32b]] [--steps N]
On the lent H200 with its carried wheels: bash bench/gpu/run.sh (docs/gpu-check.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

REPORT = "gpu-check.json"
GIB = float(2**30)

# Random-weight targets shaped like the real ones (their config.json's sizes; Qwen3 architecture).
SHAPES: dict[str, dict] = {
    "qwen3-8b": {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rope_theta": 1_000_000.0,
    },
    # 65 GB in bf16: it fits one H200, but its saved folder needs that much disk (--work on a tmpfs)
    "qwen3-32b": {
        "vocab_size": 151936,
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rope_theta": 1_000_000.0,
    },
    "tiny": {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 4096,
    },
}
# The seeds' recipe for Qwen3.6-27B, and the smoke mode's tiny one.
RECIPE = {"draft_layers": 5, "block_size": 16, "anchors": 512, "tokens": 4096}
SMOKE_RECIPE = {"draft_layers": 1, "block_size": 4, "anchors": 16, "tokens": 128}
PERSISTENT_PARTS = ("target_weights", "drafter_trainable", "drafter_optimizer", "drafter_frozen")


def log(msg: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def environment(cuda: bool) -> dict:
    import torch
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cpu_threads": torch.get_num_threads(),
    }
    if cuda:
        props = torch.cuda.get_device_properties(0)
        env.update(
            device_name=props.name,
            device_memory_gib=round(props.total_memory / GIB, 1),
            multiprocessors=props.multi_processor_count,
            torch_cuda=torch.version.cuda,
        )
    return env


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


def matmul_tflops(cuda: bool) -> float:
    """The measured dense matmul rate (bf16 8192^3 on CUDA, fp32 512^3 on CPU), median of 5 after warm-up."""
    import torch

    n, dtype, dev = (8192, torch.bfloat16, "cuda") if cuda else (512, torch.float32, "cpu")
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=dev, dtype=dtype, generator=g)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        a @ b
        sync()
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e12


def build_target(name: str, folder: Path, cuda: bool) -> Path:
    from trainer.demo.synth import random_target

    dtype = "bfloat16" if cuda else "float32"
    return random_target(folder, SHAPES[name], device="cuda" if cuda else "cpu", dtype=dtype)


def drafter_section(shape: dict, recipe: dict) -> dict:
    from trainer.preflight.drafter import suggest_aux_ids

    return {
        "num_layers": recipe["draft_layers"],
        "block_size": recipe["block_size"],
        "aux_layer_ids": suggest_aux_ids(shape["num_hidden_layers"], 5),
        "mask_token_id": shape["vocab_size"] - 5,
    }


def write_run_config(work: Path, target: Path, data: Path, shape: dict, recipe: dict, steps: int) -> Path:
    import yaml

    raw = {
        "target": {"path": str(target)},
        "data": {"path": str(data), "max_length": recipe["tokens"]},
        "drafter": drafter_section(shape, recipe),
        "train": {
            "max_steps": steps,
            "warmup_steps": 2,
            "max_tokens_per_batch": recipe["tokens"],
            "max_anchors": recipe["anchors"],
            "checkpoint_every": steps,
            "keep_checkpoints": 1,
        },
        "out_dir": str(work / "run"),
    }
    path = work / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def dflash(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run(
        [sys.executable, "-m", "trainer.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if res.returncode != 0:
        raise RuntimeError(
            f"dflash {args[0]} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        )
    return res


def step_flops(shape: dict, recipe: dict) -> float:
    """Matmul FLOPs of one step (approximate; attention causal): the target's no-grad forward over the
    batch, the drafter's forward+backward (3x its forward) over anchors*block query tokens, its fc over
    every token, and the frozen heads (drafter logits forward + input gradient, verifier logits forward)."""
    from trainer.layout.sizing import Shapes

    t, q = recipe["tokens"], recipe["anchors"] * recipe["block_size"]
    h, v, heads, hd = (
        shape["hidden_size"],
        shape["vocab_size"],
        shape["num_attention_heads"],
        shape["head_dim"],
    )
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
    target = shape["num_hidden_layers"] * (2 * layer * t + 2 * t * t * heads * hd)  # QK and AV, causal half
    drafter_layers = (
        recipe["draft_layers"] * 3 * (2 * layer * q + 4 * q * (t / 2 + recipe["block_size"]) * heads * hd)
    )
    fc = 3 * 2 * s.n_aux * h * h * t
    heads_flops = 2 * v * h * q * 3  # drafter logits fwd + input grad, verifier logits fwd
    return float(target + drafter_layers + fc + heads_flops)


def train_stage(
    cfg: Path, shape: dict, recipe: dict, cuda: bool, peak_tflops: float | None, timeout: float
) -> dict:
    import torch

    from trainer.config import load_config
    from trainer.events import load_events
    from trainer.preflight.machine import estimate_memory
    from trainer.target import TargetInfo

    t0 = time.perf_counter()
    dflash("train", "--config", str(cfg), timeout=timeout)
    wall = time.perf_counter() - t0
    run = load_config(cfg)
    steps = [e for e in load_events(run.out_dir / "events.jsonl") if e["event"] == "step"]
    if not steps:
        raise RuntimeError(f"dflash train wrote no step events into {run.out_dir}")
    warm = steps[len(steps) // 3 :] or steps  # the first third: compilation, allocator growth
    step_s = statistics.median(e["step_s"] for e in warm)
    predicted = estimate_memory(run, TargetInfo.from_folder(run.target.path), cuda, world_size=1)
    peak_key = "gpu_peak_gb" if cuda else "rss_gb"
    peak = max(e.get(peak_key) or 0.0 for e in steps)  # memory_snapshot's "gb" are GiB (2**30)
    flops = step_flops(shape, recipe)
    datasheet = datasheet_tflops(torch.cuda.get_device_name(0)) if cuda else None
    predicted_total = sum(predicted.values()) / GIB
    # what torch's allocator can see: everything but the CUDA context / library workspaces reserve
    predicted_allocated = predicted_total - predicted["runtime_reserve"] / GIB
    # held between steps: weights, optimizer state, frozen heads (one rank's gradients are freed after each
    # step: zero_grad(set_to_none=True); the rest is the step's peak)
    predicted_persistent = sum(predicted[k] for k in PERSISTENT_PARTS) / GIB
    persistent = steps[-1].get("gpu_allocated_gb")
    return {
        "steps": len(steps),
        "wall_s": round(wall, 1),
        "step_s_median": step_s,
        "target_s_median": statistics.median(e["target_s"] for e in warm),
        "drafter_s_median": statistics.median(e["drafter_s"] for e in warm),
        "tokens_per_s": statistics.median(e["tokens_per_s"] for e in warm),
        "loss_first": steps[0]["loss"],
        "loss_last": steps[-1]["loss"],
        "all_finite": all(e["loss"] is not None and e["grad_norm"] is not None for e in steps),
        "step_tflops": flops / 1e12,
        "achieved_tflops": flops / step_s / 1e12,
        "mfu_vs_datasheet": (flops / step_s / 1e12 / datasheet) if datasheet else None,
        "mfu_vs_measured_matmul": (flops / step_s / 1e12 / peak_tflops) if peak_tflops else None,
        "peak_memory_source": "torch.cuda.max_memory_allocated" if cuda else "process RSS (CPU)",
        "peak_memory_gib": peak,
        "predicted_memory_gib": round(predicted_total, 3),
        "predicted_allocated_gib": predicted_allocated,
        "predicted_by_part_gib": {k: round(v / GIB, 3) for k, v in predicted.items()},
        "measured_over_predicted": peak / predicted_allocated if predicted_allocated else None,
        "persistent_memory_gib": persistent,
        "predicted_persistent_gib": round(predicted_persistent, 3),
        "persistent_over_predicted": (persistent / predicted_persistent) if persistent else None,
        "transient_memory_gib": (peak - persistent) if persistent else None,
        "predicted_transient_gib": round(predicted_allocated - predicted_persistent, 3),
    }


def overhead_stage(target: Path, shape: dict, recipe: dict, work: Path, reps: int) -> dict:
    from online_overhead import part_a

    a = part_a(
        target,
        recipe["tokens"],
        reps,
        work,
        drafter=drafter_section(shape, recipe),
        anchors=recipe["anchors"],
    )
    return {
        "online_step_s": a["online_step_s"],
        "target_capture_s": a["target_capture_s"],
        "drafter_step_s": a["drafter_step_s"],
        "online_over_parts": a["ratio"],
    }


def eval_stage(
    target: Path, run_dir: Path, shape: dict, cuda: bool, work: Path, prompts: int, timeout: float
) -> dict:
    import numpy as np

    rng = np.random.default_rng(1)
    path = work / "prompts.jsonl"
    rows = [
        {"input_ids": rng.integers(10, shape["vocab_size"] - 10, size=32).tolist()} for _ in range(prompts)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = work / "eval" / "report.json"
    t0 = time.perf_counter()
    dflash(
        "eval",
        "--drafter", str(run_dir),
        "--target", str(target),
        "--prompts", str(path),
        "--device", "cuda" if cuda else "cpu",
        "--max-new-tokens", "48",
        "--check-lossless", "all",
        "--ignore-eos",
        "--out", str(report),
        timeout=timeout,
    )  # fmt: skip
    r = json.loads(report.read_text())
    return {"wall_s": round(time.perf_counter() - t0, 1), "prompts": prompts, **summarise_eval(r)}


def summarise_eval(r: dict) -> dict:
    """The figures of one drafter's `dflash eval` report (trainer/eval/run.py)."""
    ll = r["lossless"]
    return {
        "device": r["device"],
        "tau": r["tau"],
        "lossless_checked": ll["checked"],
        "lossless_matched": ll["matched"],
        "lossless_ok": ll["ok"],
        "tokens_per_s": r["tokens_per_s"],
        "target_alone_tokens_per_s": ll["target_tokens_per_s"],
        "warnings": r["warnings"],
    }


def check_shape(name: str, args, work: Path, cuda: bool, peak_tflops: float | None, deadline: float) -> dict:
    from online_overhead import make_dataset  # random ids, loss mask over the last 3/4

    shape = SHAPES[name]
    recipe = SMOKE_RECIPE if args.cpu_smoke else RECIPE
    out: dict = {"shape": name, "recipe": recipe, "config": shape}
    left = lambda: deadline - time.monotonic()  # noqa: E731
    t0 = time.perf_counter()
    target = build_target(name, work / "target", cuda)
    data = make_dataset(work / "data", shape["vocab_size"], recipe["tokens"], n=max(64, 2 * args.steps))
    out["build_s"] = round(time.perf_counter() - t0, 1)
    log(f"{name}: target and data built in {out['build_s']} s")
    if cuda:
        import torch

        torch.cuda.empty_cache()  # the builder's copy is gone; the trainer must see the whole GPU
    cfg = write_run_config(work, target, data, shape, recipe, args.steps)
    out["train"] = train_stage(cfg, shape, recipe, cuda, peak_tflops, timeout=max(60.0, left()))
    tr = out["train"]
    log(f"{name}: train {tr['tokens_per_s']:.0f} tok/s, peak {tr['peak_memory_gib']:.2f} GiB")
    if left() > 90 or args.cpu_smoke:
        out["overhead"] = overhead_stage(target, shape, recipe, work / "overhead", reps=args.reps)
        log(f"{name}: online/(parts) {out['overhead']['online_over_parts']:.3f}")
    else:
        out["overhead"] = {"skipped": f"{left():.0f} s left of the budget"}
    if left() > 45 or args.cpu_smoke:
        out["eval"] = eval_stage(
            target, work / "run", shape, cuda, work, args.eval_prompts, max(60.0, left())
        )
        log(f"{name}: eval tau {out['eval']['tau']}")
    else:
        out["eval"] = {"skipped": f"{left():.0f} s left of the budget"}
    return out


def fmt(v, spec: str = ".3g") -> str:
    return "-" if v is None else format(v, spec)


def table(report: dict) -> str:
    env = report["environment"]
    lines = [
        f"GPU check on {env.get('device_name', 'CPU')} (torch {env['torch']}, transformers "
        f"{env['transformers']}; matmul {fmt(report['matmul_tflops'])} TFLOP/s measured)",
        "shape      tok/s   step_s  MFU(ds)  MFU(mm) | peak GiB  pred  ratio | held GiB  pred | online/parts"
        " | tau  lossless",
    ]
    for s in report["shapes"]:
        if "error" in s:
            lines.append(f"{s['shape']:<9}  ERROR {s['error'][:90]}")
            continue
        t, o, e = s["train"], s.get("overhead", {}), s.get("eval", {})
        lines.append(
            f"{s['shape']:<9} {fmt(t['tokens_per_s'], '7.0f')} {fmt(t['step_s_median'], '7.3f')} "
            f"{fmt(t['mfu_vs_datasheet'], '7.1%')} {fmt(t['mfu_vs_measured_matmul'], '7.1%')}  | "
            f"{fmt(t['peak_memory_gib'], '8.2f')} {fmt(t['predicted_allocated_gib'], '5.1f')} "
            f"{fmt(t['measured_over_predicted'], '5.2f')} | {fmt(t['persistent_memory_gib'], '8.2f')} "
            f"{fmt(t['predicted_persistent_gib'], '5.1f')} | {fmt(o.get('online_over_parts'), '12.3f')} | "
            f"{fmt(e.get('tau'), '4.2f')} {e.get('lossless_matched')}/{e.get('lossless_checked')}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (the test suite's mode)")
    ap.add_argument(
        "--out", type=Path, default=None, help="report folder (default: $OUT, else reports/gpu-check)"
    )
    ap.add_argument("--shapes", default=None, help="comma-separated: " + ", ".join(SHAPES))
    ap.add_argument("--steps", type=int, default=None, help="training steps per shape (default 30; smoke 6)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions of the overhead timing (default 4)")
    ap.add_argument("--eval-prompts", type=int, default=4)
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip stages that would run past this")
    ap.add_argument(
        "--work", type=Path, default=None, help="scratch folder (targets, runs; default a temp dir)"
    )
    args = ap.parse_args(argv)
    started = time.monotonic()
    deadline = started + args.budget_s
    names = (args.shapes or ("tiny" if args.cpu_smoke else "qwen3-8b")).split(",")
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {', '.join(unknown)}: use {', '.join(SHAPES)}")
    args.steps = args.steps or (6 if args.cpu_smoke else 30)
    args.reps = args.reps or (2 if args.cpu_smoke else 4)
    out_dir = args.out or Path(os.environ.get("OUT") or REPO / "reports" / "gpu-check")
    out_dir.mkdir(parents=True, exist_ok=True)

    import torch

    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not cuda and not args.cpu_smoke:
        print("gpu-check: no CUDA device visible (run with --cpu-smoke for the CPU mode)", file=sys.stderr)
        return 2
    report: dict = {"mode": "cpu-smoke" if args.cpu_smoke else "cuda", "environment": environment(cuda)}
    report["matmul_tflops"] = matmul_tflops(cuda)
    log(f"matmul {report['matmul_tflops']:.1f} TFLOP/s; shapes {names}")
    report["shapes"] = []
    for name in names:
        work = Path(tempfile.mkdtemp(prefix=f"gpu-check-{name}-", dir=args.work))
        try:
            report["shapes"].append(check_shape(name, args, work, cuda, report["matmul_tflops"], deadline))
        except Exception as exc:  # one shape's failure is a row of the report, not the end of the check
            log(f"{name}: FAILED {exc}")
            report["shapes"].append({"shape": name, "error": f"{type(exc).__name__}: {exc}"[-4000:]})
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if cuda:
            torch.cuda.empty_cache()
        if time.monotonic() > deadline:
            break
    report["wall_s"] = round(time.monotonic() - started, 1)
    tmp = out_dir / (REPORT + ".tmp")
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(out_dir / REPORT)
    print(table(report))
    print(f"report: {out_dir / REPORT} ({report['wall_s']} s)")
    return 0 if all("error" not in s for s in report["shapes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
