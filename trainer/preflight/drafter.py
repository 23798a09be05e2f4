"""The drafter's config gates: aux layer ids (in speculators' convention, after conversion), the mask
token (against the target's config and, when the folder has one, its tokenizer) and the block size,
`drafter.init: target`'s copy plan (trainer/drafter/target_init.py), and a warm-start checkpoint's wiring
(fc width, aux ids, hidden size)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from trainer.drafter.target_init import FIX as INIT_FIX
from trainer.drafter.target_init import plan_target_init
from trainer.preflight.report import PreflightReport
from trainer.target.info import TargetInfo, read_json, read_weight_headers
from trainer.target.tokenizer import TokenizerFiles

if TYPE_CHECKING:
    from trainer.config.run import RunConfig

MASK_FIX = (
    "set drafter.mask_token_id to a real, otherwise unused row of the target embedding: the first row "
    "past the tokenizer's ids (Qwen3: 151669) or an unused reserved special token, never pad/eos/bos or "
    "a token of the chat template (`dflash init` picks one by this rule)"
)
WARM_START_FIX = "point drafter.warm_start at a complete speculators DFlash checkpoint folder, or remove it"


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


def aux_gate(cfg: RunConfig, target: TargetInfo | None, report: PreflightReport) -> None:
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


def drafter_gate(cfg: RunConfig, target: TargetInfo | None, report: PreflightReport) -> None:
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
    if d.draft_vocab_size is not None and d.draft_vocab_size >= target.vocab:
        report.error(
            "config.draft_vocab_too_large",
            f"drafter.draft_vocab_size {d.draft_vocab_size} is not below the target's vocabulary "
            f"({target.vocab}): nothing would be left out",
            "set drafter.draft_vocab_size below the vocabulary (e.g. 32768), or null for the whole one",
        )
    tokenizer = TokenizerFiles.from_folder(cfg.target.path)
    for code, message in mask_token_problems(d.mask_token_id, target, tokenizer):
        report.error(code, message, MASK_FIX)
    if d.init == "target":
        _target_init_check(cfg, target, report)


def _target_init_check(cfg: RunConfig, target: TargetInfo, report: PreflightReport) -> None:
    """`drafter.init: target` needs the target's last layers to be plain decoder layers of the
    drafter's shapes, and no warm start (which would overwrite them)."""
    d = cfg.drafter
    if d.warm_start is not None:
        report.error(
            "config.init_with_warm_start",
            "drafter.init is target and drafter.warm_start is set: the warm start would overwrite the copy",
            "remove one of them (warm_start continues a trained drafter; init: target starts a fresh one)",
        )
    headers = read_weight_headers(cfg.target.path)
    if headers.problems:
        return  # the target gate reports them
    plan = plan_target_init(headers.tensors, target.num_layers, d.num_layers, d.intermediate_size)
    for problem in plan.problems:
        report.error("config.init_target_layers", f"drafter.init: target: {problem}", INIT_FIX)


def mask_token_problems(
    mask: int, target: TargetInfo, tokenizer: TokenizerFiles | None
) -> list[tuple[str, str]]:
    """(code, message) for each reason `mask` cannot be the drafter's mask token: not a row of the
    target's embedding; the pad/bos/eos id of its config.json or generation_config.json, or the
    pad/bos/eos/unk token of its tokenizer; a token its chat template writes (every chat sample holds
    it). The one home of these checks: preflight reports them, `dflash init` refuses a mask with any."""
    if not 0 <= mask < target.vocab:
        return [
            (
                "config.mask_token_out_of_vocab",
                f"drafter.mask_token_id {mask} is outside the target vocabulary (0..{target.vocab - 1})",
            )
        ]
    found: list[tuple[str, str]] = []
    roles = [role for role, ids in target.special_ids.items() if mask in ids]
    if tokenizer is not None:
        roles += [r for r, i in tokenizer.role_ids.items() if i == mask and r != "mask" and r not in roles]
    if roles:
        found.append(
            (
                "config.mask_token_special",
                f"drafter.mask_token_id {mask} is the target's {'/'.join(roles)} token id",
            )
        )
    if tokenizer is not None and tokenizer.in_template(mask):
        found.append(
            (
                "config.mask_token_in_template",
                f"drafter.mask_token_id {mask} ({tokenizer.added[mask][0]!r}) is written by the target's "
                "chat template: every chat sample holds it",
            )
        )
    return found


def warm_start_gate(cfg: RunConfig, target: TargetInfo | None, report: PreflightReport) -> None:
    folder = cfg.drafter.warm_start
    if folder is None:
        return
    try:
        if not (folder / "config.json").is_file():
            raise ValueError("no such folder" if not folder.is_dir() else "it has no config.json")
        raw = read_json(folder / "config.json")
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
    report.weight_errors("config.warm_start", weights, WARM_START_FIX)
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
