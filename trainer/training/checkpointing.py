"""Checkpointing as the loop uses it: resume from global rank 0's newest verified checkpoint, and
save the state after a step. Both are collectives (every rank calls them; rank 0 reads and writes
the folder, `trainer.store.checkpoint` owns its format).

The interface is the trainer's state, named in `TrainState`: the run config, the ranks, the event
writer and what a checkpoint holds (the drafter, its sharding, optimizer, scheduler and sampler,
the step and token counts)."""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch
import torch.distributed as dist

from trainer.store import checkpoint as ckpt
from trainer.training.distributed import all_ranks, gather_objects
from trainer.training.state import rng_state, set_rng_state


class TrainState(Protocol):
    """What `resume` and `save` read and set on the trainer."""

    cfg: Any
    d: Any  # trainer.training.distributed.Dist
    events: Any  # trainer.store.events.EventWriter
    drafter: Any
    sharding: Any  # trainer.training.sharding.Sharding
    optimizer: Any
    scheduler: Any
    sampler: Any
    step: int
    tokens: int
    resumed_from: str | None
    step_start: tuple[Any, Any]  # (sampler, RNG) as the current step found them (vLLM source)
    saved_step: int | None  # set here: the step of the newest checkpoint written
    budget: Any  # trainer.training.budget.BudgetControl with train.time_budget, else None

    def emit(self, event: str, **fields) -> None: ...
    def log(self, msg: str) -> None: ...


def resume(tr: TrainState) -> None:
    """Resume from global rank 0's newest verified checkpoint. Ranks on another node (no shared
    filesystem: only rank 0 writes checkpoints) that lack that very checkpoint, verified, get rank
    0's copy over the process group, so every rank starts from the same state."""
    d = tr.d
    folder, problems = ckpt.find_resume_checkpoint(tr.cfg.out_dir, finite=True)
    for p in problems:
        if ckpt.NONFINITE in p:  # written before saves were checked (a diverged step)
            tr.emit("warning", kind="nonfinite_checkpoint", message=p)
            tr.log(f"WARNING checkpoint holds inf/NaN, skipped: {p}")
            continue
        tr.emit("warning", kind="corrupt_checkpoint", message=p)
        tr.log(f"WARNING checkpoint does not verify, skipped: {p}")
    names = gather_objects(folder.name if folder else None, d)
    chosen = names[0]
    if chosen is None:
        if any(names):
            tr.log(
                f"WARNING rank 0 has no verified checkpoint, other ranks have {set(names) - {None}}: "
                "starting from step 0 (checkpoints are rank 0's)"
            )
        return
    from trainer.drafter.model import check_same_draft_vocab, read_trainable_weights

    lacking = [r for r, n in enumerate(names) if n != chosen]
    if lacking:
        folder = ckpt.checkpoints_dir(tr.cfg.out_dir) / chosen
        sent = [None, None]
        if d.is_main:
            check_same_draft_vocab(tr.drafter, folder / "model.safetensors")
            sent = [
                ckpt.load_trainer_state(folder),
                read_trainable_weights(tr.drafter, folder / "model.safetensors"),
            ]
        dist.broadcast_object_list(sent, src=0)
        state, weights = sent
        tr.log(f"ranks {lacking} lack {chosen}: rank 0's copy sent over the process group")
    else:
        state = ckpt.load_trainer_state(folder)
        weights = read_trainable_weights(tr.drafter, folder / "model.safetensors")
        check_same_draft_vocab(tr.drafter, folder / "model.safetensors")
    if not state["optimizer"].get("state"):
        raise ckpt.CheckpointError(
            f"{folder}: optimizer state is empty: refusing a resume that restores nothing"
        )
    # the full state on every rank; ZeRO-1 and FSDP keep only this rank's share of it
    tr.sharding.load_state(weights, tr.optimizer, state["optimizer"])
    tr.scheduler.load_state_dict(state["scheduler"])
    tr.sampler.load_state_dict(
        state["sampler"][d.rank] if isinstance(state["sampler"], list) else state["sampler"]
    )
    rngs = state["rng"]
    set_rng_state(rngs[d.rank] if isinstance(rngs, list) else rngs)
    tr.step, tr.tokens = int(state["step"]), int(state["tokens"])
    if tr.budget is not None:  # the time spent goes on counting (budget.json's, when later)
        tr.budget.load_state_dict(state.get("budget"), tr.step)
    tr.resumed_from = chosen
    tr.log(f"resumed from {folder.name} (step {tr.step}, {tr.tokens} tokens)")


