#!/usr/bin/env python3
"""The GPU check: every CUDA path of `dflash train` and `dflash eval` that one GPU can hold, stage by
stage, on a random-weight target built on the spot (bf16, no download). docs/gpu-check.md says how to
read it.

Stages (each independent: one that fails is recorded and the next runs; each timed, each with its peak
memory beside the memory model's prediction for its own run config):
  hooked     `dflash train`, target hooked in process, flex attention (compiled by speculators)
  chunked    the same with `train.loss_chunk_rows` (chunked_loss.py; flex attention must run compiled)
  zero1      `train.shard: optimizer` (DDP + ZeRO-1) in a process group of one (one_rank.py)
  fsdp2      `train.shard: full` (FSDP2) in a process group of one
  dp2        two data-parallel ranks (torchrun, NCCL), one GPU each   [two GPUs; else skipped, saying so]
  copy2      `target.gpus_per_copy: 2`: one target copy over two GPUs   [the same]
  eval       `dflash eval` (harness), every prompt checked lossless against the target's greedy decoding
  vllm       `target.source: vllm`: the run's own vLLM server and the trainer sharing the GPU
  eval_both  `dflash eval --engine both`: the harness, then vLLM serving the drafter
  overhead   the online step against its two parts alone (bench/online_overhead.py part a)
Before the stages it records the toolchain (toolchain.py: driver, CUDA, torch, Triton, the ptxas Triton
uses for this GPU, NCCL, the C compiler, Python.h) and where the stages run: where systemd runs, each in a
transient unit with the product's sandbox (unit.py, rendered from the role's template), else outside a
unit, saying why (`--unit auto|on|off`).
The report (JSON + the table) is rewritten after EACH stage (a temporary file, then a rename), so a call
that runs out of time still brings back everything that finished: REPORT and TABLE in --out, else $OUT,
else reports/gpu-check, with the end of each stage's log in LOGS.

Modes: --quick (the first call on a lent machine: a Qwen3-1.7B shape, a few steps, ~5 minutes), the
default full run (Qwen3-8B shape, the seeds' recipe), --cpu-smoke (the test suite's: every stage on the
CPU with a tiny target, each stage's process forked from one pre-imported interpreter: zygote.py).

Usage: python3 bench/gpu/check.py [--quick | --cpu-smoke] [--out DIR] [--shapes NAME[,NAME]]
       [--stages NAME[,NAME]] [--steps N] [--budget-s S]
On the lent H200 with its carried wheels: bash bench/gpu/run.sh --quick, then bash bench/gpu/run.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE), str(REPO), str(REPO / "bench")]

import served  # noqa: E402
import stages  # noqa: E402
import toolchain  # noqa: E402
import unit  # noqa: E402
from common import GIB, MODES, SHAPES, ZYGOTE, Ctx, PeakSampler, Service, Skip, log  # noqa: E402

REPORT, TABLE, LOGS = "gpu-check.json", "gpu-check.txt", "gpu-check-logs.txt"
# the order they run in: the cheap and the most telling first (a time-out cuts the tail)
STAGES = {
    "hooked": stages.hooked,
    "chunked": stages.chunked,
    "zero1": stages.zero1,
    "fsdp2": stages.fsdp2,
    "dp2": stages.dp2,
    "copy2": stages.copy2,
    "eval": stages.harness_eval,
    "vllm": served.vllm_source,
    "eval_both": served.eval_both,
    "overhead": stages.overhead,
}


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
            device_count=torch.cuda.device_count(),
        )
    return env


def versions(work: Path) -> dict:
    """toolchain.py's record, taken where the stages run: in a transient unit when they do (its PATH,
    CC and TRITON_* are the service's), else in this process (the stages inherit its environment)."""
    from common import run_logged

    if Service.unit is None:
        return {**toolchain.collect(), "taken": "in the check's process (the stages' environment)"}
    out = work / "toolchain.json"
    cmd = [sys.executable, str(HERE / "toolchain.py"), str(out)]
    try:
        run_logged("toolchain.py", cmd, work / "toolchain.log", 120)
        return {**json.loads(out.read_text()), "taken": "in a transient unit (the stages' environment)"}
    except Exception as exc:  # the unit could not run it: say so, and what this process sees
        own = toolchain.collect()
        return {
            **own,
            "taken": f"in the check's process: the unit failed ({type(exc).__name__}: {exc})"[:2000],
        }


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


