"""The data gate: supervised tokens per sample (histogram), short responses, samples the loop would drop
(no two consecutive supervised tokens, longer than data.max_length, input_ids/loss_mask length
mismatch), token ids outside the target vocabulary, and the mask token in the data.

`data_gate` also runs without a target (salvage checks a dataset on its own): then token ids are not
checked."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from trainer.config.run import RunConfig
from trainer.data import (
    REGENERATE_FIX,
    DataError,
    DataStats,
    compute_stats,
    flat_values,
    holdout_indices,
    open_dataset,
)
from trainer.preflight.drafter import MASK_FIX
from trainer.preflight.report import PreflightReport, pct
from trainer.target.info import TargetInfo

# ---------------------------------------------------------------- data gate

DRAFT_VOCAB_MIN_COVERAGE = 0.95  # warn below this share of supervised tokens in the draft vocabulary
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


def data_gate(cfg: RunConfig, target: TargetInfo | None, report: PreflightReport) -> None:
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
    if (
        cfg.drafter.draft_vocab_size is not None
        and target is not None
        and "data.token_out_of_vocab" not in report.codes()
    ):
        _draft_vocab_check(cfg, target, report)


def _draft_vocab_check(cfg: RunConfig, target: TargetInfo, report: PreflightReport) -> None:
    """The share of supervised tokens the draft vocabulary keeps: the drafter can never propose the
    others (each costs the block there)."""
    from trainer.drafter.vocab import draft_vocab_for

    # the same counts as the drafter's build in this process (trainer/drafter/vocab.py counts once)
    dv = draft_vocab_for(cfg.data.path, cfg.drafter.draft_vocab_size, target.vocab)
    report.data["draft_vocab_coverage"] = dv.coverage
    if dv.coverage < DRAFT_VOCAB_MIN_COVERAGE:
        report.warn(
            "data.draft_vocab_coverage_low",
            f"drafter.draft_vocab_size {dv.size} keeps {pct(dv.coverage)} of the supervised tokens "
            f"({dv.distinct} distinct): the drafter can never propose the rest",
            "raise drafter.draft_vocab_size, or null for the whole vocabulary",
        )


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
    mode_share = pct(counts[mode] / d["num_samples"])
    report.error(
        "data.short_responses",
        f"{d['short']} of {d['num_samples']} samples ({pct(d['short_fraction'])}) have fewer than "
        f"{cfg.preflight.min_supervised_tokens} supervised tokens, above preflight.max_bad_fraction "
        f"({pct(limit)}); the most common count is {mode} ({mode_share} of samples), "
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
                f"{d['dropped']} dropped in all ({pct(d['dropped_fraction'])}), {verdict} "
                f"preflight.max_bad_fraction ({pct(limit)})",
                fix if code != "too_long" else f"{fix} (longest sample: {d['max_length_seen']} tokens)",
            )
    if cfg.eval.holdout:  # the loop's own choice of the held-out samples, refused here before any work
        try:
            holdout_indices(stats.usable(cfg.data.max_length), cfg.eval.holdout, cfg.train.seed)
        except DataError as e:
            report.error(e.code, e.message, e.fix)
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
