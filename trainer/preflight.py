"""Preflight: every check that can refuse a run, done in seconds before any GPU time is spent.

Three gates, each listing every problem it finds (a run is refused on any error; warnings inform):

- data: supervised tokens per sample (histogram), short responses, samples the loop would drop
  (no two consecutive supervised tokens, longer than data.max_length, input_ids/loss_mask length
  mismatch), token ids outside the target vocabulary;
- config: the target folder, aux layer ids (in speculators' convention, after conversion), the mask
  token, the block size, and a warm-start checkpoint's wiring (fc width, aux ids, hidden size);
- machine: free disk for the kept checkpoints, and a memory estimate against the device.

Light side: config.json files are read as JSON and safetensors files by their headers only; no
transformers or speculators import. torch is imported only to ask CUDA for its free memory.
`run_preflight` is the entry of `dflash preflight` and of `dflash train`. Docs: docs/preflight.md.
"""

from __future__ import annotations

from trainer.errors import DflashError
import json
import math
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from trainer.config import RunConfig
from trainer.data import REGENERATE_FIX, DataError, DataStats, compute_stats, flat_values, open_dataset
from trainer.layout.sizing import Shapes, per_device_bytes

GB = 1e9
GIB = float(2**30)
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on the JSON header
CHECKPOINT_OVERHEAD_BYTES = 16 * 2**20  # config, trainer state, RNG, sampler state
ADAM_STATE_BYTES = 2 * 4  # exp_avg + exp_avg_sq, fp32 (a checkpoint holds all of them)
MEMORY_TIGHT_SHARE = 0.9  # warn above this share of the device's memory

MASK_FIX = (
    "set drafter.mask_token_id to a real, otherwise unused row of the target embedding: a reserved "
    "special token of the target's tokenizer (Qwen3: 151669), never pad/eos/bos"
)
TARGET_FETCH_FIX = (
    "point target.path at a complete local transformers model folder (config.json + *.safetensors), "
    "e.g. `hf download MODEL --local-dir DIR`"
)
WARM_START_FIX = "point drafter.warm_start at a complete speculators DFlash checkpoint folder, or remove it"


# ---------------------------------------------------------------- report


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
    return [
        f"target  {t['path']}: {t['num_layers']} layers, hidden {t['hidden']}, vocab {t['vocab']}; "
        f"aux ids (speculators convention) {t['aux_ids']}"
    ]


def _render_data(d: dict[str, Any]) -> list[str]:
    if not d:
        return []
    dropped = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in d["dropped_by_reason"].items())
    lines = [
        f"data    {d['path']}: {d['num_samples']} samples, {d['usable']} usable, {d['dropped']} dropped "
        f"({dropped}); {d['short']} with < {d['min_supervised_tokens']} supervised tokens "
        f"({_pct(d['short_fraction'])})",
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
    lines = []
    disk = m.get("disk")
    if disk:
        lines.append(
            f"disk    need {disk['need_gb']:.2f} GB ({disk['checkpoints']} x {disk['checkpoint_gb']:.3f} GB "
            f"checkpoints + {disk['reserve_gb']:g} GB reserve), free {disk['free_gb']:.2f} GB "
            f"at {disk['path']}"
        )
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


def _pct(x: float) -> str:
    return f"{x:.1%}"


# ---------------------------------------------------------------- safetensors headers


class SafetensorsError(DflashError, ValueError):
    """A .safetensors file whose header cannot be read: truncated, or not safetensors at all."""


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a .safetensors file, read without loading any tensor.

    Returns {tensor name: {"dtype", "shape", "data_offsets"}, optionally "__metadata__": {...}}.
    Raises SafetensorsError naming the file when it is truncated (header or tensor data cut short)
    or is not a safetensors file."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise SafetensorsError(
                f"{path}: truncated safetensors file ({size} bytes, no 8-byte header length)"
            )
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES:
            raise SafetensorsError(f"{path}: not a safetensors file (header length {length} is implausible)")
        if 8 + length > size:
            raise SafetensorsError(
                f"{path}: truncated safetensors file (header of {length} bytes, file has {size} bytes)"
            )
        raw = fh.read(length)
    try:
        header = json.loads(raw)
        end = max((int(v["data_offsets"][1]) for v in tensor_entries(header).values()), default=0)
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise SafetensorsError(f"{path}: not a safetensors file (unreadable header: {exc})") from None
    if 8 + length + end > size:
        raise SafetensorsError(
            f"{path}: truncated safetensors file (tensor data ends at byte {8 + length + end}, "
            f"the file has {size} bytes; an interrupted download or copy?)"
        )
    return header


