"""The preflight report: every `Problem` the gates found (errors refuse a run, warnings inform), the
figures each gate measured (target, data, machine), and their rendering as text and as JSON."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.target.info import WeightHeaders


@dataclass(frozen=True)
class Problem:
    """One finding. `code` is stable (scripts match on it); `fix` names what to change."""

    code: str
    message: str
    fix: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass
class PreflightReport:
    errors: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    target: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors

    def error(self, code: str, message: str, fix: str) -> None:
        self.errors.append(Problem(code, message, fix))

    def warn(self, code: str, message: str, fix: str) -> None:
        self.warnings.append(Problem(code, message, fix))

    def weight_errors(self, prefix: str, weights: WeightHeaders, fix: str) -> None:
        """One error per problem of a folder's safetensors headers, coded `{prefix}_{kind}`."""
        for kind, message in weights.problems:
            self.error(f"{prefix}_{kind}", message, fix)

    def codes(self) -> list[str]:
        return [p.code for p in self.errors + self.warnings]

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "errors": [p.to_dict() for p in self.errors],
            "warnings": [p.to_dict() for p in self.warnings],
            "target": self.target,
            "data": self.data,
            "machine": self.machine,
        }

    def render_text(self) -> str:
        verdict = "OK" if self.ok else "REFUSED"
        counts = f"{len(self.errors)} error(s), {len(self.warnings)} warning(s)"
        lines = [f"dflash preflight: {verdict} ({counts})"]
        lines += _render_target(self.target) + _render_data(self.data) + _render_machine(self.machine)
        for label, problems in (("ERROR", self.errors), ("WARNING", self.warnings)):
            for p in problems:
                lines.append(f"{label} [{p.code}] {p.message}")
                lines.append(f"    fix: {p.fix}")
        return "\n".join(lines)


def _render_target(t: dict[str, Any]) -> list[str]:
    if not t:
        return []
    lines = [
        f"target  {t['path']}: {t['num_layers']} layers, hidden {t['hidden']}, vocab {t['vocab']}; "
        f"aux ids (speculators convention) {t['aux_ids']}"
    ]
    s = t.get("vllm_server")
    if s:
        limit = f"{s['limit'] if s['limit'] is not None else 'any'} ({s['limit_from']})"
        lines.append(
            f"vllm    the server is asked for max_model_len {s['max_model_len']} (the run needs "
            f"{s['needed']}; the target allows {limit}), layers {s['layer_ids']}, dtype {s['dtype']}"
        )
    return lines


def _render_data(d: dict[str, Any]) -> list[str]:
    if not d:
        return []
    dropped = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in d["dropped_by_reason"].items())
    lines = [
        f"data    {d['path']}: {d['num_samples']} samples, {d['usable']} usable, {d['dropped']} dropped "
        f"({dropped}); {d['short']} with < {d['min_supervised_tokens']} supervised tokens "
        f"({pct(d['short_fraction'])})",
        "        supervised tokens per sample:",
    ]
    rows = d["histogram"]
    last = max((i for i, row in enumerate(rows) if row["samples"]), default=0)
    peak = max(row["samples"] for row in rows) or 1
    for row in rows[: last + 1]:  # every bucket up to the last non-empty one
        bar = "#" * math.ceil(30 * row["samples"] / peak)
        lines.append(f"        {row['supervised_tokens']:>10} | {bar:<30} {row['samples']}")
    return lines


def _render_machine(m: dict[str, Any]) -> list[str]:
    lines = [f"device  {m['device']}"] if m.get("device") else []
    disk = m.get("disk")
    if disk:
        from trainer.layout.disk import render

        lines.append(
            f"disk    need {disk['need_gb']:.2f} GB free for what is still to be written, free "
            f"{disk['free_gb']:.2f} GB at {disk['path']}; the run's disk budget:"
        )
        lines += render(disk["budget"], indent="          ") if "budget" in disk else []
    mem = m.get("memory")
    if mem and "skipped" in mem:
        lines.append(f"memory  skipped: {mem['skipped']}")
    elif mem:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in mem["parts_gib"].items())
        lines.append(
            f"memory  need ~{mem['need_gib']:.2f} GiB ({parts}), available {mem['available_gib']:.2f} GiB "
            f"on {mem['device']}"
        )
    return lines


def pct(x: float) -> str:
    return f"{x:.1%}"
