"""The run config's `eval:` section: τ measured while training (light side: pydantic only).

With `prompts` (or `holdout`) set, at every `every_steps` steps and after the final checkpoint, the
run measures the acceptance length τ of the checkpoint it just wrote on those prompts with `dflash
eval` (chain, and a tree at `tree_budget` when set) and writes an `eval` event
(trainer/training/evaluation.py runs it). `holdout: N` keeps N samples of `data.path` out of training
(the sampler never sees them) and evaluates on their prompts (trainer/data.py, holdout)."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEVICE = re.compile(r"^(trainer|cpu|cuda:\d+(,\d+)*)$")


def holdout_file(out_dir: Path | str) -> Path:
    """Where a run with `eval.holdout` writes its held-out samples' prompts."""
    return Path(out_dir) / "eval" / "holdout.jsonl"


class EvalConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    every_steps: int | None = Field(
        None,
        ge=1,
        strict=True,
        description="steps between evaluations (each on a checkpoint written at that step); null: only "
        "after the final checkpoint",
    )
    prompts: str | None = Field(
        None,
        description="a prompt file as `dflash eval --prompts` reads it (JSON lines), or a named set "
        "(humaneval, mt-bench, ...), relative to the config's folder; null: no evaluation while training "
        "(unless holdout is set)",
    )
    holdout: int | None = Field(
        None,
        ge=1,
        strict=True,
        description="instead of prompts: N samples of data.path (seeded by train.seed) kept out of "
        "training by the sampler, their prompts (the tokens before each one's first supervised token, "
        "written to OUT/eval/holdout.jsonl) evaluated",
    )
    limit: int | None = Field(None, ge=1, strict=True, description="only the first N prompts")
    max_new_tokens: int = Field(128, ge=1, strict=True, description="tokens generated per prompt")
    tree_budget: int | None = Field(
        None, ge=1, strict=True, description="also τ of a tree of at most N drafted nodes per round"
    )
    check_lossless: int = Field(
        0,
        ge=-1,
        strict=True,
        description="prompts checked against the target's own greedy decoding (-1 all, 0 none)",
    )
    device: str = Field(
        "trainer",
        description="where the evaluation runs: trainer (global rank 0's device: its GPU, beside the "
        "trainer, or the CPU), cpu, or cuda:N[,M...] (the node's last GPUs, kept out of training: "
        "`dflash plan` counts them and sets this when rank 0's GPU cannot hold the evaluation too)",
    )

    @property
    def enabled(self) -> bool:
        return self.prompts is not None or self.holdout is not None

    def prompt_source(self, out_dir: Path | str) -> str:
        """What `dflash eval --prompts` reads: the prompt file or named set, or the held-out samples'
        prompts the run wrote into its out_dir."""
        return self.prompts if self.prompts is not None else str(holdout_file(out_dir))

    @model_validator(mode="after")
    def _one_source(self) -> EvalConfig:
        if self.prompts is not None and self.holdout is not None:
            raise ValueError("eval.prompts and eval.holdout both set: evaluate on one of them")
        return self

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not DEVICE.match(v):
            raise ValueError(f"{v!r}: trainer, cpu or cuda:N[,M...] (the node's GPU numbers)")
        return v

    def resolve_paths(self, base: Path) -> None:
        """A prompt file given relative resolves against `base` (the config's folder); a named set
        stays a name."""
        from trainer.eval.prompts import is_prompt_set

        if self.prompts is None or is_prompt_set(self.prompts):
            return
        p = Path(self.prompts).expanduser()
        self.prompts = str(p if p.is_absolute() else (base / p).resolve())
