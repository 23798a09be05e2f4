"""The lossless check of `dflash eval --check-lossless` (light: plain lists, no torch).

Speculative greedy decoding commits, at every position, the token the verifier's own forward chose
there: a 1 + (B-1)-row verify forward (a tree: 1 + N rows). The check's ground truth is the target's
greedy decoding one token per forward. In fp32 both agree exactly; in bf16 (fp16) the two forwards
round differently, and where the reference's best two logits are within that rounding of each other
(a near tie) the verify forward may choose the other one. From there the two continuations differ.

So each checked output is classified:
- `exact`: the same tokens as the reference;
- `mismatch`: some committed token is not its verify forward's own choice (the loop accepted a token
  the verifier rejected), or the first differing token is one the reference ranks clearly below its
  choice: `gap` = the reference's top logit - its logit of the committed token > `tolerance`;
- `near-tie`: every committed token is its verify forward's choice, and at the first difference the
  reference's gap is within `tolerance`: a correct decoder, not a failure. The comparison of that
  prompt stops there (after it the two continuations are different texts).

tolerance = NEAR_TIE_ULPS x eps(the target's dtype) x max|logit| of the reference at that position:
a logit of size L is carried with a relative precision of eps (bf16: 2^-7, so an L of 25 is known to
about 0.2), and a 16-row verify forward and a one-token forward of the same model differ by a few of
these units (measured in bf16 on SmolLM2-135M, 30 layers: up to 4.7 x eps x max|logit|, p99 3.7; the
tiny test target: up to 1.5); the gap at which two such forwards can disagree is at most the sum of
two logits' errors, ~2 x that. 8 leaves room for deeper models. In fp32 the same rule is ~1e-5 logits:
still exact in effect. A harness bug shows as a gap far above it (typically several logits).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

NEAR_TIE_ULPS = 8.0  # tolerance in units of eps x max|logit| (see above)
TOP_K = 8  # reference logits kept per position: the committed token's logit when it is among them


@dataclass
class GreedyReference:
    """The target's one-token-per-forward greedy decoding with, per position, its top-K logits (ids
    and values, best first) and max|logit|: what the near-tie test needs, without whole rows."""

    tokens: list[int]
    seconds: float
    top_ids: list[list[int]] = field(default_factory=list)
    top_logits: list[list[float]] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    dtype: str = "float32"
    eps: float = 1.1920928955078125e-07


def tolerance(ref: GreedyReference, position: int, ulps: float = NEAR_TIE_ULPS) -> float:
    """The largest top-logit gap at `position` that the dtype's rounding can overturn (module doc)."""
    return ulps * ref.eps * ref.scales[position]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where `a` and `b` differ (the shorter's length when one is a prefix of the
    other), None when equal."""
    j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if j is None and len(a) != len(b):
        j = min(len(a), len(b))
    return j


def classify(
    tokens: list[int], verified: list[int] | None, ref: GreedyReference, ulps: float = NEAR_TIE_ULPS
) -> dict[str, Any]:
    """One checked output: `tokens` committed by a speculative loop, `verified` the verify forward's
    own greedy token at each committed position (None: not recorded), `ref` the reference decoding.
    Returns {status: exact | near-tie | mismatch, compared_tokens, position, reference_token,
    speculative_token, gap, tolerance, detail}."""
    out: dict[str, Any] = {"status": "exact", "compared_tokens": len(tokens), "position": None}
    j = first_difference(tokens, ref.tokens)
    if verified is not None:
        bad = next((i for i, (t, v) in enumerate(zip(tokens, verified)) if t != v), None)
        if bad is None and len(verified) < len(tokens):
            bad = len(verified)
        if bad is not None:
            chose = verified[bad] if bad < len(verified) else None
            return {
                **out,
                "status": "mismatch",
                "compared_tokens": bad if j is None else min(j, bad),
                "position": bad,
                "speculative_token": tokens[bad],
                "verifier_token": chose,
                "detail": f"token {bad}: committed {tokens[bad]}, its verify forward chose {chose}",
            }
    if j is None:
        return out
    out.update(compared_tokens=j, position=j)
    if j >= min(len(tokens), len(ref.tokens)):
        return {**out, "status": "mismatch", "detail": f"the same first {j} tokens, then one output ends"}
    r, s = ref.tokens[j], tokens[j]
    ids, vals = ref.top_ids[j], ref.top_logits[j]
    tol = tolerance(ref, j, ulps)
    out.update(reference_token=r, speculative_token=s, tolerance=tol)
    if s not in ids:  # below the reference's top K: its gap is at least the top-1 - top-K gap
        gap = vals[0] - vals[-1]
        return {
            **out,
            "status": "mismatch",
            "gap": gap,
            "detail": f"token {j}: {s} is not among the reference's top {len(ids)} (gap >= {gap:.4g})",
        }
    gap = vals[0] - vals[ids.index(s)]
    near = gap <= tol
    return {
        **out,
        "status": "near-tie" if near else "mismatch",
        "gap": gap,
        "detail": f"token {j}: reference {r}, committed {s}, gap {gap:.4g} "
        f"{'<=' if near else '>'} tolerance {tol:.4g}",
    }


def summarise(verdicts: dict[int, dict[str, Any]], ref: GreedyReference | None) -> dict[str, Any]:
    """The report's `lossless` fields for the verdicts of the checked prompts (index -> classify)."""
    mismatches = [{"prompt": i, "first_difference_at": v["position"], **v} for i, v in verdicts.items()
                  if v["status"] == "mismatch"]  # fmt: skip
    near = [{"prompt": i, **v} for i, v in verdicts.items() if v["status"] == "near-tie"]
    return {
        "checked": len(verdicts),
        "matched": sum(v["status"] == "exact" for v in verdicts.values()),
        "near_ties": near,
        "ok": not mismatches if verdicts else None,
        "mismatches": mismatches,
        "compared_tokens": sum(v["compared_tokens"] for v in verdicts.values()),
        "tolerance": None
        if ref is None
        else {
            "ulps": NEAR_TIE_ULPS,
            "dtype": ref.dtype,
            "eps": ref.eps,
            "rule": "gap <= ulps x eps x max|logit|",
        },
    }


def verdict_text(ll: dict[str, Any]) -> str:
    """The markdown cell of a lossless summary: `ok (5/6 exact, 1 near-tie)`, `MISMATCH (...)`."""
    if not ll["checked"]:
        return "not checked"
    near = len(ll.get("near_ties") or [])
    head = "ok" if ll["ok"] else "MISMATCH"
    if not near:
        return f"{head} ({ll['matched']}/{ll['checked']})"
    return f"{head} ({ll['matched']}/{ll['checked']} exact, {near} near-tie)"