def save(tr: TrainState, reason: str, at_step_start: bool = False) -> ckpt.Saved | None:
    """A checkpoint of the state after step `tr.step`; rank 0 gets what it wrote, the others None.
    `at_step_start`: the step after it failed part way (a hidden-state source gave up): the sampler
    and RNG as that step found them, so a resume draws and trains its batches again. Raises when the
    ranks' weights differ (after every rank has passed the barrier), and `ckpt.NonFiniteState` on every
    rank when the state holds inf or NaN: nothing written, `latest` kept, a `checkpoint_refused`
    warning."""
    d, sh = tr.d, tr.sharding
    # collectives: every rank sends its shards, rank 0 gets the full weights and optimizer state
    weights, optimizer_state = sh.gather_state(tr.optimizer)
    moments = gather_objects(sh.local_moment_numel(tr.optimizer), d)
    sampler, rng = tr.step_start if at_step_start else (tr.sampler.state_dict(), rng_state())
    samplers = gather_objects(sampler, d)
    rngs = gather_objects(rng, d)
    sums = [float(x) for x in torch.cat(gather_objects(sh.fingerprint(), d))]
    in_sync = all(x == sums[0] for x in sums)
    saved = refused = None
    if d.is_main:
        state = {
            "step": tr.step,
            "tokens": tr.tokens,
            "optimizer": optimizer_state,
            "scheduler": tr.scheduler.state_dict(),
            "sampler": samplers if d.enabled else samplers[0],
            "rng": rngs if d.enabled else rngs[0],
            "world_size": d.world_size,
        }
        if tr.budget is not None:  # train.time_budget's clock and the schedule's progress
            state["budget"] = tr.budget.state_dict()
        meta = {
            "tokens": tr.tokens,
            "run_id": tr.events.run_id,
            "reason": reason,
            "time": time.time(),
            "world_size": d.world_size,
            "ranks_in_sync": in_sync,
        }
        try:
            saved = ckpt.save_checkpoint(
                tr.cfg.out_dir,
                tr.step,
                tr.drafter,
                state,
                meta,
                tr.cfg.train.keep_checkpoints,
                state_dict=weights,
            )
        except ckpt.NonFiniteState as exc:
            refused = exc
            tr.emit("warning", kind="checkpoint_refused", step=tr.step, reason=reason, message=str(exc))
            tr.log(f"ERROR checkpoint refused: {exc}")
    if not all_ranks(refused is None, d):  # every rank leaves together, none waits in the barrier
        raise refused or ckpt.NonFiniteState(f"step {tr.step}: rank 0 refused the checkpoint")
    if d.is_main:
        tr.emit(
            "checkpoint",
            step=tr.step,
            name=saved.path.name,
            path=str(saved.path),
            size_bytes=saved.size_bytes,
            seconds=round(saved.seconds, 3),
            reason=reason,
            ranks_in_sync=in_sync,
            removed=saved.removed,
            optimizer_sharded=sh.level != "none",
            shard=sh.level,
            moment_numel_per_rank=moments,
        )
        mib = saved.size_bytes / 2**20
        tr.log(f"checkpoint {saved.path.name} ({mib:.1f} MiB, {saved.seconds:.2f}s, {reason})")
    if d.enabled:
        dist.barrier()
    if not in_sync:
        raise RuntimeError(f"ranks diverged: weight checksums {sums}")
    tr.saved_step = tr.step
    return saved
