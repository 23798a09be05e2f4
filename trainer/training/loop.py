"""The online training loop: target forward (hooked, frozen) -> drafter forward/backward, one
packed batch per rank per step. Readable top to bottom; parallelism (torchrun DDP), checkpoints,
the hidden-state source and the event stream are separate components with small interfaces.

Exit codes: 0 finished or stopped by a signal with a final checkpoint; 2 preflight refused;
1 failed (non-finite loss beyond tolerance, ranks out of sync, ...); 3 stop exceeded its bound.
"""

from __future__ import annotations

import math
import os
import random
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from trainer import checkpoint as ckpt
from trainer.config import RunConfig, dump_config
from trainer.events import EventWriter

EXIT_OK, EXIT_FAILED, EXIT_PREFLIGHT, EXIT_STOP_TIMEOUT = 0, 1, 2, 3


# ---------------------------------------------------------------- distributed context
@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    target_devices: list[torch.device] = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_dist(cfg: RunConfig) -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    want = cfg.train.device
    use_cuda = torch.cuda.is_available() and want in ("auto", "cuda")
    if want == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device is cuda but no CUDA device is visible")
    if use_cuda:
        k = cfg.target.gpus_per_copy
        first = local * k
        if first + k > torch.cuda.device_count():
            raise RuntimeError(
                f"rank {local} needs GPUs {first}..{first + k - 1} (target.gpus_per_copy={k}) "
                f"but {torch.cuda.device_count()} are visible: lower nproc_per_node or gpus_per_copy"
            )
        torch.cuda.set_device(first)
        devices = [torch.device("cuda", first + i) for i in range(k)]
        device = devices[0]
    else:
        device = torch.device("cpu")
        devices = [device]
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return Dist(rank, world, local, device, devices)


def all_reduce_(t: torch.Tensor, d: Dist, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if d.enabled:
        dist.all_reduce(t, op=op)
    return t


# ---------------------------------------------------------------- signals
class StopRequest:
    """SIGTERM/SIGINT set a flag read at step boundaries (never mid-collective); a watchdog bounds
    the time from the signal to the exit."""

    def __init__(self, timeout_s: float, on_timeout):
        self.signum: int | None = None
        self._timeout_s = timeout_s
        self._on_timeout = on_timeout
        self._timer: threading.Timer | None = None

    def install(self) -> None:
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self._handler)

    def _handler(self, signum, _frame) -> None:
        if self.signum is None:
            self.signum = signum
            self._timer = threading.Timer(self._timeout_s, self._on_timeout)
            self._timer.daemon = True
            self._timer.start()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


class StallWatchdog:
    """Warns (once per stall) when the current step has run far longer than steps usually take:
    a hang in a collective, a dead NFS mount, a GPU wedged. It runs in a thread, so it speaks even
    when the loop cannot; the monitor adds its own stall alert from the outside."""

    def __init__(self, on_stall, factor: float = 10.0, min_s: float = 120.0, poll_s: float = 5.0):
        self.on_stall, self.factor, self.min_s, self.poll_s = on_stall, factor, min_s, poll_s
        self._durations: list[float] = []
        self._started = time.monotonic()
        self._warned = False
        self._step = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="dflash-stall-watchdog")

    def start(self) -> "StallWatchdog":
        self._started = time.monotonic()
        self._thread.start()
        return self

    def step_done(self, step: int) -> None:
        now = time.monotonic()
        self._durations = (self._durations + [now - self._started])[-50:]
        self._started, self._step, self._warned = now, step, False

    def threshold_s(self) -> float:
        if not self._durations:
            return max(self.min_s, 10 * self.min_s)  # first step: loading, compiling
        med = sorted(self._durations)[len(self._durations) // 2]
        return max(self.min_s, self.factor * med)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            waited = time.monotonic() - self._started
            if not self._warned and waited > self.threshold_s():
                self._warned = True
                self.on_stall(self._step + 1, waited, self.threshold_s())

    def stop(self) -> None:
        self._stop.set()


# ---------------------------------------------------------------- helpers
def lr_lambda(cfg: RunConfig):
    t = cfg.train
    warm = t.resolved_warmup_steps

    def f(step: int) -> float:  # step = optimizer steps done so far
        if warm and step < warm:
            return (step + 1) / warm
        if t.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, t.max_steps - warm))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def param_checksum(model) -> torch.Tensor:
    """A float64 fingerprint of the trainable weights, compared across ranks."""
    with torch.no_grad():
        parts = [p.detach().double().sum() + p.detach().double().abs().sum() * 1e-3 for p in model.parameters() if p.requires_grad]
        return torch.stack(parts).sum().reshape(1)


