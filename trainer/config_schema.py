"""The run config's reference: every key with its type, default and meaning, for `dflash config --schema`
and docs/reference/config.md (a test keeps the page current). Light side."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from trainer.config import RunConfig


def _type_name(ann: Any) -> str:
    import typing

    origin = typing.get_origin(ann)
    args = typing.get_args(ann)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " | ".join(_type_name(a) for a in args)
    if origin in (list, tuple):
        inner = ", ".join(_type_name(a) for a in args if a is not Ellipsis)
        return f"{origin.__name__}[{inner}]"
    if ann is type(None):
        return "null"
    return {Path: "path"}.get(ann, getattr(ann, "__name__", str(ann)))


def schema_reference() -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) rows for docs and `dflash config --schema`."""
    rows: list[tuple[str, str, str, str]] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            ann = field.annotation
            key = f"{prefix}{name}"
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, key + ".")
                continue
            if field.is_required():
                default = "required"
            else:
                value = field.get_default(call_default_factory=True)
                default = (
                    "null"
                    if value is None
                    else json.dumps(list(value) if isinstance(value, tuple) else value)
                )
            rows.append((key, _type_name(ann), default, field.description or ""))

    walk(RunConfig, "")
    return rows


def schema_markdown() -> str:
    """The run-config reference table (docs/reference/config.md embeds it; a test keeps it current)."""
    lines = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for key, typ, default, desc in schema_reference():
        lines.append(
            f"| `{key}` | {typ.replace('|', '&#124;')} | `{default}` | {desc.replace('|', '&#124;')} |"
        )
    return "\n".join(lines) + "\n"