def tensor_entries(header: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The tensors of a safetensors header (without "__metadata__")."""
    return {k: v for k, v in header.items() if k != "__metadata__"}


@dataclass
class WeightHeaders:
    """The merged safetensors headers of a model folder (sharded or not) and what went wrong."""

    files: list[Path] = field(default_factory=list)
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)
    problems: list[tuple[str, str]] = field(default_factory=list)  # (kind, message)

    @property
    def numel(self) -> int:
        return sum(math.prod(t["shape"]) for t in self.tensors.values())


def read_weight_headers(folder: Path) -> WeightHeaders:
    """Headers of `folder`'s weights: the shards of model.safetensors.index.json, else *.safetensors.

    Problem kinds: "no_weights", "missing_shards", "bad_safetensors"."""
    out = WeightHeaders()
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            out.problems.append(("bad_safetensors", f"{index}: unreadable index ({exc})"))
            return out
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            absent = f"{index} lists {len(missing)} of {len(names)} shard(s) that are absent: {missing}"
            out.problems.append(("missing_shards", absent))
        out.files = [folder / n for n in names if n not in missing]
    else:
        out.files = sorted(folder.glob("*.safetensors"))
        if not out.files:
            out.problems.append(("no_weights", f"{folder} has no *.safetensors file"))
    for path in out.files:
        try:
            out.tensors.update(tensor_entries(read_safetensors_header(path)))
        except (SafetensorsError, OSError) as exc:
            out.problems.append(("bad_safetensors", str(exc)))
    return out


def _report_weight_problems(report: PreflightReport, prefix: str, weights: WeightHeaders, fix: str) -> None:
    for kind, message in weights.problems:
        report.error(f"{prefix}_{kind}", message, fix)


# ---------------------------------------------------------------- target description


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{path} is not readable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is not a JSON object")
    return raw


def _token_ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, (list, tuple)):
        return {int(v) for v in value}
    return {int(value)}


def _special_ids(role: str, *configs: dict[str, Any]) -> tuple[int, ...]:
    """`{role}_token_id` over config.json and generation_config.json (either may hold a list)."""
    return tuple(sorted(set().union(*(_token_ids(c.get(f"{role}_token_id")) for c in configs))))


@dataclass(frozen=True)
class TargetInfo:
    """What preflight needs of the target, read from its config.json (text_config for multimodal)."""

    num_layers: int
    hidden: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied_embeddings: bool
    attention_bias: bool
    special_ids: dict[str, tuple[int, ...]]  # "pad"/"bos"/"eos" -> ids (eos may be several)
    stored_params: int = 0  # numel over the safetensors headers; 0 when unknown

    @classmethod
    def from_folder(cls, folder: Path) -> TargetInfo:
        """Raises ValueError naming the file and the missing key."""
        raw = _read_json(folder / "config.json")
        text = raw.get("text_config") if "num_hidden_layers" not in raw else None
        conf = {**raw, **text} if isinstance(text, dict) else raw
        gen_path = folder / "generation_config.json"
        gen = _read_json(gen_path) if gen_path.is_file() else {}
        try:
            hidden, heads = int(conf["hidden_size"]), int(conf["num_attention_heads"])
            special = {role: _special_ids(role, conf, gen) for role in ("pad", "bos", "eos")}
            return cls(
                num_layers=int(conf["num_hidden_layers"]),
                hidden=hidden,
                vocab=int(conf["vocab_size"]),
                heads=heads,
                kv_heads=int(conf.get("num_key_value_heads") or heads),
                head_dim=int(conf.get("head_dim") or hidden // heads),
                intermediate=int(conf.get("intermediate_size") or 4 * hidden),
                tied_embeddings=bool(conf.get("tie_word_embeddings", False)),
                attention_bias=bool(conf.get("attention_bias", False)),
                special_ids=special,
            )
        except KeyError as exc:
            raise ValueError(f"{folder / 'config.json'} lacks {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{folder / 'config.json'} has an unusable value ({exc})") from None

    def shapes(self, cfg: RunConfig | None = None, dtype_bytes: int = 2, with_params: bool = True) -> Shapes:
        """This target (and, with `cfg`, its drafter) in the terms of trainer/layout/sizing.py."""
        d = cfg.drafter if cfg is not None else None
        return Shapes(
            target_params=self.params if with_params else 0, target_dtype_bytes=dtype_bytes, hidden=self.hidden, vocab=self.vocab,
            intermediate=self.intermediate, heads=self.heads, kv_heads=self.kv_heads, head_dim=self.head_dim,
            attention_bias=self.attention_bias, draft_layers=d.num_layers if d else 1,
            draft_intermediate=d.intermediate_size if d else None, n_aux=len(d.aux_ids) if d else 1,
        )

    def decoder_layer_params(self, intermediate: int | None = None) -> int:
        """Parameters of one Qwen3-style decoder layer of this width (the drafter's layers too)."""
        return self.shapes(with_params=False).decoder_layer_params(intermediate)

    @property
    def config_params(self) -> int:
        """Parameter count implied by config.json (dense estimate; MoE targets count from headers)."""
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return embeddings + self.num_layers * self.decoder_layer_params() + self.hidden

    @property
    def params(self) -> int:
        return max(self.stored_params, self.config_params)


@dataclass(frozen=True)
class DrafterSize:
    trainable: int  # decoder layers, fc, hidden_norm, norm
    frozen: int  # embed_tokens, the lm_head/verifier_lm_head it shares, verifier_norm (the target's)

    @classmethod
    def estimate(cls, cfg: RunConfig, target: TargetInfo) -> DrafterSize:
        s = target.shapes(cfg)
        return cls(trainable=s.drafter_trainable, frozen=s.drafter_frozen)

    @property
    def checkpoint_bytes(self) -> int:
        """fp32 weights + Adam state + small files."""
        return self.trainable * (4 + ADAM_STATE_BYTES) + CHECKPOINT_OVERHEAD_BYTES


# ---------------------------------------------------------------- config gate


def _user_ids(cfg: RunConfig, ids: list[int]) -> list[int]:
    """Speculators-convention ids written in the config's own convention."""
    shift = 1 if cfg.drafter.layer_id_convention == "specforge" else 0
    return [i - shift for i in ids]


def _as_speculators(cfg: RunConfig) -> str:
    """' (specforge convention = speculators ids [...])' where the config uses SpecForge's ids."""
    if cfg.drafter.layer_id_convention == "speculators":
        return ""
    return f" (specforge convention = speculators ids {cfg.drafter.aux_ids})"


def suggest_aux_ids(num_layers: int, count: int) -> list[int]:
    """`count` spread-out aux ids in speculators' convention for a target of `num_layers` layers.

    SpecForge/z-lab's spacing (outputs of decoder layers 1 … L−3, e.g. z-lab's [1, 9, 17, 25, 33] on
    36 layers = speculators' [2, 10, 18, 26, 34]); an even spread over [1, L] where that repeats ids."""
    count = max(1, min(count, num_layers))
    if count == 1:
        ids = [num_layers // 2 + 1]
    else:
        end = num_layers - 3
        ids = [round(1 + i * (end - 1) / (count - 1)) + 1 for i in range(count)]
    if len(set(ids)) == count and all(1 <= i <= num_layers for i in ids):
        return ids
    return [int(i) for i in np.linspace(1, num_layers, count).round()]


def _target_gate(cfg: RunConfig, report: PreflightReport) -> TargetInfo | None:
    path = cfg.target.path
    if not path.is_dir():
        report.error(
            "config.target_missing", f"target.path {path} does not exist or is not a folder", TARGET_FETCH_FIX
        )
        return None
    info: TargetInfo | None = None
    if not (path / "config.json").is_file():
        report.error("config.target_no_config", f"target.path {path} has no config.json", TARGET_FETCH_FIX)
    else:
        try:
            info = TargetInfo.from_folder(path)
        except ValueError as exc:
            report.error("config.target_config_invalid", str(exc), TARGET_FETCH_FIX)
    weights = read_weight_headers(path)
    _report_weight_problems(report, "config.target", weights, TARGET_FETCH_FIX)
    if info is None:
        return None
    info = replace(info, stored_params=0 if weights.problems else weights.numel)
    report.target = {
        "path": str(path),
        "num_layers": info.num_layers,
        "hidden": info.hidden,
        "vocab": info.vocab,
        "params": info.params,
        "aux_ids": cfg.drafter.aux_ids,
    }
    return info


def _aux_gate(cfg: RunConfig, target: TargetInfo | None, report: PreflightReport) -> None:
    d = cfg.drafter
    ids, given, conv = d.aux_ids, list(d.aux_layer_ids), d.layer_id_convention
    example = _user_ids(cfg, suggest_aux_ids(target.num_layers, len(ids) or 3)) if target else None
    if not ids:
        report.error(
            "config.aux_ids_empty",
            "drafter.aux_layer_ids is empty: the drafter needs target layers to read",
            f"set drafter.aux_layer_ids, e.g. {example or '[2, 10, 18, 26, 34] (36 layers)'}",
        )
        return
    repeated = sorted({i for i in given if given.count(i) > 1})
    clean = sorted(set(given))
    if repeated:
        report.error(
            "config.aux_ids_duplicate",
            f"drafter.aux_layer_ids {given} repeats {repeated}",
            f"list each layer once: set drafter.aux_layer_ids to {clean}",
        )
    if given != sorted(given):
        report.error(
            "config.aux_ids_unsorted",
            f"drafter.aux_layer_ids {given} is not ascending (the fc concatenates layers in this order; "
            "speculators and vLLM expect it ascending)",
            f"set drafter.aux_layer_ids to {clean}",
        )
    if target is None:
        return
    depth = target.num_layers
    lo, hi = _user_ids(cfg, [1, depth])
    outside = [u for u, i in zip(given, ids, strict=True) if not 1 <= i <= depth]
    if outside:
        report.error(
            "config.aux_ids_out_of_depth",
            f"drafter.aux_layer_ids {given}{_as_speculators(cfg)}: {outside} outside the target's {depth} "
            f"layers (valid: {lo}..{hi} in the {conv} convention)",
            f"set drafter.aux_layer_ids to ids in [{lo}, {hi}], e.g. {example}; check "
            "drafter.layer_id_convention (specforge ids are speculators ids minus one)",
        )
        return
    gap = (depth - max(ids)) / depth
    if gap > cfg.preflight.deep_layer_warn_gap:
        report.warn(
            "config.deep_layer_gap",
            f"the deepest aux layer ({max(given)}, {conv} convention) is {gap:.0%} of the target's {depth} "
            f"layers below the top (preflight.deep_layer_warn_gap {cfg.preflight.deep_layer_warn_gap:.0%}); "
            "late-layer features usually raise acceptance",
            f"add a layer near the top, e.g. drafter.aux_layer_ids: {example}, or raise "
            "preflight.deep_layer_warn_gap if this is intended",
        )


def _drafter_gate(cfg: RunConfig, target: TargetInfo | None, report: PreflightReport) -> None:
    d = cfg.drafter
    if d.block_size < 2:
        report.error(
            "config.block_size_too_small",
            f"drafter.block_size is {d.block_size}; a block is the anchor plus at least one masked slot",
            "set drafter.block_size to at least 2 (the paper uses 16; block_size-1 tokens are speculated)",
        )
    if d.sliding_window and d.full_attention_layers:
        bad = [i for i in d.full_attention_layers if not 0 <= i < d.num_layers]
        if bad:
            report.error(
                "config.full_attention_layers_out_of_range",
                f"drafter.full_attention_layers {d.full_attention_layers}: {bad} not among the "
                f"{d.num_layers} draft layers",
                f"use draft layer indices in [0, {d.num_layers - 1}]",
            )
    if target is None:
        return
    mask = d.mask_token_id
    if not 0 <= mask < target.vocab:
        report.error(
            "config.mask_token_out_of_vocab",
            f"drafter.mask_token_id {mask} is outside the target vocabulary (0..{target.vocab - 1})",
            MASK_FIX,
        )
        return
    roles = [role for role, ids in target.special_ids.items() if mask in ids]
    if roles:
        report.error(
            "config.mask_token_special",
            f"drafter.mask_token_id {mask} is the target's {'/'.join(roles)} token id",
            MASK_FIX,
        )


def _warm_start_gate(cfg: RunConfig, target: TargetInfo | None, report: PreflightReport) -> None:
    folder = cfg.drafter.warm_start
    if folder is None:
        return
    try:
        if not (folder / "config.json").is_file():
            raise ValueError("no such folder" if not folder.is_dir() else "it has no config.json")
        raw = _read_json(folder / "config.json")
    except ValueError as exc:
        report.error(
            "config.warm_start_missing",
            f"drafter.warm_start {folder} is not a checkpoint folder ({exc})",
            WARM_START_FIX,
        )
        return
    if raw.get("speculators_model_type") != "dflash":
        report.error(
            "config.warm_start_not_dflash",
            f"{folder}/config.json has speculators_model_type "
            f"{raw.get('speculators_model_type')!r}, not 'dflash'",
            WARM_START_FIX,
        )
    ids, n_aux = cfg.drafter.aux_ids, len(cfg.drafter.aux_ids)
    ckpt_ids = raw.get("aux_hidden_state_layer_ids")
    ckpt_user = _user_ids(cfg, list(ckpt_ids)) if isinstance(ckpt_ids, list) else None
    if ckpt_user is not None and len(ckpt_user) != n_aux:
        report.error(
            "config.warm_start_aux_mismatch",
            f"{folder}/config.json wires the drafter to {len(ckpt_user)} target layers {ckpt_user} but "
            f"drafter.aux_layer_ids lists {n_aux}: {list(cfg.drafter.aux_layer_ids)}",
            f"set drafter.aux_layer_ids to {ckpt_user} (the checkpoint's layers) "
            "or remove drafter.warm_start",
        )
    elif ckpt_ids is not None and list(ckpt_ids) != ids:
        report.warn(
            "config.warm_start_aux_ids_differ",
            f"{folder} was trained on target layers {ckpt_user}, "
            f"this run reads {list(cfg.drafter.aux_layer_ids)}",
            f"set drafter.aux_layer_ids to {ckpt_user} unless the change is intended",
        )
    weights = read_weight_headers(folder)
    _report_weight_problems(report, "config.warm_start", weights, WARM_START_FIX)
    fc = weights.tensors.get("fc.weight")
    if fc is None:
        if not weights.problems:
            report.error(
                "config.warm_start_no_weights", f"{folder}'s weights have no fc.weight", WARM_START_FIX
            )
        return
    ckpt_hidden = int((raw.get("transformer_layer_config") or {}).get("hidden_size") or fc["shape"][0])
    hidden = target.hidden if target else ckpt_hidden
    _check_fc_width(cfg, folder, int(fc["shape"][1]), hidden, ckpt_user, report)
    if target and ckpt_hidden != target.hidden:
        report.error(
            "config.warm_start_hidden_mismatch",
            f"{folder} has hidden size {ckpt_hidden}, the target has {target.hidden}",
            "warm-start only from a drafter trained for this target (its hidden size must equal the "
            "target's), or remove drafter.warm_start",
        )


def _check_fc_width(
    cfg: RunConfig,
    folder: Path,
    width: int,
    hidden: int,
    ckpt_user: list[int] | None,
    report: PreflightReport,
) -> None:
    """fc.weight is [hidden, n_aux*hidden]: its input width says how many layers it was built for."""
    n_aux = len(cfg.drafter.aux_ids)
    if width == n_aux * hidden:
        return
    layers = f"{width // hidden} target layers x hidden {hidden}" if width % hidden == 0 else "odd width"
    if ckpt_user is not None and width == len(ckpt_user) * hidden:
        fix = (
            f"set drafter.aux_layer_ids to {ckpt_user} (the layers its fc was built for) "
            "or remove drafter.warm_start"
        )
    else:
        fix = (
            "the checkpoint's fc does not match its own config.json (a drafter wired to fewer layers than "
            "configured): retrain it, or remove drafter.warm_start and train from scratch"
        )
    report.error(
        "config.warm_start_fc_mismatch",
        f"{folder}: fc.weight takes {width} inputs ({layers}) but drafter.aux_layer_ids lists {n_aux} "
        f"layers ({n_aux} x {hidden} = {n_aux * hidden} inputs)",
        fix,
    )


# ---------------------------------------------------------------- data gate

DROP_REASONS: dict[str, tuple[str, Callable[[RunConfig, DataStats], np.ndarray], str]] = {
    "no_supervised_pair": (
        "have no two consecutive supervised tokens (empty or one-token responses, all-zero loss_mask)",
        lambda cfg, s: ~s.has_pair,
        f"{REGENERATE_FIX} (check the chat template and the stop rule), or filter these samples out",
    ),
    "too_long": (
        "are longer than data.max_length",
        lambda cfg, s: s.lengths > cfg.data.max_length,
        "raise data.max_length, or split/re-tokenize the long samples",
    ),
    "length_mismatch": (
        "have input_ids and loss_mask of different lengths",
        lambda cfg, s: s.mismatched,
        f"rebuild the dataset with one loss_mask entry per input id, or {REGENERATE_FIX} (it writes both)",
    ),
}


def _data_gate(cfg: RunConfig, target: TargetInfo | None, report: PreflightReport) -> None:
    try:
        ds = open_dataset(cfg.data.path)
    except DataError as exc:
        report.error(exc.code, exc.message, exc.fix or REGENERATE_FIX)
        return
    except Exception as exc:  # a corrupt Arrow file, a foreign format, ...
        report.error(
            "data.unreadable",
            f"data.path {cfg.data.path} could not be loaded ({type(exc).__name__}: {exc})",
            f"rebuild the dataset with Dataset.save_to_disk or {REGENERATE_FIX}",
        )
        return
    stats = compute_stats(ds)
    report.data = _data_figures(cfg, stats)
    _short_check(cfg, stats, report)
    _drop_checks(cfg, stats, report)
    _token_checks(cfg, target, flat_values(ds, "input_ids"), report)


def _data_figures(cfg: RunConfig, stats: DataStats) -> dict[str, Any]:
    n, usable = stats.num_samples, stats.usable(cfg.data.max_length)
    short = int((stats.supervised < cfg.preflight.min_supervised_tokens).sum())
    truncated = int((usable & (stats.lengths > cfg.train.max_tokens_per_batch)).sum())
    return {
        "path": str(cfg.data.path),
        "num_samples": n,
        "usable": int(usable.sum()),
        "dropped": int(n - usable.sum()),
        "dropped_fraction": float(1 - usable.mean()),
        "dropped_by_reason": {k: int(select(cfg, stats).sum()) for k, (_, select, _) in DROP_REASONS.items()},
        "min_supervised_tokens": cfg.preflight.min_supervised_tokens,
        "short": short,
        "short_fraction": short / n,
        "truncated_to_batch": truncated,
        "supervised_tokens_total": int(stats.supervised.sum()),
        "max_length_seen": int(stats.lengths.max()),
        "histogram": stats.histogram(),
    }


def _short_check(cfg: RunConfig, stats: DataStats, report: PreflightReport) -> None:
    d, limit = report.data, cfg.preflight.max_bad_fraction
    if d["short_fraction"] <= limit:
        return
    counts = np.bincount(stats.supervised.astype(np.int64))
    mode = int(counts.argmax())
    mode_share = _pct(counts[mode] / d["num_samples"])
    report.error(
        "data.short_responses",
        f"{d['short']} of {d['num_samples']} samples ({_pct(d['short_fraction'])}) have fewer than "
        f"{cfg.preflight.min_supervised_tokens} supervised tokens, above preflight.max_bad_fraction "
        f"({_pct(limit)}); the most common count is {mode} ({mode_share} of samples), "
        "the signature of empty or truncated responses",
        f"{REGENERATE_FIX} (check the chat template, thinking mode and stop rule) or filter the short "
        "samples out; lower preflight.min_supervised_tokens only if short answers are intended",
    )


def _drop_checks(cfg: RunConfig, stats: DataStats, report: PreflightReport) -> None:
    d, limit = report.data, cfg.preflight.max_bad_fraction
    refuse = d["dropped_fraction"] > limit or d["usable"] == 0
    verdict = "above" if refuse else "within"
    emit = report.error if refuse else report.warn
    for code, (what, _, fix) in DROP_REASONS.items():
        count = d["dropped_by_reason"][code]
        if count:
            emit(
                f"data.{code}",
                f"{count} of {d['num_samples']} samples {what} and are dropped; "
                f"{d['dropped']} dropped in all ({_pct(d['dropped_fraction'])}), {verdict} "
                f"preflight.max_bad_fraction ({_pct(limit)})",
                fix if code != "too_long" else f"{fix} (longest sample: {d['max_length_seen']} tokens)",
            )
    if d["truncated_to_batch"]:
        report.warn(
            "data.truncated_samples",
            f"{d['truncated_to_batch']} usable samples are longer than train.max_tokens_per_batch "
            f"({cfg.train.max_tokens_per_batch}) and will be cut to it",
            f"raise train.max_tokens_per_batch to data.max_length ({cfg.data.max_length}) "
            "or lower data.max_length",
        )


def _token_checks(
    cfg: RunConfig, target: TargetInfo | None, ids: np.ndarray, report: PreflightReport
) -> None:
    if ids.size == 0 or target is None:
        return
    lo, hi = int(ids.min()), int(ids.max())
    report.data["token_id_range"] = [lo, hi]
    if lo < 0 or hi >= target.vocab:
        outside = int(((ids < 0) | (ids >= target.vocab)).sum())
        report.error(
            "data.token_out_of_vocab",
            f"input_ids span [{lo}, {hi}] but the target vocabulary has {target.vocab} ids; {outside} tokens "
            "are outside it",
            "tokenize the data with the target's own tokenizer (target.path), e.g. with `dflash regenerate`",
        )
    uses = int((ids == cfg.drafter.mask_token_id).sum())
    if uses:
        report.warn(
            "data.mask_token_in_data",
            f"drafter.mask_token_id {cfg.drafter.mask_token_id} occurs {uses} times in input_ids",
            f"choose a mask token that never occurs in the data; {MASK_FIX}",
        )


# ---------------------------------------------------------------- machine gate


@dataclass(frozen=True)
class DeviceMemory:
    name: str
    available: int  # bytes
    cuda: bool


def nearest_existing(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def probe_device_memory(device: str) -> DeviceMemory | None:
    """Free memory of the device the run would use: the current CUDA device when available (and not
    train.device=cpu), else available host RAM. None when train.device=cuda but CUDA is absent here."""
    if device != "cpu":
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None and torch.cuda.is_available():
            idx = torch.cuda.current_device()
            free, _total = torch.cuda.mem_get_info(idx)
            return DeviceMemory(f"cuda:{idx} ({torch.cuda.get_device_name(idx)})", int(free), True)
        if device == "cuda":
            return None
    import psutil

    return DeviceMemory("host RAM", int(psutil.virtual_memory().available), False)


def estimate_memory(cfg: RunConfig, target: TargetInfo, cuda: bool, world_size: int | None = None) -> dict[str, float]:
    """Bytes per device, by part, from trainer/layout/sizing.py (the model `dflash plan` uses too).

    `world_size` (default: $WORLD_SIZE, 1 outside torchrun) is the data-parallel width: it decides
    DDP's gradient buckets and, with train.shard_optimizer_state, each rank's share of the moments."""
    half = 2 if cuda else 4
    weight_bytes = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": half}[cfg.target.dtype]
    act_bytes = {"float32": 4, "bfloat16": 2, "auto": half}[cfg.train.precision] if cuda else 4
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1") or 1)
    t = cfg.train
    return per_device_bytes(
        target.shapes(cfg, weight_bytes), gpus_per_copy=cfg.target.gpus_per_copy, data_parallel=max(1, world),
        tokens=t.max_tokens_per_batch, anchors=t.max_anchors, block=cfg.drafter.block_size,
        device="cuda" if cuda else "cpu", shard_optimizer_state=t.shard_optimizer_state, activation_bytes=act_bytes,
    )


def _disk_gate(cfg: RunConfig, target: TargetInfo | None, report: PreflightReport) -> None:
    base = nearest_existing(cfg.out_dir)
    if not base.is_dir() or not os.access(base, os.W_OK):
        report.error(
            "machine.out_dir_not_writable",
            f"out_dir {cfg.out_dir}: {base} is not a writable folder",
            "set out_dir to a folder this user can write to",
        )
        return
    ckpt = DrafterSize.estimate(cfg, target).checkpoint_bytes if target else 0
    count = cfg.train.keep_checkpoints + 1  # the kept ones plus the one being written
    need = count * ckpt + cfg.preflight.disk_reserve_gb * GB
    free = shutil.disk_usage(base).free
    report.machine["disk"] = {
        "path": str(base),
        "free_gb": free / GB,
        "need_gb": need / GB,
        "checkpoint_gb": ckpt / GB,
        "checkpoints": count,
        "reserve_gb": cfg.preflight.disk_reserve_gb,
    }
    if need > free:
        report.error(
            "machine.disk_space",
            f"{base} has {free / GB:.2f} GB free; the run needs {need / GB:.2f} GB ({count} checkpoints of "
            f"{ckpt / GB:.3f} GB + preflight.disk_reserve_gb {cfg.preflight.disk_reserve_gb:g})",
            "free disk space, move out_dir to a larger filesystem, or lower train.keep_checkpoints / "
            "preflight.disk_reserve_gb",
        )


def _memory_gate(cfg: RunConfig, target: TargetInfo | None, report: PreflightReport) -> None:
    if not cfg.preflight.check_memory:
        report.machine["memory"] = {"skipped": "preflight.check_memory is false"}
        return
    if target is None:
        report.machine["memory"] = {"skipped": "the target's config.json could not be read"}
        return
    device = probe_device_memory(cfg.train.device)
    if device is None:
        report.machine["memory"] = {"skipped": "train.device is cuda but CUDA is not available here"}
        report.warn(
            "machine.cuda_unavailable",
            "train.device is cuda but this machine has no usable CUDA device; memory was not checked",
            "run preflight on the training machine (it also runs first in `dflash train`)",
        )
        return
    parts = estimate_memory(cfg, target, device.cuda)
    need = sum(parts.values())
    report.machine["memory"] = {
        "device": device.name,
        "available_gib": device.available / GIB,
        "need_gib": need / GIB,
        "parts_gib": {k: v / GIB for k, v in parts.items()},
    }
    fix = (
        "lower train.max_tokens_per_batch or train.max_anchors, raise target.gpus_per_copy, use a device "
        "with more memory, or set preflight.check_memory: false when preflighting away from the "
        "training machine"
    )
    breakdown = ", ".join(f"{k} {v / GIB:.1f}" for k, v in parts.items())
    summary = f"~{need / GIB:.1f} GiB ({breakdown})"
    if need > device.available:
        report.error(
            "machine.memory",
            f"the run needs {summary} but {device.name} has {device.available / GIB:.1f} GiB available",
            fix,
        )
    elif need > MEMORY_TIGHT_SHARE * device.available:
        report.warn(
            "machine.memory_tight",
            f"the run needs {summary}, over {MEMORY_TIGHT_SHARE:.0%} of the {device.available / GIB:.1f} GiB "
            f"available on {device.name}",
            fix,
        )


# ---------------------------------------------------------------- entry


def run_preflight(cfg: RunConfig) -> PreflightReport:
    """Run every gate on a validated run config and return all findings (never raises on bad inputs;
    an unexpected failure inside a gate becomes a `preflight.internal_error` problem)."""
    report = PreflightReport()
    target = _guarded(report, "target", lambda: _target_gate(cfg, report))
    gates: list[tuple[str, Callable[[RunConfig, TargetInfo | None, PreflightReport], None]]] = [
        ("aux ids", _aux_gate),
        ("drafter", _drafter_gate),
        ("warm start", _warm_start_gate),
        ("data", _data_gate),
        ("disk", _disk_gate),
        ("memory", _memory_gate),
    ]
    for name, gate in gates:
        _guarded(report, name, lambda gate=gate: gate(cfg, target, report))
    return report


def _guarded(report: PreflightReport, name: str, call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception as exc:  # one broken gate must not hide the others' findings
        report.error(
            "preflight.internal_error",
            f"the {name} check failed unexpectedly: {type(exc).__name__}: {exc}",
            "report this as a dflash bug (with `dflash preflight --json` output); the other checks still ran",
        )
        return None
