"""τ measured while training (the run config's `eval:` section): the loop's evaluation component.

Global rank 0 evaluates the checkpoint it just wrote with `dflash eval` in a child process, one at a
time, while the trainer goes on: the trainer never waits for an evaluation except after the final
checkpoint, and no evaluation takes part in a collective, so the other ranks never wait on one
(docs/train.md, "τ while training", says why a child process). The checkpoint's files are hard-linked
into `out_dir/evals/<checkpoint>/drafter/` first, so rotation (`train.keep_checkpoints`) cannot take
them away mid-evaluation; the report stays in `out_dir/evals/<checkpoint>/`, the links go when it is done.

When the evaluation ends, the run writes an `eval` event with `tau` (the fields `dflash eval` records
for a checkpoint: trainer.eval.record.eval_event_fields) through its own event stream, so the monitor,
the trackers and salvage read it like any event. An evaluation that fails is a `warning` event
(`eval_failed`), never the run's failure. A checkpoint due while one runs waits its turn (at most
MAX_WAITING wait: past that the oldest waiting one is dropped, said in a warning, so a cadence faster
than the evaluations cannot pile up work for the run's end).

Light side: the component starts and polls a process; the loop hands it a collective (`any_rank`) for
the final wait."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.config.eval import holdout_file
from trainer.eval.record import eval_event_fields

EVALS_DIR = "evals"
DRAFTER_FILES = ("config.json", "model.safetensors")  # a speculators folder: what `dflash eval` loads
LOG_TAIL = 2000
MAX_WAITING = 4


@dataclass
class Job:
    step: int
    name: str  # the checkpoint's folder name
    folder: Path  # out_dir/evals/<name>
    started: float = 0.0
    proc: subprocess.Popen | None = None


def eval_device(setting: str, trainer_device: str) -> tuple[str, str]:
    """(`dflash eval --device`, CUDA_VISIBLE_DEVICES) for the `eval.device` setting: `trainer` is
    rank 0's own device (its GPU as the node numbers it, through the trainer's own
    CUDA_VISIBLE_DEVICES; the CPU when it trains there), `cuda:N[,M...]` the node's GPUs N, M, ...
    (`dflash eval` then spreads the target over them as trainer/layout/inference.py plans it, the
    drafter on the first), `cpu` no GPU."""
    if setting == "cpu" or (setting == "trainer" and not trainer_device.startswith("cuda")):
        return "cpu", ""
    if setting == "trainer":  # an index among the GPUs the trainer sees
        index = int(trainer_device.split(":", 1)[1]) if ":" in trainer_device else 0
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        return "cuda", visible[index] if index < len(visible) else str(index)
    return "cuda", setting.split(":", 1)[1]


def eval_command(cfg, checkpoint: Path, report: Path, device: str) -> list[str]:
    """The `dflash eval` command line of one evaluation (the harness: chain τ, a tree at the budget)."""
    e = cfg.eval
    cmd = [sys.executable, "-m", "trainer.cli", "eval", "--drafter", str(checkpoint)]
    cmd += ["--target", str(cfg.target.path), "--prompts", e.prompt_source(cfg.out_dir)]
    cmd += ["--out", str(report)]
    cmd += ["--max-new-tokens", str(e.max_new_tokens), "--device", device]
    cmd += ["--check-lossless", "all" if e.check_lossless < 0 else str(e.check_lossless)]
    if e.limit:
        cmd += ["--limit", str(e.limit)]
    if e.tree_budget:
        cmd += ["--tree-budget", str(e.tree_budget)]
    return cmd


def link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links refused: a copy (the drafter's weights only)
        shutil.copy2(src, dst)


def _die_with_parent() -> None:  # the child's pre-exec: SIGTERM when the trainer goes (Linux)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class TrainingEval:
    """The loop's interface: `after_step` on every rank after each step, `finish` on every rank at
    the end, `close` on the way out (a failed run). No-ops without `eval.prompts` or `eval.holdout`;
    the evaluations themselves are rank 0's."""

    def __init__(
        self, cfg, is_main: bool, trainer_device: str, emit: Callable[..., Any], log: Callable[[str], None]
    ):
        self.cfg, self.is_main, self.emit, self.log = cfg, is_main, emit, log
        self.enabled = cfg.eval.enabled
        self.device, self.visible = eval_device(cfg.eval.device, trainer_device) if self.enabled else ("", "")
        self.running: Job | None = None
        self.waiting: list[Job] = []
        self.submitted: set[int] = set()

    def due(self, step: int) -> bool:
        """An evaluation at this step: every `eval.every_steps` (the final checkpoint: `submit_final`)."""
        every = self.cfg.eval.every_steps if self.enabled else None
        return bool(every and step % every == 0)

    def after_step(
        self, step: int, stop_now: bool, saved_step: int | None, save: Callable[[str], Any]
    ) -> None:
        """On every rank after each step: at every `eval.every_steps` steps, this step's checkpoint
        (`save("eval")` writes it, a collective, unless a periodic one was just written) goes to rank
        0's evaluation, which runs beside the training; then a finished evaluation becomes its event."""
        if self.due(step) and not stop_now:
            if saved_step != step:
                save("eval")
            self.submit(step, self.checkpoint(step))
        self.poll()

    def finish(
        self, final_saved: bool, step: int, any_rank: Callable[[bool], bool], stopped: Callable[[], bool]
    ) -> None:
        """On every rank at the end: a completed run whose final checkpoint is at `step`
        (`final_saved`) evaluates it and waits for every evaluation (`drain`); then none is left."""
        if final_saved:
            if step not in self.submitted:
                self.submit(step, self.checkpoint(step))
            self.drain(any_rank, stopped)
        self.close()

    def checkpoint(self, step: int) -> Path:
        from trainer.store import checkpoint as ckpt

        return ckpt.checkpoints_dir(self.cfg.out_dir) / ckpt.checkpoint_name(step)

    def submit(self, step: int, checkpoint: Path) -> None:
        """Evaluate `checkpoint` (just written at `step`): now, or after the running evaluation."""
        if not (self.enabled and self.is_main):
            return
        self.submitted.add(step)
        folder = Path(self.cfg.out_dir) / EVALS_DIR / checkpoint.name
        drafter = folder / "drafter"
        if folder.exists():  # a run resumed before this step: its evaluation again
            shutil.rmtree(folder)
        drafter.mkdir(parents=True)
        for name in DRAFTER_FILES:
            link_or_copy(checkpoint / name, drafter / name)
        self.waiting.append(Job(step, checkpoint.name, folder))
        if len(self.waiting) > MAX_WAITING:
            self.skip(self.waiting.pop(0), f"{MAX_WAITING} newer checkpoints wait for their evaluation")
        self.poll()

    def poll(self) -> bool:
        """Collect a finished evaluation (its event), start a waiting one. True while one runs."""
        if not (self.enabled and self.is_main):
            return False
        job = self.running
        if job is not None and job.proc is not None and job.proc.poll() is not None:
            self.running = None
            self.finished(job, job.proc.returncode)
        if self.running is None and self.waiting:
            self.running = self.waiting.pop(0)
            self.start(self.running)
        return self.running is not None

    def drain(
        self,
        any_rank: Callable[[bool], bool],
        stopped: Callable[[], bool] = lambda: False,
        poll_s: float = 1.0,
    ) -> None:
        """After the final checkpoint, on every rank: wait until every evaluation is done, or the run
        is asked to stop (then `close` stops them). Each wait is one short collective (`any_rank` of
        "still running"), so no rank sits in one collective for longer than `poll_s` and
        `train.collective_timeout_s` never runs out."""
        if not self.enabled:
            return
        t0 = time.monotonic()
        while any_rank(self.poll() and not stopped()):
            time.sleep(poll_s)
        if self.is_main:
            self.log(f"final evaluation waited for: {time.monotonic() - t0:.1f}s")

    def close(self) -> None:
        """Stop a running evaluation (the run stops or fails); a waiting one never starts. One that
        has just ended still becomes its event."""
        job = self.running
        if job is not None and job.proc is not None and job.proc.poll() is not None:
            self.running = None
            self.finished(job, job.proc.returncode)
        for job in [self.running, *self.waiting]:
            if job is not None:
                self.skip(job, "the run ended first")
        self.running, self.waiting = None, []

    # ------------------------------------------------------------------ the child process
    def start(self, job: Job) -> None:
        report = job.folder / "report.json"
        cmd = eval_command(self.cfg, job.folder / "drafter", report, self.device)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=self.visible)
        env.pop("DFLASH_RUN_ID", None)
        for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(var, None)  # torchrun's: the evaluation is no rank of the run
        with os.fdopen(
            os.open(job.folder / "eval.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb"
        ) as out:
            job.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent
            )
        job.started = time.monotonic()
        self.log(
            f"evaluating {job.name} (step {job.step}) on {self.device or 'cpu'}: {job.folder / 'eval.log'}"
        )

    def finished(self, job: Job, rc: int) -> None:
        report_path = job.folder / "report.json"
        seconds = round(time.monotonic() - job.started, 3)
        shutil.rmtree(job.folder / "drafter", ignore_errors=True)
        try:
            report = json.loads(report_path.read_text())
        except (OSError, ValueError):
            report = None
        if report is None or rc not in (0, 1):  # 1: a lossless check failed, the report is written
            tail = (job.folder / "eval.log").read_bytes()[-LOG_TAIL:].decode(errors="replace")
            self.warn(job, f"dflash eval exited {rc} without a report: {tail.strip()}")
            return
        self.emit("eval", **eval_event_fields(report, report_path, job.step, job.name), eval_s=seconds)
        trees = " ".join(f"tree {t['budget']}: τ {t['tau']:.3f}" for t in report.get("trees") or [])
        self.log(f"eval {job.name}: τ {report['tau']:.3f} {trees} ({seconds:.1f}s)".rstrip())

    def skip(self, job: Job, why: str) -> None:
        """Stop a job (its process, when it runs) and say so."""
        if job.proc is not None and job.proc.poll() is None:
            job.proc.terminate()
            try:
                job.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                job.proc.kill()
                job.proc.wait()
        # one that never started leaves nothing; a stopped one its log
        shutil.rmtree(job.folder if job.proc is None else job.folder / "drafter", ignore_errors=True)
        self.warn(job, f"evaluation of {job.name} skipped: {why}", "eval_skipped")

    def warn(self, job: Job, message: str, kind: str = "eval_failed") -> None:
        self.emit("warning", kind=kind, step=job.step, checkpoint=job.name, message=message)
        self.log(f"WARNING {message}")


def eval_problem(cfg) -> str | None:
    """What makes the `eval:` section unusable, found before any model loads (None: fine)."""
    from trainer.eval.prompts import is_prompt_set

    e = cfg.eval
    if not e.enabled or e.prompts is None or is_prompt_set(e.prompts):
        return None  # holdout's file is written by the run
    if not Path(e.prompts).is_file():
        return (
            f"eval.prompts {e.prompts}: no such file (a prompt file as dflash eval reads it, or a named set)"
        )
    return None


def hold_out(cfg, ds, usable, is_main: bool):
    """eval.holdout: clears the held-out samples from `usable` (in place) and, on the main process,
    writes their prompts where the evaluations read them (the same file on every restart: the same
    seed, the same samples). The held-out indices (none without it)."""
    import numpy as np

    from trainer.data import holdout_indices, holdout_prompts
    from trainer.eval.prompts import write_prompt_file

    if not cfg.eval.holdout:
        return np.zeros(0, dtype=np.int64)
    held = holdout_indices(usable, cfg.eval.holdout, cfg.train.seed)
    usable[held] = False
    if is_main:
        write_prompt_file(holdout_file(cfg.out_dir), holdout_prompts(ds, held))
    return held
