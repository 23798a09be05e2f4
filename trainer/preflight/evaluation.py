"""The `eval:` gate: the child that measures tau while training (trainer/training/evaluation.py) has a place
and its prompts. Counted with the plan's own arithmetic (trainer/layout/inference.py `plan_harness`, the
drafter from trainer/layout/eval_memory.py, the trainer's estimate from machine.py):

- `eval.device: cuda:N[,M...]`: GPUs this node has, none of them a trainer rank's or the vLLM server's,
  and together holding the harness (the target spread by device_map, the fp32 drafter on the first);
- `eval.device: trainer` on a GPU: rank 0's GPU holds the trainer's estimate and the whole harness;
- a named benchmark set (`eval.prompts: gsm8k`): found in the Hugging Face cache this process sees
  (HF_HOME: the trainer_service role sets a node-wide one), since the unit runs offline. A missing set
  is a warning: an evaluation that fails is never the run's failure (eval_failed events).

torch is imported only to count the GPUs and their memory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.layout.eval_child import eval_gpus
from trainer.layout.eval_memory import eval_drafter
from trainer.layout.recipe import ASSUMPTIONS, GIB, PlanError, read_target
from trainer.preflight.report import PreflightReport

if TYPE_CHECKING:
    from trainer.config.run import RunConfig
    from trainer.target.info import TargetInfo

FIX = (
    "let `dflash plan --config RUN.yaml` place it (it sets eval.device to GPUs kept out of training, "
    "or names the choices), set eval.device: cpu, or remove eval: and run `dflash eval` on the checkpoints"
)


def visible_gpu_memory() -> list[int]:
    """Total bytes of each CUDA device this process sees (none without CUDA)."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]


def trainer_gpus(cfg: RunConfig) -> set[int]:
    """The node GPUs the run's own processes take: the trainer ranks' (from 0, gpus_per_copy each) and
    the vLLM server's (target.vllm.gpus)."""
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or 1)
    per_rank = cfg.target.gpus_per_copy if cfg.target.source == "hooked" else 1
    return set(range(ranks * per_rank)) | set(cfg.target.vllm.gpus or [])


def eval_gate(cfg: RunConfig, target: TargetInfo | None, report: PreflightReport) -> None:
    e = cfg.eval
    if not e.enabled:
        return
    _prompt_set(cfg, report)
    if target is None or e.device == "cpu":
        return
    gpus = visible_gpu_memory()
    if not gpus:
        report.machine["evaluation"] = {
            "skipped": "no CUDA device here: the evaluation's GPUs are not checked"
        }
        return
    try:
        t = read_target(cfg.target.path, "bfloat16" if cfg.target.dtype == "auto" else cfg.target.dtype)
    except PlanError:
        return  # the target gate reports it
    s = target.shapes(cfg, 2 if cfg.target.dtype in ("auto", "bfloat16", "float16") else 4)
    drafter = eval_drafter(s, ASSUMPTIONS["inference_tokens_per_sequence"], cfg.drafter.block_size)
    from trainer.layout.inference import plan_harness

    asked = eval_gpus(e.device)
    if not asked:  # trainer: rank 0's GPU holds both
        from trainer.preflight.machine import estimate_memory

        trainer = sum(estimate_memory(cfg, target, True).values())
        h = plan_harness(t, gpus[0] / GIB, 1, drafter=drafter)
        need = trainer + h["per_gpu_gib"] * GIB
        report.machine["evaluation"] = {"device": "trainer", "need_gib": need / GIB, "gpu_gib": gpus[0] / GIB}
        if need > gpus[0] * ASSUMPTIONS["usable_share"]:
            report.error(
                "eval.no_room",
                f"eval.device trainer: rank 0's GPU ({gpus[0] / GIB:.1f} GiB) cannot hold the trainer "
                f"(~{trainer / GIB:.1f} GiB) and the evaluation's target and fp32 drafter "
                f"(~{h['per_gpu_gib']} GiB) together",
                FIX,
            )
        return
    missing = [g for g in asked if g >= len(gpus)]
    taken = sorted(set(asked) & trainer_gpus(cfg))
    if missing or taken:
        why = f"GPU(s) {missing} are not on this node ({len(gpus)} visible)" if missing else ""
        why += ("; " if why and taken else "") + (f"GPU(s) {taken} are the run's own" if taken else "")
        report.error("eval.gpus", f"eval.device {e.device}: {why}", FIX)
        return
    memory = min(gpus[g] for g in asked) / GIB
    h = plan_harness(t, memory, len(asked), gpus=len(asked), drafter=drafter)
    report.machine["evaluation"] = {"device": e.device, "need_gib": h["per_gpu_gib"], "fits": h["fits"]}
    if not h["fits"]:
        report.error("eval.no_room", f"eval.device {e.device}: {h['reason']}", FIX)


def _prompt_set(cfg: RunConfig, report: PreflightReport) -> None:
    from trainer.eval.benchmarks import BENCHMARKS, BenchmarkError, fetch

    name = cfg.eval.prompts
    if name is None or name not in BENCHMARKS or Path(name).exists():
        return
    try:
        report.machine["eval_prompts"] = str(fetch(name))
    except BenchmarkError as exc:
        report.warn(
            "eval.prompt_set_missing",
            f"eval.prompts {name}: {exc}: every evaluation of this run would fail",
            f"fetch it once into that cache where the Hub is reachable (HF_HOME={_hf_home()} "
            f"hf download {BENCHMARKS[name].repo} {BENCHMARKS[name].filename} --repo-type dataset), "
            "or give eval.prompts a prompt file",
        )


def _hf_home() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HOME)
