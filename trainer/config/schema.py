"""The run config's reference: every key with its type, default, range and meaning, for `dflash config
--schema` and docs/reference/config.md (a test keeps the page current). Light side."""

from __future__ import annotations

import json
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from trainer.config.run import RunConfig


def _type_name(ann: Any) -> str:
    origin = typing.get_origin(ann)
    args = typing.get_args(ann)
    if origin is Annotated:
        return _type_name(args[0])
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


def leaf_fields(model: type[BaseModel] = RunConfig, prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """(dotted key, field) of every leaf key of the run config, in file order."""
    for name, field in model.model_fields.items():
        ann = field.annotation
        key = f"{prefix}{name}"
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from leaf_fields(ann, key + ".")
        else:
            yield key, field


def _holds_float(ann: Any) -> bool:
    return ann is float or any(_holds_float(a) for a in typing.get_args(ann))


def float_fields() -> list[tuple[str, FieldInfo]]:
    """The leaf keys that hold a float (alone, optional or in a tuple): each is finite and in the
    range it declares (trainer/config/section.py)."""
    return [(key, field) for key, field in leaf_fields() if _holds_float(field.annotation)]


def bounds(field: FieldInfo) -> list[Any]:
    """The range constraints (Gt/Ge/Lt/Le) a field declares: its own, or its items' (`betas`)."""
    found = [m for m in field.metadata if isinstance(m, at.Gt | at.Ge | at.Lt | at.Le)]
    for arg in typing.get_args(field.annotation):  # tuple[Beta, Beta]: the items' Field(...)
        if typing.get_origin(arg) is Annotated:
            for extra in typing.get_args(arg)[1:]:
                inner = extra.metadata if isinstance(extra, FieldInfo) else [extra]
                found += [m for m in inner if isinstance(m, at.Gt | at.Ge | at.Lt | at.Le)]
    return found


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e7 else f"{v:g}"


def value_range(field: FieldInfo) -> str:
    """The declared range as an interval, `(0, 1]`, `[0, 2592000]`, or "" when none is declared."""
    lo = hi = None
    for m in bounds(field):
        if isinstance(m, at.Gt):
            lo = f"({_num(m.gt)}"
        elif isinstance(m, at.Ge):
            lo = f"[{_num(m.ge)}"
        elif isinstance(m, at.Lt):
            hi = f"{_num(m.lt)})"
        elif isinstance(m, at.Le):
            hi = f"{_num(m.le)}]"
    if lo is None and hi is None:
        return ""
    return f"{lo or '(-inf'}, {hi or 'inf)'}"


def schema_reference() -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) rows for docs and `dflash config --schema`."""
    rows: list[tuple[str, str, str, str]] = []
    for key, field in leaf_fields():
        if field.is_required():
            default = "required"
        else:
            value = field.get_default(call_default_factory=True)
            default = (
                "null" if value is None else json.dumps(list(value) if isinstance(value, tuple) else value)
            )
        rows.append((key, _type_name(field.annotation), default, field.description or ""))
    return rows


def schema_markdown() -> str:
    """The run-config reference table (docs/reference/config.md embeds it; a test keeps it current)."""
    ranges = {key: value_range(field) for key, field in leaf_fields()}
    lines = ["| key | type | default | range | meaning |", "| --- | --- | --- | --- | --- |"]
    for key, typ, default, desc in schema_reference():
        span = f"`{ranges[key]}`" if ranges[key] else ""
        lines.append(
            f"| `{key}` | {typ.replace('|', '&#124;')} | `{default}` | {span} | "
            f"{desc.replace('|', '&#124;')} |"
        )
    return "\n".join(lines) + "\n"
