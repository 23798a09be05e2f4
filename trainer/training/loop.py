"""The online training loop: target forward (hooked, frozen) -> drafter forward/backward, one
packed batch per rank per step. Readable top to bottom; parallelism (torchrun DDP, `distributed`;
sharding, `sharding`), stopping (`shutdown`), RNG state and the lr schedule (`state`), step metrics
(`metrics`), health (`health`), checkpoints (`checkpointing`), what the run tells the event stream
(`run_events`), τ measured while training (`evaluation`), a time budget (`budget`) and the
hidden-state source are separate components with small interfaces.

Exit codes (`trainer.errors.ExitCode`): OK finished or stopped by a signal with a final checkpoint;
REFUSED preflight refused; FAILED (non-finite loss beyond tolerance, ranks out of sync, ...);
STOP_TIMEOUT the stop exceeded its bound.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer.config.run import RunConfig, dump_config
from trainer.errors import ExitCode
from trainer.sources.vllm_server import VllmServerError
from trainer.store.events import EventWriter
from trainer.store.node_marker import write_node_marker
from trainer.trackers import start_trackers
from trainer.training import checkpointing
from trainer.training.budget import BudgetControl
from trainer.training.distributed import (
    NODE_RANK_ENV,
    Dist,
    all_ranks,
    any_rank,
    leave_without_teardown,
    max_over_ranks,
    setup_dist,
)
from trainer.training.evaluation import TrainingEval, eval_problem, hold_out
from trainer.training.health import RunHealth, features_finite, target_agreement
from trainer.training.liveness import Heartbeats
from trainer.training.metrics import StepResult, merge_batches, start_step_memory, step_metrics
from trainer.training.run_events import RunEvents
from trainer.training.sharding import Sharding
from trainer.training.shutdown import StallWatchdog, StopRequest
from trainer.training.state import rng_state, seed_all, set_determinism

# train.position_weights as speculators' DFlash forward names them
POSITION_WEIGHTS = {"exp": "fixed-exp-decay", "dpace": "dpace"}


# ---------------------------------------------------------------- the run
class Trainer:
    def __init__(self, cfg: RunConfig, d: Dist, events: EventWriter, budget: BudgetControl | None = None):
        self.cfg, self.d, self.events = cfg, d, events
        self.budget = budget  # train.time_budget: the schedule and the stop follow its clock (budget.py)
        self.report = RunEvents(cfg, d, events)
        self.emit, self.log = self.report.emit, self.report.log  # rank 0's voice (no-ops elsewhere)
        self.evaluation = TrainingEval(cfg, d.is_main, str(d.device), self.emit, self.log)  # eval: τ
        self.saved_step: int | None = None  # the step of the newest checkpoint this run wrote

    # -------------------------------------------------------------- build
    def build(self) -> None:
        from speculators.losses import resolve_loss_config

        from trainer.data import PackedSampler, compute_stats, open_dataset
        from trainer.drafter.model import (
            build_drafter,
            count_trainable,
            loss_implementation,
            share_target_embedding,
        )
        from trainer.sources.factory import make_source

        cfg, d = self.cfg, self.d
        seed_all(cfg.train.seed)
        self.beats = Heartbeats(d)  # where each rank is (a no-op on one process)
        self.multi_node = d.enabled and NODE_RANK_ENV in os.environ
        self.source = make_source(cfg, d.device, d.target_devices, d=d, warn=self.source_warning)
        self.bf16 = d.device.type == "cuda" and cfg.train.precision in ("auto", "bfloat16")
        self.drafter = build_drafter(cfg, d.device, head_dtype=torch.bfloat16 if self.bf16 else None)
        self.n_trainable = count_trainable(self.drafter)
        self.embedding_not_shared = "train.share_target_embedding is false"
        if cfg.train.share_target_embedding:  # one vocab x hidden tensor for the target and the drafter
            self.embedding_not_shared = share_target_embedding(self.drafter, self.source.embedding_weight)
        if cfg.train.activation_checkpointing:  # transformers' own, on speculators' decoder layers
            self.drafter.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.loss_config = resolve_loss_config(cfg.train.loss, loss_implementation(d.device))
        ds = open_dataset(cfg.data.path)
        stats = compute_stats(ds)
        usable = stats.usable(cfg.data.max_length)
        held = hold_out(cfg, ds, usable, d.is_main)  # eval.holdout: samples the sampler never sees
        self.data_totals = {
            "samples": int(stats.num_samples),
            "held_out_samples": int(held.size),
            "usable_samples": int(usable.sum()),
            "supervised_tokens": int(stats.supervised[usable].sum()),
            "tokens": int(stats.lengths[usable].sum()),
        }
        self.sampler = self.source.batches(  # a vLLM source requests batches ahead
            PackedSampler(ds, usable, cfg.train.max_tokens_per_batch, cfg.train.seed, d.rank, d.world_size)
        )
        model = self.drafter
        if cfg.train.loss_chunk_rows:  # the same forward, the heads and loss over row chunks
            from trainer.training.chunked_loss import ChunkedDraftLoss

            model = ChunkedDraftLoss(self.drafter, cfg.train.loss_chunk_rows)
        self.sharding = Sharding(cfg, d, self.bf16)  # train.shard: DDP, DDP + ZeRO-1 or FSDP2
        self.model = self.sharding.wrap(model, self.drafter)
        self.optimizer, self.scheduler = self.sharding.make_optimizer(cfg)
        self.step = 0
        self.tokens = 0
        self.resumed_from: str | None = None

    # -------------------------------------------------------------- checkpoints (checkpointing.py)
    def resume(self) -> None:
        """Resume from global rank 0's newest verified checkpoint (`checkpointing.resume`)."""
        checkpointing.resume(self)

    def save(self, reason: str, at_step_start: bool = False):
        """A checkpoint of the state after step `self.step` (`checkpointing.save`): every rank calls
        it; rank 0 gets what it wrote, the others None."""
        if self.budget is None:
            return checkpointing.save(self, reason, at_step_start)
        saved = []  # its time, for the budget's stop margin
        self.budget.timed(lambda: saved.append(checkpointing.save(self, reason, at_step_start)), self.step)
        return saved[0]

    def source_warning(self, kind: str, message: str) -> None:
        """A hidden-state source's trouble it is handling itself (a retried request), or what it did
        while it was opened (the server's environment), before the run has a step."""
        self.emit("warning", kind=kind, message=message, step=getattr(self, "step", 0))
        self.log(f"WARNING {message}")

    # -------------------------------------------------------------- one step
    def next_batch(self) -> dict[str, Any]:
        """The next packed batch of this rank as [1, T] tensors on the device (+ numpy copies)."""
        b = self.sampler.next_batch()
        dev = self.d.device
        for k in ("input_ids", "loss_mask", "document_ids", "position_ids"):
            b[k + "_t"] = torch.from_numpy(b[k]).unsqueeze(0).to(dev)
        return b

    def capture(self, b: dict[str, Any]):
        """The frozen target's features for a batch (no grad, lm_head never computed). With a vLLM
        source over several ranks, a server lost to one rank (its retries spent) is lost to all: they
        agree after each capture and raise together, so the final checkpoint (a collective) runs on
        every rank instead of the others waiting in the step's all-reduce."""
        agree = self.cfg.target.source == "vllm" and self.d.enabled
        lost = cap = None
        try:
            cap = self.source.capture(b["input_ids_t"], b["position_ids_t"], ticket=b.get("ticket"))
        except VllmServerError as exc:
            if not agree:
                raise
            lost = exc
        if agree and any_rank(lost is not None, self.d):
            raise lost or VllmServerError("the hidden-state server was lost to another rank")
        if self.d.device.type == "cuda":
            torch.cuda.synchronize(self.d.device)
        return cap

    def drafter_backward(self, b: dict[str, Any], cap, scale: float, sync: bool):
        """One micro-batch's drafter forward and backward, the loss scaled by `scale` (1 / the
        micro-batches of the step). `sync` False: DDP keeps the gradient local (`no_sync`), the last
        micro-batch's backward all-reduces what was accumulated. Returns (loss, metrics) unscaled."""
        cfg = self.cfg
        with self.sharding.accumulating(local=not sync):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.bf16):
                _, loss, metrics = self.model(
                    cap.aux,
                    b["input_ids_t"],
                    b["loss_mask_t"],
                    cap.last,
                    b["document_ids_t"],
                    position_ids=b["position_ids_t"],
                    loss_config=self.loss_config,
                    gamma=cfg.train.gamma,
                    max_anchors=cfg.train.max_anchors,
                    per_position_loss_weight=POSITION_WEIGHTS[cfg.train.position_weights],
                    dpace_alpha=cfg.train.dpace_alpha,
                )
            (loss * scale).backward()
        return loss.detach(), {k: v.detach() for k, v in metrics.items()}

    def drafter_step(self, b: dict[str, Any], cap) -> StepResult:
        """One micro-batch's whole drafter step (backward, then the update): what a step is with
        grad_accum_steps 1; the benches time it alone."""
        loss, metrics = self.drafter_backward(b, cap, 1.0, sync=True)
        return self.optimizer_step(loss, metrics)

    def optimizer_step(self, loss: torch.Tensor, metrics: dict[str, torch.Tensor]) -> StepResult:
        """Clip, optimizer + scheduler step over the accumulated gradient. A non-finite loss/grad on
        any rank skips the update everywhere (`finite` False)."""
        cfg, d = self.cfg, self.d
        grad_norm = self.sharding.clip_grad_norm(cfg.train.grad_clip)
        ok = all_ranks(torch.isfinite(loss).item() and torch.isfinite(grad_norm).item(), d)
        if ok:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        if d.device.type == "cuda":
            torch.cuda.synchronize(d.device)
        return StepResult(loss=loss, metrics=metrics, grad_norm=grad_norm, lr=lr, finite=ok)

    def features_finite(self, cap) -> bool:
        """The target's features are finite on every rank (see health.features_finite)."""
        return features_finite(cap, self.d)

    def target_agreement(self, b: dict[str, Any], cap) -> float | None:
        """Share of supervised tokens that are the verifier's own greedy choice (health.target_agreement)."""
        rows = min(1024, self.cfg.train.loss_chunk_rows or 1024)  # no more vocabulary rows than the loss
        return target_agreement(self.drafter, b, cap, self.d, rows=rows)

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over `train.grad_accum_steps` micro-batches per rank: each one's target
        capture, then its drafter forward/backward (the gradient accumulates, all-reduced once). Target
        features that are not finite on any rank in any micro-batch skip the whole update on every
        rank; the remaining micro-batches are still drawn (no capture), so the data stream stays where
        an uninterrupted run has it."""
        start_step_memory(self.d.device)  # the step's peak, as the memory model predicts it
        t0 = time.perf_counter()
        self.beats.beat(self.step + 1, "step_start")
        if self.cfg.target.source == "vllm":  # what the checkpoint after a lost server keeps
            self.step_start = (self.sampler.state_dict(), rng_state())
        n = self.cfg.train.grad_accum_steps
        check = self.step == 0 or (self.step + 1) % self.cfg.train.agreement_every == 0
        agreement = None
        features_ok = True
        capture_s = 0.0
        batches, losses, sums = [], [], {}
        for i in range(n):
            ta = time.perf_counter()
            b = self.next_batch()
            batches.append(b)
            if not features_ok:
                continue
            cap = self.capture(b)
            self.beats.beat(self.step + 1, "captured")
            features_ok = self.features_finite(cap)
            if check and i == 0 and features_ok:
                agreement = self.target_agreement(b, cap)
            capture_s += time.perf_counter() - ta
            if features_ok:
                loss, metrics = self.drafter_backward(b, cap, 1.0 / n, sync=i == n - 1)
                losses.append(loss)
                for k, v in metrics.items():  # speculators' sums and totals add over micro-batches
                    sums[k] = sums[k] + v if k in sums else v
            del cap
        self.beats.beat(self.step + 1, "backward_done")
        if features_ok:
            result = self.optimizer_step(torch.stack(losses).mean(), sums)
        else:  # every rank skips together (no half-done DDP backward)
            self.optimizer.zero_grad(set_to_none=True)
            lr = self.scheduler.get_last_lr()[0]
            self.scheduler.step()
            result = StepResult.skipped(lr, self.d.device)
        t2 = time.perf_counter()
        m = step_metrics(
            result,
            merge_batches(batches),
            d=self.d,
            block_size=self.cfg.drafter.block_size,
            started=t0,
            captured=t0 + capture_s,
            done=t2,
        )
        self.tokens += m["batch_tokens"]
        if hasattr(self.source, "take_counters"):  # a streamed source: the step's wait for it, bytes read
            wait_s, m["hs_bytes"], m["hs_tokens"] = self.source.take_counters()
            m["hs_wait_s"] = round(wait_s, 4)
        if agreement is not None:
            m["target_agreement"] = agreement
        if not features_ok:
            m["problem"] = "nonfinite_target"
        elif not result.finite:
            m["problem"] = "nonfinite_loss"
        self.beats.beat(self.step + 1, "step_done", step_s=t2 - t0)
        return m

    # -------------------------------------------------------------- run
    def run(self, stop: StopRequest) -> int:
        cfg, d, report = self.cfg, self.d, self.report
        total = cfg.train.max_steps
        report.run_start(self)
        status, code = "completed", ExitCode.OK
        self.mark_node("running")
        beats = self.beats
        nodes = (
            beats.nodes if self.multi_node and d.is_main else None
        )  # each node's progress, for the monitor
        health = RunHealth(cfg, self.emit, self.log, where=beats.laggards if beats.enabled else None)
        watchdog = StallWatchdog(health.on_stall, cfg.train.stall_factor, cfg.train.stall_min_s).start()
        budget = self.budget
        if budget is not None:
            budget.start()
        try:
            while self.step < total:
                if budget is not None and not budget.before_step(self.step, self.scheduler):
                    if budget.unsaved(self.step):  # no room for another step: keep those done
                        self.save("final")
                    break
                m = self.train_step()
                self.step += 1
                last = self.step == total or (budget is not None and budget.after_step(self.step))
                watchdog.step_done(self.step)
                if health.after_step(self.step, m, m.pop("problem", None)):  # too many non-finite steps
                    status, code = "failed", ExitCode.FAILED
                    break
                m.pop("finite")
                if budget is not None:
                    m |= budget.event_fields()
                report.step(self.step, self.tokens, m, nodes, last=last)
                stop_now = self.stop_requested(stop)
                if self.step % cfg.train.checkpoint_every == 0 or last or stop_now:
                    self.save("signal" if stop_now else ("final" if last else "periodic"))
                self.evaluation.after_step(self.step, stop_now, self.saved_step, self.save)  # eval: τ
                if stop_now:
                    status = "stopped"
                    break
                if last:
                    break
        except BaseException as exc:
            status, code = "failed", ExitCode.FAILED
            if isinstance(exc, VllmServerError):  # on every rank at once (capture)
                # the server is gone for good (retries spent): keep what was trained, then exit 1 so
                # that the service restarts the run, which resumes at the failed step
                self.log(f"hidden-state server lost at step {self.step + 1}: final checkpoint, then exit")
                self.save("source_failed", at_step_start=True)
            report.run_failed(status, self.step, self.tokens, exc)
            self.mark_node(status)
            raise
        finally:
            watchdog.stop()
            spent = budget.finish(self.step) if budget is not None else {}
        self.evaluation.finish(  # the final checkpoint's τ, then every evaluation done or stopped
            status == "completed" and self.saved_step == self.step,
            self.step,
            lambda running: any_rank(running, self.d),
            stopped=lambda: stop.signum is not None,
        )
        stop.cancel()
        report.run_end(status, self.step, self.tokens, stop.signum, **spent)
        self.mark_node(status)
        return int(code)

    def close(self) -> None:
        """Stop the source (a vLLM source's requests, and the server it started) and drop DDP, the
        optimizer (ZeRO holds the process group too) and the models."""
        import gc

        if "evaluation" in self.__dict__:  # a run that failed: its evaluations stop
            self.evaluation.close()
        source = self.__dict__.get("source")
        if hasattr(source, "close"):  # a vLLM source: its requests, and the server it started
            source.close()
        for name in ("model", "sharding", "optimizer", "scheduler", "drafter", "source"):
            self.__dict__.pop(name, None)
        gc.collect()

    def mark_node(self, status: str) -> None:
        """The first rank of every node but node 0 keeps the node's marker (salvage reads it there)."""
        if self.multi_node and self.d.local_rank == 0 and not self.d.is_main:
            if status == "running":
                self.node_started = time.time()
            node = int(os.environ[NODE_RANK_ENV])
            write_node_marker(self.cfg.out_dir, node, self.node_started, status, self.step)

    def stop_requested(self, stop: StopRequest) -> bool:
        return any_rank(stop.signum is not None, self.d)


def train(cfg: RunConfig, skip_preflight: bool = False) -> int:
    """`dflash train`: preflight, then train (resuming from the newest verified checkpoint)."""
    d = setup_dist(cfg)
    budget = None
    if cfg.train.time_budget is not None:  # its clock starts here: preflight and loading count
        budget = BudgetControl(cfg.train, cfg.out_dir, d.is_main, agree=lambda v: max_over_ranks(v, d))
    set_determinism(d.device)  # on CPU; on CUDA only when asked for (DFLASH_DETERMINISTIC=1)
    run_id = os.environ.get("DFLASH_RUN_ID") or uuid.uuid4().hex[:12]
    events = EventWriter(cfg.out_dir, run_id, enabled=d.is_main)
    verdict = [True]
    if d.is_main and not skip_preflight:
        from trainer.preflight import run_preflight

        report = run_preflight(cfg)
        print(report.render_text(), flush=True)
        verdict[0] = report.ok
        if not report.ok:
            events.emit(
                "run_end",
                status="refused",
                step=0,
                tokens=0,
                error="preflight refused",
                problems=[p.code for p in report.errors],
            )
    problem = eval_problem(cfg) if d.is_main and verdict[0] else None
    if problem is not None:  # a bad eval: section, before any model loads
        print(f"dflash train: {problem}", file=sys.stderr, flush=True)
        events.emit("run_end", status="refused", step=0, tokens=0, error=problem, problems=["eval"])
        verdict[0] = False
    if d.enabled:
        dist.broadcast_object_list(verdict, src=0)
    if not verdict[0]:
        return int(ExitCode.REFUSED)
    if d.is_main:
        Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
        dump_config(cfg, Path(cfg.out_dir) / "run.yaml")

    def on_timeout() -> None:
        if d.is_main:
            events.emit(
                "warning",
                kind="stop_timeout",
                message=f"stop exceeded {cfg.train.stop_timeout_s}s: exiting without a final checkpoint",
            )
        os._exit(int(ExitCode.STOP_TIMEOUT))

    stop = StopRequest(cfg.train.stop_timeout_s, on_timeout)
    stop.install()
    trainer = Trainer(cfg, d, events, budget)
    trainer.build()
    trainer.resume()
    trackers = start_trackers(cfg, events) if d.is_main else None  # report_to: beside rank 0
    try:
        code = trainer.run(stop)
    finally:
        trainer.close()
        if trackers is not None:
            trackers.close()  # they finish what the run wrote
    if d.enabled and dist.is_initialized():
        leave_without_teardown(code)
    return code
