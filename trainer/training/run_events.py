"""What the loop tells the event stream and the log, from rank 0: `run_start` (the layout and the
totals the monitor and the roles read), the step events at `train.log_every` (with the log line at
ten times that), and `run_end`. The loop hands over figures; the event names and fields live here
(their schema: trainer/store/events.py and docs)."""

from __future__ import annotations

import time
from typing import Any

from trainer.config.duration import BUDGET_ONLY_STEPS
from trainer.salvage.proc import identity
from trainer.store import checkpoint as ckpt


class RunEvents:
    """Rank 0's voice of a run: `emit` and `log` are no-ops on the other ranks."""

    def __init__(self, cfg, d, events):
        self.cfg, self.d, self.events = cfg, d, events
        self.t_start = time.monotonic()

    def log(self, msg: str) -> None:
        if self.d.is_main:
            self.events.log(msg)

    def emit(self, event: str, **fields) -> None:
        if self.d.is_main:
            self.events.emit(event, **fields)

    def run_start(self, tr) -> None:
        """`run_start` with the layout and totals of the built trainer `tr` (resumed or not)."""
        cfg, d = self.cfg, self.d
        total = cfg.train.max_steps
        self.emit(
            "run_start",
            schema_version=1,
            config=cfg.to_dict(),
            resumed_from=tr.resumed_from,
            start_step=tr.step,
            tokens=tr.tokens,
            layout={
                "world_size": d.world_size,
                "device": str(d.device),
                "device_chosen_by": d.device_why,
                "target_devices": [str(x) for x in d.target_devices],
                "source": cfg.target.source,
                "source_url": getattr(tr.source, "url", None),
                "source_server_pid": getattr(getattr(tr.source, "server", None), "pid", None),
                "gpus_per_copy": cfg.target.gpus_per_copy,
                "precision": "bf16-autocast" if tr.bf16 else "fp32",
                "aux_ids": cfg.drafter.aux_ids,
                "target_layers": tr.source.num_layers,
                "hidden_size": tr.source.hidden_size,
                "drafter_trainable_params": tr.n_trainable,
                "draft_vocab_size": int(tr.drafter.draft_vocab_size),
                "draft_vocab_coverage": round(float(tr.drafter.draft_vocab_coverage), 6),
                "position_weights": cfg.train.position_weights,
                "optimizer": tr.sharding.description,
                "shard": tr.sharding.level,
                "activation_checkpointing": cfg.train.activation_checkpointing,
                "embedding_shared_with_target": tr.embedding_not_shared is None,
                "embedding_not_shared_because": tr.embedding_not_shared,
            },
            totals={
                "total_steps": total,
                "max_tokens_per_step": cfg.train.max_tokens_per_step(d.world_size),
                "total_tokens": None
                if total == BUDGET_ONLY_STEPS and tr.budget is not None
                else cfg.train.max_tokens_per_step(d.world_size) * total,
                "data": tr.data_totals,
                **(tr.budget.start_fields() if tr.budget is not None else {}),
            },
            **identity(),  # pid, its start ticks and boot id: `salvage stop` proves it is this run
        )
        steps = f"steps {tr.step + 1}..{total}"
        if tr.budget is not None:  # the clock ends it (or max_steps, when sooner)
            b = tr.budget.start_fields()
            steps = f"steps from {tr.step + 1} within the time budget of {b['time_budget_s']:g}s "
            steps += f"({b['budget_spent_s']:g}s spent)"
            steps += "" if total == BUDGET_ONLY_STEPS else f" or to step {total}"
        self.log(
            f"run start: {steps}, world {d.world_size}, "
            f"device {d.device} ({d.device_why}), "
            f"{tr.n_trainable / 1e6:.2f}M trainable drafter params, aux ids {cfg.drafter.aux_ids}, "
            f"{tr.sharding.description}, heads over {tr.drafter.draft_vocab_size} tokens "
            f"({tr.drafter.draft_vocab_coverage:.1%} of the supervised tokens)"
        )
        self.t_start = time.monotonic()  # run_end's wall_s counts from here

    def step(self, step: int, tokens: int, m: dict[str, Any], nodes=None, last: bool = False) -> None:
        """The step event every `train.log_every` steps and at the last one (max_steps', or `last`: a
        time budget's); a log line at step 1, every ten events and the last step. `nodes`: each node's
        progress (multi-node, rank 0)."""
        total, every = self.cfg.train.max_steps, self.cfg.train.log_every
        last = last or step == total
        if step % every and not last:
            return
        if nodes is not None:
            m["nodes"] = nodes()
        self.emit("step", step=step, total_steps=total, tokens=tokens, **m)
        if step % max(1, every * 10) == 0 or last or step == 1:
            of = "" if total == BUDGET_ONLY_STEPS else f"/{total}"  # a time budget alone: no step total
            self.log(
                f"step {step}{of} loss {m['loss']:.4f} eal {m['eal'] or 0:.3f} "
                f"lr {m['lr']:.2e} {m['tokens_per_s'] or 0:.0f} tok/s"
            )

    def wall_s(self) -> float:
        return round(time.monotonic() - self.t_start, 3)

    def run_failed(self, status: str, step: int, tokens: int, exc: BaseException) -> None:
        self.emit(
            "run_end",
            status=status,
            step=step,
            tokens=tokens,
            error=f"{type(exc).__name__}: {exc}",
            wall_s=self.wall_s(),
        )
        self.log(f"run failed at step {step}: {type(exc).__name__}: {exc}")

    def run_end(self, status: str, step: int, tokens: int, signum: int | None, **extra) -> None:
        """`extra`: the time budget's figures (BudgetControl.finish)."""
        latest = ckpt.read_latest(self.cfg.out_dir)
        self.emit(
            "run_end",
            status=status,
            step=step,
            tokens=tokens,
            wall_s=self.wall_s(),
            signal=signum,
            last_checkpoint=latest.name if latest else None,
            **extra,
        )
        self.log(f"run {status} at step {step}")