def memory_snapshot(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {
            "gpu_allocated_gb": round(torch.cuda.memory_allocated(device) / 2**30, 3),
            "gpu_peak_gb": round(torch.cuda.max_memory_allocated(device) / 2**30, 3),
        }
    import psutil

    return {"rss_gb": round(psutil.Process().memory_info().rss / 2**30, 3)}


# ---------------------------------------------------------------- the run
class Trainer:
    def __init__(self, cfg: RunConfig, d: Dist, events: EventWriter):
        self.cfg, self.d, self.events = cfg, d, events

    def log(self, msg: str) -> None:
        if self.d.is_main:
            self.events.log(msg)

    def emit(self, event: str, **fields) -> None:
        if self.d.is_main:
            self.events.emit(event, **fields)

    # -------------------------------------------------------------- build
    def build(self) -> None:
        from speculators.losses import resolve_loss_config

        from trainer.data import PackedSampler, compute_stats, open_dataset
        from trainer.drafter import build_drafter, count_trainable, loss_implementation
        from trainer.sources import make_source

        cfg, d = self.cfg, self.d
        torch.manual_seed(cfg.train.seed)
        np.random.seed(cfg.train.seed)
        random.seed(cfg.train.seed)
        self.source = make_source(cfg, d.device, d.target_devices)
        self._bf16 = d.device.type == "cuda" and cfg.train.precision in ("auto", "bfloat16")
        self.drafter = build_drafter(cfg, d.device, head_dtype=torch.bfloat16 if self._bf16 else None)
        self.n_trainable = count_trainable(self.drafter)
        self.loss_config = resolve_loss_config(cfg.train.loss, loss_implementation(d.device))
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        adamw = {"lr": cfg.train.lr, "betas": cfg.train.betas, "weight_decay": cfg.train.weight_decay}
        self.sharded = d.enabled and cfg.train.shard_optimizer_state
        if self.sharded:  # ZeRO-1: each rank keeps the moments of its share of the parameters
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.optimizer = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **adamw)
        else:
            self.optimizer = torch.optim.AdamW(params, **adamw)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        ds = open_dataset(cfg.data.path)
        stats = compute_stats(ds)
        usable = stats.usable(cfg.data.max_length)
        self.data_totals = {
            "samples": int(stats.num_samples),
            "usable_samples": int(usable.sum()),
            "supervised_tokens": int(stats.supervised[usable].sum()),
            "tokens": int(stats.lengths[usable].sum()),
        }
        self.sampler = PackedSampler(
            ds, usable, cfg.train.max_tokens_per_batch, cfg.train.seed, d.rank, d.world_size
        )
        self.model = self.drafter
        if d.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.model = DDP(self.drafter, device_ids=[d.device.index] if d.device.type == "cuda" else None)
        self.step = 0
        self.tokens = 0
        self.resumed_from: str | None = None
        self._agreement_warned = False

    # -------------------------------------------------------------- resume
    def resume(self) -> None:
        folder, problems = ckpt.find_resume_checkpoint(self.cfg.out_dir)
        for p in problems:
            self.emit("warning", kind="corrupt_checkpoint", message=p)
            self.log(f"WARNING checkpoint does not verify, skipped: {p}")
        if folder is None:
            return
        from trainer.drafter import load_trainable_weights

        state = ckpt.load_trainer_state(folder)
        load_trainable_weights(self.drafter, folder / "model.safetensors")
        if not state["optimizer"].get("state"):
            raise ckpt.CheckpointError(f"{folder}: optimizer state is empty: refusing a resume that restores nothing")
        # the full (consolidated) state on every rank; ZeRO-1 keeps only this rank's share of it
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"][self.d.rank] if isinstance(state["sampler"], list) else state["sampler"])
        rngs = state["rng"]
        set_rng_state(rngs[self.d.rank] if isinstance(rngs, list) else rngs)
        self.step, self.tokens = int(state["step"]), int(state["tokens"])
        self.resumed_from = folder.name
        self.log(f"resumed from {folder.name} (step {self.step}, {self.tokens} tokens)")

    def _gather(self, obj) -> list:
        if not self.d.enabled:
            return [obj]
        out = [None] * self.d.world_size
        dist.all_gather_object(out, obj)
        return out

    def local_moment_numel(self) -> int:
        """Elements of the Adam moments (exp_avg + exp_avg_sq) this rank holds."""
        local = self.optimizer.optim if self.sharded else self.optimizer
        return sum(v.numel() for st in local.state.values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq"))

    def save(self, reason: str) -> None:
        d = self.d
        if self.sharded:  # a collective: every rank sends its shard, rank 0 gets the full state
            self.optimizer.consolidate_state_dict(to=0)
        moments = self._gather(self.local_moment_numel())
        samplers = self._gather(self.sampler.state_dict())
        rngs = self._gather(rng_state())
        sums = torch.cat(self._gather(param_checksum(self.drafter)))
        in_sync = bool(torch.all(sums == sums[0]))
        if d.is_main:
            state = {
                "step": self.step,
                "tokens": self.tokens,
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "sampler": samplers if d.enabled else samplers[0],
                "rng": rngs if d.enabled else rngs[0],
                "world_size": d.world_size,
            }
            meta = {"tokens": self.tokens, "run_id": self.events.run_id, "reason": reason, "time": time.time(),
                    "world_size": d.world_size, "ranks_in_sync": in_sync}
            saved = ckpt.save_checkpoint(self.cfg.out_dir, self.step, self.drafter, state, meta, self.cfg.train.keep_checkpoints)
            self.emit("checkpoint", step=self.step, name=saved.path.name, path=str(saved.path), size_bytes=saved.size_bytes,
                      seconds=round(saved.seconds, 3), reason=reason, ranks_in_sync=in_sync, removed=saved.removed,
                      optimizer_sharded=self.sharded, moment_numel_per_rank=moments)
            self.log(f"checkpoint {saved.path.name} ({saved.size_bytes / 2**20:.1f} MiB, {saved.seconds:.2f}s, {reason})")
        if d.enabled:
            dist.barrier()
        if not in_sync:
            raise RuntimeError(f"ranks diverged: weight checksums {sums.tolist()}")

    # -------------------------------------------------------------- one step
    def next_batch(self) -> dict[str, Any]:
        """The next packed batch of this rank as [1, T] tensors on the device (+ numpy copies)."""
        b = self.sampler.next_batch()
        dev = self.d.device
        for k in ("input_ids", "loss_mask", "document_ids", "position_ids"):
            b[k + "_t"] = torch.from_numpy(b[k]).unsqueeze(0).to(dev)
        return b

    def capture(self, b: dict[str, Any]):
        """The frozen target's features for a batch (no grad, lm_head never computed)."""
        cap = self.source.capture(b["input_ids_t"], b["position_ids_t"])
        if self.d.device.type == "cuda":
            torch.cuda.synchronize(self.d.device)
        return cap

    def drafter_step(self, b: dict[str, Any], cap) -> tuple[torch.Tensor, dict, torch.Tensor, float, bool]:
        """Drafter forward/backward, clip, optimizer + scheduler step. Returns (loss, metrics,
        grad_norm, lr used, finite). A non-finite loss/grad on any rank skips the update everywhere."""
        cfg, d = self.cfg, self.d
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self._bf16):
            _, loss, metrics = self.model(
                cap.aux, b["input_ids_t"], b["loss_mask_t"], cap.last, b["document_ids_t"],
                position_ids=b["position_ids_t"], loss_config=self.loss_config,
                gamma=cfg.train.gamma, max_anchors=cfg.train.max_anchors,
            )
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.drafter.parameters() if p.requires_grad], cfg.train.grad_clip
        )
        finite = torch.tensor([float(torch.isfinite(loss).item() and torch.isfinite(grad_norm).item())], device=d.device)
        all_reduce_(finite, d, dist.ReduceOp.MIN)
        ok = finite.item() == 1.0
        if ok:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        if d.device.type == "cuda":
            torch.cuda.synchronize(d.device)
        return loss, metrics, grad_norm, lr, ok

    def features_finite(self, cap) -> bool:
        """The target's features are finite on every rank. A broken target (corrupt shard, fp16
        overflow) otherwise trains silently: NaN verifier logits have argmax 0 everywhere, the
        drafter learns to always say 0 and `eal` looks perfect."""
        ok = torch.tensor([float(bool(torch.isfinite(cap.aux).all()) and bool(torch.isfinite(cap.last).all()))],
                          device=self.d.device)
        return all_reduce_(ok, self.d, dist.ReduceOp.MIN).item() == 1.0

    @torch.no_grad()
    def target_agreement(self, b: dict[str, Any], cap) -> float | None:
        """Share of supervised tokens that equal the verifier's own greedy prediction from the
        previous position (pooled over ranks). On data the target wrote itself (what DFlash's
        targets assume) it is near 1. Low: the data was written by another model or with another
        chat template / thinking mode, or the target is broken (its logits collapse)."""
        ids, mask, docs = b["input_ids_t"][0], b["loss_mask_t"][0], b["document_ids_t"][0]
        head, norm = self.drafter.verifier_lm_head, self.drafter.verifier_norm
        hits = torch.zeros(2, device=self.d.device)
        T = ids.numel()
        for s in range(0, T - 1, 1024):  # chunked: T x vocab logits never materialise at once
            e = min(T - 1, s + 1024)
            pred = head(norm(cap.last[0, s:e].float()).to(head.weight.dtype)).argmax(-1)  # bf16 head on CUDA
            sel = (mask[s + 1 : e + 1] != 0) & (docs[s + 1 : e + 1] == docs[s:e])
            hits[0] += (pred[sel] == ids[s + 1 : e + 1][sel]).sum()
            hits[1] += sel.sum()
        all_reduce_(hits, self.d)
        return (hits[0] / hits[1]).item() if hits[1] > 0 else None

    def train_step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        b = self.next_batch()
        cap = self.capture(b)
        features_ok = self.features_finite(cap)
        check = self.step == 0 or (self.step + 1) % self.cfg.train.agreement_every == 0
        agreement = self.target_agreement(b, cap) if check and features_ok else None
        t1 = time.perf_counter()
        if not features_ok:  # every rank skips together (no half-done DDP backward)
            lr = self.scheduler.get_last_lr()[0]
            self.scheduler.step()
            nan = torch.tensor(float("nan"), device=self.d.device)
            m = self._step_metrics(b, nan, {}, nan, lr, False, t0, t1, time.perf_counter())
            m["problem"] = "nonfinite_target"
            return m
        loss, metrics, grad_norm, lr, finite = self.drafter_step(b, cap)
        t2 = time.perf_counter()
        m = self._step_metrics(b, loss, metrics, grad_norm, lr, finite, t0, t1, t2)
        if agreement is not None:
            m["target_agreement"] = agreement
        if not finite:
            m["problem"] = "nonfinite_loss"
        return m

    def _step_metrics(self, b, loss, metrics, grad_norm, lr, finite, t0, t1, t2) -> dict[str, Any]:
        d, B = self.d, self.cfg.drafter.block_size
        keys = ["eal_sum", "eal_total", "full_acc_sum", "full_acc_total"]
        keys += [f"position_{k}_acc_{s}" for k in range(1, B) for s in ("sum", "total")]
        zero = torch.zeros((), device=d.device)
        vec = torch.stack([metrics.get(k, zero).detach().float().reshape(()) for k in keys] + [
            loss.detach().float().reshape(()), torch.tensor(float(b["input_ids"].size), device=d.device),
            torch.tensor(float(b["loss_mask"].sum()), device=d.device)])
        all_reduce_(vec, d)
        vals = dict(zip(keys + ["loss", "tokens", "supervised"], vec.tolist()))
        ratio = lambda s, t: (s / t) if t else None  # noqa: E731
        batch_tokens = int(vals["tokens"])
        self.tokens += batch_tokens
        step_s = t2 - t0
        return {
            "loss": vals["loss"] / d.world_size,
            "finite": finite,
            "eal": ratio(vals["eal_sum"], vals["eal_total"]),
            "acc": ratio(vals["full_acc_sum"], vals["full_acc_total"]),
            "position_acc": [ratio(vals[f"position_{k}_acc_sum"], vals[f"position_{k}_acc_total"]) for k in range(1, B)],
            "lr": lr,
            "grad_norm": float(grad_norm),
            "batch_tokens": batch_tokens,
            "supervised_tokens": int(vals["supervised"]),
            "docs": int(b["num_docs"]),
            "tokens_per_s": batch_tokens / step_s if step_s > 0 else None,
            "target_s": round(t1 - t0, 5),
            "drafter_s": round(t2 - t1, 5),
            "step_s": round(step_s, 5),
            **memory_snapshot(d.device),
        }

    # -------------------------------------------------------------- run
    def run(self, stop: StopRequest) -> int:
        cfg, d = self.cfg, self.d
        total = cfg.train.max_steps
        self.emit(
            "run_start", schema_version=1, config=cfg.to_dict(), resumed_from=self.resumed_from,
            start_step=self.step, tokens=self.tokens,
            layout={"world_size": d.world_size, "device": str(d.device), "target_devices": [str(x) for x in d.target_devices],
                    "gpus_per_copy": cfg.target.gpus_per_copy, "precision": "bf16-autocast" if self._bf16 else "fp32",
                    "aux_ids": cfg.drafter.aux_ids, "target_layers": self.source.num_layers,
                    "hidden_size": self.source.hidden_size, "drafter_trainable_params": self.n_trainable,
                    "optimizer": "ZeroRedundancyOptimizer(AdamW)" if self.sharded else "AdamW"},
            totals={"total_steps": total, "max_tokens_per_step": cfg.train.max_tokens_per_batch * d.world_size,
                    "total_tokens": cfg.train.max_tokens_per_batch * d.world_size * total, "data": self.data_totals},
            pid=os.getpid(),
        )
        self.log(f"run start: steps {self.step + 1}..{total}, world {d.world_size}, device {d.device}, "
                 f"{self.n_trainable / 1e6:.2f}M trainable drafter params, aux ids {cfg.drafter.aux_ids}")
        bad_streak = 0
        status, code = "completed", EXIT_OK
        t_start = time.monotonic()

        def on_stall(step: int, waited: float, threshold: float) -> None:
            self.emit("warning", kind="stall", step=step, waited_s=round(waited, 1),
                      message=f"step {step} has run {waited:.0f}s (> {threshold:.0f}s, {cfg.train.stall_factor:g}x the median step)")
            self.log(f"WARNING step {step} stalled for {waited:.0f}s")

        watchdog = StallWatchdog(on_stall, cfg.train.stall_factor, cfg.train.stall_min_s).start()
        try:
            while self.step < total:
                m = self.train_step()
                self.step += 1
                watchdog.step_done(self.step)
                problem = m.pop("problem", None)
                if problem:
                    bad_streak += 1
                    what = "target features" if problem == "nonfinite_target" else "loss/grad"
                    self.emit("warning", kind=problem, step=self.step, loss=m["loss"], grad_norm=m["grad_norm"],
                              message=f"non-finite {what} at step {self.step}: update skipped ({bad_streak} in a row)")
                    self.log(f"WARNING non-finite {what} at step {self.step}: update skipped")
                    if bad_streak > cfg.train.nan_tolerance:
                        status, code = "failed", EXIT_FAILED
                        hint = ("check the target's weights (a corrupt shard? fp16 overflow?)" if problem == "nonfinite_target"
                                else "lower train.lr or check the data")
                        self.emit("warning", kind="nonfinite_abort", step=self.step,
                                  message=f"{bad_streak} non-finite steps in a row: stopping ({hint})")
                        break
                else:
                    bad_streak = 0
                agreement = m.get("target_agreement")
                if agreement is not None and agreement < cfg.train.min_target_agreement and not self._agreement_warned:
                    self._agreement_warned = True
                    self.emit("warning", kind="low_target_agreement", step=self.step, target_agreement=agreement,
                              message=f"only {agreement:.0%} of supervised tokens are the target's own greedy choice "
                                      f"(< {cfg.train.min_target_agreement:.0%}): the drafter learns the target's "
                                      "predictions, not this data. Regenerate the responses with this target and "
                                      "the serving chat template (`dflash regenerate`), or check the target's weights")
                    self.log(f"WARNING target agreement {agreement:.1%} at step {self.step}: data not written by this target?")
                m.pop("finite")
                if self.step % cfg.train.log_every == 0 or self.step == total:
                    self.emit("step", step=self.step, total_steps=total, tokens=self.tokens, **m)
                    if self.step % max(1, cfg.train.log_every * 10) == 0 or self.step == total or self.step == 1:
                        self.log(f"step {self.step}/{total} loss {m['loss']:.4f} eal {m['eal'] or 0:.3f} "
                                 f"lr {m['lr']:.2e} {m['tokens_per_s'] or 0:.0f} tok/s")
                stop_now = self._stop_requested(stop)
                if self.step % cfg.train.checkpoint_every == 0 or self.step == total or stop_now:
                    self.save("signal" if stop_now else ("final" if self.step == total else "periodic"))
                if stop_now:
                    status = "stopped"
                    break
        except BaseException as exc:
            status, code = "failed", EXIT_FAILED
            self.emit("run_end", status=status, step=self.step, tokens=self.tokens, error=f"{type(exc).__name__}: {exc}",
                      wall_s=round(time.monotonic() - t_start, 3))
            self.log(f"run failed at step {self.step}: {type(exc).__name__}: {exc}")
            raise
        finally:
            watchdog.stop()
        stop.cancel()
        self.emit("run_end", status=status, step=self.step, tokens=self.tokens, wall_s=round(time.monotonic() - t_start, 3),
                  signal=stop.signum, last_checkpoint=(ckpt.read_latest(cfg.out_dir).name if ckpt.read_latest(cfg.out_dir) else None))
        self.log(f"run {status} at step {self.step}")
        return code

    def close(self) -> None:
        """Drop DDP, the optimizer (ZeRO holds the process group too) and the models before the
        process group is destroyed: left to interpreter shutdown, gloo's threads were sometimes
        still joinable when their owner died ("terminate called without an active exception",
        SIGABRT after a completed run, about 1 in 6 two-rank CPU runs)."""
        import gc

        for name in ("model", "optimizer", "scheduler", "drafter", "source"):
            self.__dict__.pop(name, None)
        gc.collect()

    def _stop_requested(self, stop: StopRequest) -> bool:
        flag = torch.tensor([1.0 if stop.signum is not None else 0.0], device=self.d.device)
        all_reduce_(flag, self.d, dist.ReduceOp.MAX)
        return bool(flag.item())


