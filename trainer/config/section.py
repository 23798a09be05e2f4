"""The base of every run-config section (light side: pydantic only): unknown keys are errors, a
float or a number past 2**53 where a whole number belongs is refused, not rounded, and no float is
infinite or NaN (`lr: .inf` is refused naming the key, before anything trains). Each float field
declares its range beside its default (ge/gt and le/lt; tests/unit/test_config.py holds every one
to both bounds); docs/reference/config.md lists them."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

MAX_WHOLE = 2**53  # any count a config holds: beyond it a float has already lost the number
MAX_SECONDS = 30 * 86400.0  # any timeout a config holds: past it, a wait that never ends


def seconds(default: float, description: str) -> Any:
    """A timeout or wait in seconds, as every section declares one: more than zero, at most
    MAX_SECONDS."""
    return Field(default, gt=0, le=MAX_SECONDS, description=description)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _whole_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        """A float where a whole number belongs (`max_steps: 1.0e+15`, `block_size: 16.0`) is refused,
        not rounded, and so is a whole number past 2**53."""
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and field.annotation in (int, int | None) and not isinstance(v, bool):
            if isinstance(v, float):
                raise ValueError("not a whole number (write it without . or e)")
            if isinstance(v, int) and abs(v) > MAX_WHOLE:
                raise ValueError("beyond any run (at most 2**53)")
        return v
