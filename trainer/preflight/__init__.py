"""Preflight: every check that can refuse a run, done in seconds before any GPU time is spent.

Five gates, each listing every problem it finds (a run is refused on any error; warnings inform):

- data (data.py): supervised tokens per sample (histogram), short responses, samples the loop would
  drop (no two consecutive supervised tokens, longer than data.max_length, input_ids/loss_mask length
  mismatch), token ids outside the target vocabulary;
- config: the target folder and, for `target.source: vllm`, what starting or using a server needs
  (target.py) and whether vLLM runs the target's family there in the server's dtype (vllm_family.py);
  the aux layer ids (in speculators' convention, after conversion), the mask token, the
  block size, and a warm-start checkpoint's wiring (fc width, aux ids, hidden size) (drafter.py);
- machine (machine.py): the device (`train.device: cuda` without CUDA, or `auto` on a machine whose
  NVIDIA GPUs torch cannot use, is refused: trainer/device.py), free disk for the parts of the run
  still to be written (disk.py: the budget `dflash plan` prints), a memory estimate against the
  device, and /dev/shm for a vLLM server the run starts (shm.py); for a hybrid target on CUDA, the
  linear-attention kernels transformers looks for (kernels.py: a warning when it would fall back to its
  reference PyTorch code);
- evaluation (evaluation.py): the `eval:` child's GPUs (free of the run's own, holding the target and
  the fp32 drafter) and its named benchmark set in the Hugging Face cache;
- trackers (trackers.py): the package of every tracker `report_to` names is installed.

The findings and their rendering are in report.py. Light side: model folders are read by
trainer/target/info.py (config.json as JSON, safetensors files by their headers only); no transformers or
speculators import. torch is imported only to ask CUDA whether it is there and for its free memory.
`run_preflight` is the entry of `dflash preflight` and of `dflash train`. Docs: docs/preflight.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trainer.preflight.data import data_gate
from trainer.preflight.disk import disk_gate
from trainer.preflight.drafter import aux_gate, drafter_gate, warm_start_gate
from trainer.preflight.evaluation import eval_gate
from trainer.preflight.kernels import kernels_gate
from trainer.preflight.machine import device_gate, memory_gate
from trainer.preflight.report import PreflightReport
from trainer.preflight.shm import shm_gate
from trainer.preflight.target import source_gate, target_gate
from trainer.preflight.trackers import trackers_gate
from trainer.preflight.vllm_family import vllm_family_gate

if TYPE_CHECKING:
    from trainer.config.run import RunConfig
    from trainer.target.info import TargetInfo

__all__ = ["PreflightReport", "run_preflight"]


def run_preflight(cfg: RunConfig) -> PreflightReport:
    """Run every gate on a validated run config and return all findings (never raises on bad inputs;
    an unexpected failure inside a gate becomes a `preflight.internal_error` problem)."""
    report = PreflightReport()
    target = _guarded(report, "target", lambda: target_gate(cfg, report))
    gates: list[tuple[str, Callable[[RunConfig, TargetInfo | None, PreflightReport], None]]] = [
        ("hidden-state source", source_gate),
        ("vLLM family", vllm_family_gate),
        ("aux ids", aux_gate),
        ("drafter", drafter_gate),
        ("warm start", warm_start_gate),
        ("data", data_gate),
        ("device", device_gate),
        ("linear-attention kernels", kernels_gate),
        ("disk", disk_gate),
        ("shared memory", shm_gate),
        ("memory", memory_gate),
        ("evaluation", eval_gate),
        ("trackers", trackers_gate),
    ]
    for name, gate in gates:
        _guarded(report, name, lambda gate=gate: gate(cfg, target, report))
    return report


def _guarded(report: PreflightReport, name: str, call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception as exc:  # one broken gate must not hide the others' findings
        report.error(
            "preflight.internal_error",
            f"the {name} check failed unexpectedly: {type(exc).__name__}: {exc}",
            "report this as a dflash bug (with `dflash preflight --json` output); the other checks still ran",
        )
        return None
