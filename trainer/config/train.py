"""The run config's `train:` section: steps or a time budget, the schedule, the loss, the optimizer,
the batch, sharding, checkpoints and the run's watchdogs (light side: pydantic only; the section's
reference is docs/reference/config.md, written from these fields)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from trainer.config.section import Section, seconds

Beta = Annotated[float, Field(ge=0, lt=1)]  # an AdamW beta: a decay rate, 1 or more never forgets


class TrainConfig(Section):
    max_steps: int = Field(
        1000, ge=1, le=10**9, description="optimizer steps; the last step event has step=max_steps"
    )
    time_budget: str | None = Field(
        None,
        description="wall time the run may take (20h, 30m, 90s, 1h30m): the lr schedule follows the "
        "run's progress through it, the final checkpoint lands before it ends, restarts count the time "
        "spent; max_steps (unset: 10**9) ends the run if reached first (docs/train.md, time budget)",
    )
    lr: float = Field(
        6.0e-4,
        gt=0,
        le=1,
        description="peak learning rate (SpecForge Qwen3.6-27B: 6e-4); Muon's too while muon_lr is null "
        "(its update scaled to AdamW's RMS, speculators' match_rms_adamw)",
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="cosine floor as a fraction of lr")
    warmup_steps: int | None = Field(None, ge=0, description="default: warmup_ratio * max_steps")
    warmup_ratio: float = Field(
        0.04, ge=0, le=1, description="warmup share of max_steps when warmup_steps is unset"
    )
    schedule: Literal["cosine", "constant"] = Field(
        "cosine", description="lr after warmup: cosine decay to min_lr_ratio, or constant"
    )
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW weight decay")
    betas: tuple[Beta, Beta] = Field((0.9, 0.95), description="AdamW betas, each in [0, 1)")
    grad_clip: float = Field(1.0, gt=0, le=1e6, description="max global grad norm")
    seed: int = Field(0, description="seeds init, sampling order and anchors; same seed = same run")
    checkpoint_every: int = Field(500, ge=1, description="steps between checkpoints (and one at the end)")
    keep_checkpoints: int = Field(3, ge=1, description="newest K complete checkpoints kept")
    max_tokens_per_batch: int = Field(
        8192, ge=8, description="packed sequence length per rank (batch size 1, document ids)"
    )
    grad_accum_steps: int = Field(
        1,
        ge=1,
        description="micro-batches per optimizer step and rank, gradients accumulated: a step sees "
        "world_size x grad_accum_steps packed batches (the same ones, whatever the split)",
    )
    loss: Literal["ce", "kl_div"] = Field("ce", description="ce: hard CE to the verifier argmax (paper)")
    loss_chunk_rows: int = Field(
        0,
        ge=0,
        description="0: speculators' forward holds [anchors x block, vocab] logits and targets; N: heads and "
        "loss over N query rows at a time, recomputed in the backward (same loss; memory of N rows)",
    )
    position_weights: Literal["exp", "dpace"] = Field(
        "dpace",
        description="per-position loss weights in a block: dpace = D-PACE, each position weighted by the "
        "smoothed chance that the drafter's block is still accepted there (speculators' dpace_loss_decay, "
        "dpace_alpha; their DFlash default); exp = exp(-(k-1)/gamma) (the DFlash paper). Default dpace: "
        "tau 1.547 -> 1.709 on top of Muon in this project's ablation (docs/evaluate.md)",
    )
    gamma: float = Field(
        7.0,
        gt=0,
        le=1e4,
        description="per-position loss decay exp(-(k-1)/gamma) (position_weights exp)",
    )
    dpace_alpha: float = Field(
        0.5, gt=0, le=1, description="D-PACE confidence smoothing (position_weights dpace; speculators' 0.5)"
    )
    optimizer: Literal["adamw", "muon"] = Field(
        "muon",
        description="muon: torch's Muon on the 2-D weight matrices (speculators' split: not embeddings or "
        "heads) and AdamW on the rest, one optimizer state in the checkpoint, ZeRO-1 and FSDP2 alike; "
        "adamw: AdamW on every trainable tensor. Default muon: speculators' DFlash default, and tau "
        "1.307 -> 1.547 at equal wall time in this project's ablation (docs/evaluate.md)",
    )
    muon_lr: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Muon's peak learning rate (null: train.lr; the schedule scales both)",
    )
    muon_momentum: float = Field(0.95, ge=0, lt=1, description="Muon's momentum (speculators' 0.95)")
    muon_weight_decay: float = Field(0.1, ge=0, le=1, description="Muon's weight decay (speculators' 0.1)")
    max_anchors: int = Field(
        512,
        ge=1,
        description="anchored blocks sampled per packed batch: more anchors train more blocks on one "
        "target forward (the memory model counts anchors x block query rows)",
    )
    precision: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="auto: bf16 autocast on CUDA, float32 on CPU"
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: CUDA when visible, else CPU")
    shard: Literal["none", "optimizer", "full"] = Field(
        "optimizer",
        description="with more than one rank: none = DDP, every rank holds the whole drafter and AdamW; "
        "optimizer = DDP + AdamW's moments sharded (ZeRO-1, torch ZeroRedundancyOptimizer); full = FSDP2 "
        "(torch fully_shard): trainable weights, gradients and moments sharded, each draft layer gathered "
        "only while it runs. Checkpoints hold the full state in one format whatever the level",
    )
    share_target_embedding: bool = Field(
        True,
        description="the drafter's noise embedding read from the in-process target's own embedding "
        "instead of a second fp32 copy (vocab x hidden x 4 B per rank); checked equal at the start, "
        "kept as a copy (and said in run_start) when it is not",
    )
    activation_checkpointing: bool = Field(
        False,
        description="keep only each draft layer's input in the forward and recompute the layer in the "
        "backward (transformers' gradient checkpointing, non-reentrant): activations of one layer, "
        "not of all, at the cost of one more forward of the draft layers",
    )
    log_every: int = Field(1, ge=1, description="steps between step events")
    stop_timeout_s: float = seconds(
        600.0, "bound on SIGTERM -> final checkpoint -> exit; past it the run exits 3"
    )
    collective_timeout_s: float = seconds(
        900.0,
        "bound on one collective (all-reduce, barrier): a rank or node that is gone fails the "
        "others' run after this, and torchrun restarts the group; above the slowest checkpoint write",
    )
    stall_factor: float = Field(
        10.0,
        gt=1,
        le=1e6,
        description="a step running this many times the median step is a stall (warning event)",
    )
    stall_min_s: float = seconds(120.0, "never call a step stalled before this many seconds")
    agreement_every: int = Field(
        50,
        ge=1,
        description="steps between target_agreement checks (and step 1): verifier argmax vs the data",
    )
    min_target_agreement: float = Field(
        0.5, ge=0, le=1, description="warn when fewer supervised tokens are the target's own greedy choice"
    )
    nan_tolerance: int = Field(
        3, ge=0, description="consecutive non-finite losses skipped (warned) before the run stops"
    )

    @model_validator(mode="before")
    @classmethod
    def _shard_optimizer_state(cls, data: Any) -> Any:
        """The boolean this field replaced (still in older run.yaml files): true = optimizer, false = none."""
        if isinstance(data, dict) and "shard_optimizer_state" in data:
            data = dict(data)
            old = data.pop("shard_optimizer_state")
            if not isinstance(old, bool):
                raise ValueError(f"train.shard_optimizer_state must be true or false, got {old!r}")
            if "shard" in data and data["shard"] != ("optimizer" if old else "none"):
                raise ValueError(
                    "train.shard_optimizer_state (replaced by train.shard) contradicts train.shard: "
                    "keep only train.shard"
                )
            data["shard"] = "optimizer" if old else "none"
        return data

    @field_validator("time_budget")
    @classmethod
    def _time_budget(cls, v: str | None) -> str | None:
        from trainer.config.duration import parse_duration

        if v is not None:
            parse_duration(v)  # refused here, before any work: exit 2 with the form to write
        return v if v is None else v.strip()

    @model_validator(mode="before")
    @classmethod
    def _budget_steps(cls, data: Any) -> Any:
        """With a time budget and no max_steps, the budget alone ends the run; warm-up is a share of it."""
        if isinstance(data, dict) and data.get("time_budget") is not None:
            if data.get("warmup_steps") is not None:
                raise ValueError("train.warmup_steps counts steps; with train.time_budget use warmup_ratio")
            from trainer.config.duration import BUDGET_ONLY_STEPS

            data = {"max_steps": BUDGET_ONLY_STEPS} | data
        return data

    @property
    def time_budget_s(self) -> float | None:
        from trainer.config.duration import parse_duration

        return None if self.time_budget is None else parse_duration(self.time_budget)

    @model_validator(mode="after")
    def _warmup(self) -> TrainConfig:
        if self.warmup_steps is not None and self.warmup_steps > self.max_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) > max_steps ({self.max_steps})")
        return self

    @property
    def resolved_warmup_steps(self) -> int:
        if self.warmup_steps is not None:
            return self.warmup_steps
        return int(self.warmup_ratio * self.max_steps)

    def max_tokens_per_step(self, world_size: int) -> int:
        """The most tokens one optimizer step sees over all ranks and micro-batches."""
        return self.max_tokens_per_batch * world_size * self.grad_accum_steps