class Report:
    """The report, rewritten whole (JSON, table) after every change: temp file, then rename."""

    def __init__(self, out_dir: Path, data: dict):
        self.out_dir, self.data = out_dir, data

    def save(self) -> None:
        for name, text in ((REPORT, json.dumps(self.data, indent=2)), (TABLE, table(self.data) + "\n")):
            tmp = self.out_dir / (name + ".tmp")
            tmp.write_text(text)
            tmp.replace(self.out_dir / name)


def run_stage(ctx: Ctx, name: str, shape_rec: dict, report: Report) -> dict:
    left = ctx.left()
    if left < ctx.mode.min_left_s:
        rec = {"status": "skipped", "reason": f"{left:.0f} s left of the budget"}
    else:
        shape_rec["running"] = name
        report.save()
        t0, cpu0 = time.perf_counter(), cpu_seconds()
        sampler = PeakSampler(ctx.cuda)
        try:
            with sampler:
                rec = {"status": "ok", **STAGES[name](ctx, sampler, min(ctx.mode.stage_cap_s, left))}
        except Skip as exc:
            rec = {"status": "skipped", "reason": str(exc)}
        except Exception as exc:  # a stage's failure is its record, not the end of the check
            rec = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"[-4000:]}
        rec["wall_s"] = round(time.perf_counter() - t0, 1)
        rec["cpu_s"] = round(cpu_seconds() - cpu0, 1)  # this process's and its finished children's
        rec["device_peak_gib"] = (
            sampler.peak_gib
        )  # everything on the device (RSS of the stage's processes on a CPU)
        rec["device_before_gib"] = round(sampler.baseline / GIB, 3)
        shape_rec.pop("running", None)
        for path in (ctx.work / f"{name}.log", ctx.work / name / "vllm-server.log"):
            append_log(ctx, name, path)
    ctx.done[name] = shape_rec["stages"][name] = rec
    report.save()
    log(f"{ctx.shape_name} {name}: {rec['status']} {rec.get('wall_s', '-')} s {why(rec) or notes(rec)}")
    return rec


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    forked = ZYGOTE.cpu_s  # --cpu-smoke's stage processes are the zygote's children, not ours
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + forked


def append_log(ctx: Ctx, stage: str, path: Path) -> None:
    if path.is_file():
        lines = path.read_text(errors="replace").splitlines()[-60:]
        with open(ctx.logs, "a") as f:
            f.write(f"===== {ctx.shape_name} {stage}: {path.name} (last {len(lines)} lines)\n")
            f.write("\n".join(lines) + "\n")


