"""The run config's `eval:` section: τ measured while training (light side: pydantic only).

With `prompts` set, at every `every_steps` steps and after the final checkpoint, the run measures
the acceptance length τ of the checkpoint it just wrote on `prompts` with `dflash eval` (chain, and a
tree at `tree_budget` when set) and writes an `eval` event (trainer/training/evaluation.py runs it)."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

DEVICE = re.compile(r"^(trainer|cpu|cuda:\d+)$")


class EvalConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

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
        "(humaneval, mt-bench, ...), relative to the config's folder; null: no evaluation while training",
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
        "trainer, or the CPU), cpu, or cuda:N (a spare GPU of the node)",
    )

    @property
    def enabled(self) -> bool:
        return self.prompts is not None

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not DEVICE.match(v):
            raise ValueError(f"{v!r}: trainer, cpu or cuda:N")
        return v

    def resolve_paths(self, base: Path) -> None:
        """A prompt file given relative resolves against `base` (the config's folder); a named set
        stays a name."""
        from trainer.eval.prompts import is_prompt_set

        if self.prompts is None or is_prompt_set(self.prompts):
            return
        p = Path(self.prompts).expanduser()
        self.prompts = str(p if p.is_absolute() else (base / p).resolve())