def train(cfg: RunConfig, skip_preflight: bool = False) -> int:
    """`dflash train`: preflight, then train (resuming from the newest verified checkpoint)."""
    d = setup_dist(cfg)
    torch.use_deterministic_algorithms(True, warn_only=True)
    run_id = os.environ.get("DFLASH_RUN_ID") or uuid.uuid4().hex[:12]
    events = EventWriter(cfg.out_dir, run_id, enabled=d.is_main)
    verdict = [True]
    if d.is_main and not skip_preflight:
        from trainer.preflight import run_preflight

        report = run_preflight(cfg)
        print(report.render_text(), flush=True)
        verdict[0] = report.ok
        if not report.ok:
            events.emit("run_end", status="refused", step=0, tokens=0, error="preflight refused",
                        problems=[p.code for p in report.errors])
    if d.enabled:
        dist.broadcast_object_list(verdict, src=0)
    if not verdict[0]:
        return EXIT_PREFLIGHT
    if d.is_main:
        Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
        dump_config(cfg, Path(cfg.out_dir) / "run.yaml")

    def on_timeout() -> None:
        if d.is_main:
            events.emit("warning", kind="stop_timeout", message=f"stop exceeded {cfg.train.stop_timeout_s}s: exiting without a final checkpoint")
        os._exit(EXIT_STOP_TIMEOUT)

    stop = StopRequest(cfg.train.stop_timeout_s, on_timeout)
    stop.install()
    trainer = Trainer(cfg, d, events)
    trainer.build()
    trainer.resume()
    try:
        return trainer.run(stop)
    finally:
        trainer.close()
        if d.enabled and dist.is_initialized():
            dist.destroy_process_group()