def check_shape(name: str, args, mode, cuda: bool, report: Report, deadline: float) -> None:
    from online_overhead import make_dataset  # random ids, loss mask over the last 3/4

    from trainer.demo.synth import random_target

    shape = SHAPES[name]
    rec: dict = {"shape": name, "recipe": mode.recipe, "config": shape, "stages": {}}
    report.data["shapes"].append(rec)
    work = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=args.work_root))
    try:
        t0 = time.perf_counter()
        dtype = "bfloat16" if cuda else "float32"
        target = random_target(work / "target", shape, device="cuda" if cuda else "cpu", dtype=dtype)
        n = max(32, 2 * mode.steps)
        data = make_dataset(work / "data", shape["vocab_size"], mode.recipe["tokens"], n=n)
        if cuda:
            import torch

            torch.cuda.empty_cache()  # the builder's copy is gone; the stages must see the whole GPU
        rec["build_s"] = round(time.perf_counter() - t0, 1)
        log(f"{name}: target and data built in {rec['build_s']} s")
        report.save()
        ctx = Ctx(
            mode, cuda, work, name, shape, target, data, deadline, report.data["matmul_tflops"], args.logs
        )
        for stage in args.stages:
            run_stage(ctx, stage, rec, report)
    except Exception as exc:  # the build failed: no stage can run on this shape
        rec["error"] = f"{type(exc).__name__}: {exc}"[-4000:]
        log(f"{name}: FAILED {rec['error'][:300]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        report.save()


def fmt(v, spec: str = ".3g") -> str:
    return "-" if v is None else format(v, spec)


def table(report: dict) -> str:
    env = report.get("environment", {})
    count = f"{env['device_count']} x " if env.get("device_count") else ""
    service = report.get("service", {})
    lines = [
        f"GPU check ({report['mode']}) on {count}{env.get('device_name', 'CPU')} (torch {env.get('torch')}, "
        f"transformers {env.get('transformers')}; matmul {fmt(report.get('matmul_tflops'))} TFLOP/s measured)"
        + ("" if report.get("complete") else "  [INCOMPLETE: written after each stage]"),
        "toolchain: " + (toolchain.summary(report["versions"]) if report.get("versions") else "-"),
        "stages ran "
        + service.get("reason", "-")
        + (f" ({len(service['properties'])} properties)" if service.get("properties") else ""),
        "shape      stage      status    wall_s   tok/s  MFU(ds) | peak GiB  pred  ratio | device GiB"
        " | notes",
    ]
    for s in report.get("shapes", []):
        if "error" in s:
            lines.append(f"{s['shape']:<10} (build)    FAILED   {s['error'][:90]}")
        for name, r in s["stages"].items():
            note = why(r)[:100] or notes(r)
            lines.append(
                f"{s['shape']:<10} {name:<10} {r['status']:<8} {fmt(r.get('wall_s'), '7.1f')} "
                f"{fmt(r.get('tokens_per_s'), '7.0f')} {fmt(r.get('mfu_vs_datasheet'), '7.1%')}  | "
                f"{fmt(r.get('peak_memory_gib'), '8.2f')} {fmt(r.get('predicted_allocated_gib'), '5.1f')} "
                f"{fmt(r.get('measured_over_predicted'), '5.2f')} | "
                f"{fmt(r.get('device_peak_gib'), '10.2f')} | {note}"
            )
        if s.get("running"):
            lines.append(f"{s['shape']:<10} {s['running']:<10} RUNNING (the call ended during this stage)")
    return "\n".join(lines)


def why(r: dict) -> str:
    """A skipped stage's reason, a failed one's first line of error; "" for one that ran."""
    text = r.get("reason") or r.get("error") or ""
    return text.splitlines()[0] if text else ""


def notes(r: dict) -> str:
    bits = list(r.get("problems", []))
    if "tau" in r:
        bits.append(
            f"tau {fmt(r['tau'], '.2f')} lossless {r['lossless_matched']}/{r['lossless_checked']}"
            + (f" +{r['lossless_near_ties']} near-tie" if r.get("lossless_near_ties") else "")
        )
    if r.get("served_tau") is not None:
        bits.append(f"vLLM tau {fmt(r['served_tau'], '.2f')}")
    if "online_over_parts" in r:
        bits.append(f"online/parts {fmt(r['online_over_parts'], '.3f')}")
    if r.get("loss_first_vs_hooked") is not None:
        bits.append(f"first loss - hooked's {fmt(r['loss_first_vs_hooked'], '.2g')}")
    if r.get("shard"):
        bits.append(f"shard {r['shard']}")
    if r.get("device_predicted_gib") is not None:
        bits.append(f"device pred {fmt(r['device_predicted_gib'], '.1f')}")
    return "; ".join(bits)


def parse(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--quick", action="store_true", help="the first call: small shape, few steps (~5 min)")
    which.add_argument("--cpu-smoke", action="store_true", help="every stage on the CPU, tiny (the suite's)")
    ap.add_argument(
        "--out", type=Path, default=None, help="report folder (default $OUT, else reports/gpu-check)"
    )
    ap.add_argument("--shapes", default=None, help="comma-separated: " + ", ".join(SHAPES))
    ap.add_argument("--stages", default=None, help="comma-separated, in this order: " + ", ".join(STAGES))
    ap.add_argument("--steps", type=int, default=None, help="steps of the hooked stage (the others: fewer)")
    ap.add_argument(
        "--optimizer",
        choices=("adamw", "muon"),
        default=None,
        help="train.optimizer of every training stage (default: the run config's default)",
    )
    ap.add_argument(
        "--budget-s", type=float, default=None, help="no stage starts past this (quick 390, full 480)"
    )
    ap.add_argument(
        "--no-zygote",
        action="store_true",
        help="--cpu-smoke: each stage a fresh process, as on a GPU (default: forked from one that has "
        "imported torch and the trainer once, zygote.py)",
    )
    ap.add_argument(
        "--work",
        type=Path,
        default=None,
        help="scratch folder (targets, runs; default a temp dir, in build/ when the stages run in units: "
        "their /tmp is private)",
    )
    ap.add_argument(
        "--unit",
        choices=("auto", "on", "off"),
        default="auto",
        help="each stage in a transient unit with the product's sandbox: where systemd runs (auto), "
        "required (on), never (off)",
    )
    args = ap.parse_args(argv)
    args.mode = "cpu-smoke" if args.cpu_smoke else "quick" if args.quick else "full"
    mode = MODES[args.mode]
    names = (args.shapes or mode.shape).split(",")
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {', '.join(unknown)}: use {', '.join(SHAPES)}")
    args.shapes = names
    args.stages = (args.stages or ",".join(STAGES)).split(",")
    bad = [s for s in args.stages if s not in STAGES]
    if bad:
        ap.error(f"unknown stage(s) {', '.join(bad)}: use {', '.join(STAGES)}")
    for v, flag in ((args.steps, "--steps"), (args.budget_s, "--budget-s")):
        if v is not None and v <= 0:
            ap.error(f"{flag} must be positive")
    if args.steps:
        mode = replace(mode, steps=args.steps, other_steps=min(mode.other_steps, args.steps))
    if args.budget_s:
        mode = replace(mode, budget_s=args.budget_s)
    if args.optimizer:
        mode = replace(mode, recipe={**mode.recipe, "optimizer": args.optimizer})
    return args, mode


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args, mode = parse(argv)
    out_dir = args.out or Path(os.environ.get("OUT") or REPO / "reports" / "gpu-check")
    import torch

    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not cuda and not args.cpu_smoke:
        print("gpu-check: no CUDA device visible (run with --cpu-smoke for the CPU mode)", file=sys.stderr)
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    args.logs = out_dir / LOGS
    args.logs.write_text("")
    in_unit, reason = unit.decide(args.unit, cuda)
    parent = args.work or ((REPO / "build") if in_unit else None)  # a unit's /tmp is its own
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    args.work_root = Path(tempfile.mkdtemp(prefix="gpu-check-", dir=parent))
    Service.reason = reason
    if in_unit:
        Service.unit = unit.Unit(args.work_root, cuda)
    log(f"stages run {reason}")
    data = {
        "mode": mode.name,
        "complete": False,
        "budget_s": mode.budget_s,
        "stages_planned": args.stages,
        "environment": environment(cuda),
        "service": {"unit": in_unit, "reason": reason, **(Service.unit.record() if in_unit else {})},
        "versions": None,
        "matmul_tflops": None,
        "shapes": [],
    }
    report = Report(out_dir, data)
    report.save()
    data["versions"] = versions(args.work_root)
    log("toolchain: " + toolchain.summary(data["versions"]))
    report.save()
    if args.cpu_smoke and not args.no_zygote and not in_unit:  # a unit's process is systemd's child
        ZYGOTE.start()  # imports while the target is built; forks each stage's process (zygote.py)
    data["matmul_tflops"] = matmul_tflops(cuda)
    log(
        f"{mode.name}: matmul {data['matmul_tflops']:.3g} TFLOP/s; shapes {args.shapes}; stages {args.stages}"
    )
    deadline = started + mode.budget_s
    try:
        for name in args.shapes:
            check_shape(name, args, mode, cuda, report, deadline)
    finally:
        ZYGOTE.stop()
        shutil.rmtree(args.work_root, ignore_errors=True)
    data["wall_s"] = round(time.monotonic() - started, 1)
    data["complete"] = True
    report.save()
    print(table(data))
    print(f"report: {out_dir / REPORT} ({data['wall_s']} s)")
    ran = [r for s in data["shapes"] for r in s["stages"].values()]
    bad = any("error" in s for s in data["shapes"]) or any(
        r["status"] == "failed" or r.get("problems") for r in ran
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
