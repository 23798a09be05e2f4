"""The in-process layout (`target.source: hooked`): each trainer rank holds a target copy split layer-wise
over `gpus_per_copy` GPUs. The rule: the smallest n (a divisor of the GPU count) for which the estimate
of the copy's first GPU (1/n of the target's layers AND the drafter, its optimizer, features and loss)
fits in `usable_share` of a GPU's memory; data-parallel width = count // n; at each n the lightest
`train.shard` level that fits outside the thin margin (`trainer/layout/recipe.py`). When no layout fits,
the reason names the largest parts; then, and for a thin fit, `fits_with_anchors` lists the largest
anchors each layout would fit with. Light side: stdlib only.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from trainer.layout.recipe import (
    ASSUMPTIONS,
    GIB,
    PlanError,
    Recipe,
    TargetShape,
    largest_parts,
    lightest_level,
    per_gpu_bytes,
    shard_levels,
)


def max_anchors_that_fit(t: TargetShape, n: int, dp: int, r: Recipe, shard: str, budget: float) -> int:
    """The largest anchors <= `r.anchors` whose estimate fits `budget` (0: none does)."""
    lo, hi = 0, r.anchors
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(per_gpu_bytes(t, n, dp, replace(r, anchors=mid), shard).values()) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def choose_layout(
    t: TargetShape, memory_gib: float, count: int, r: Recipe, override: int | None = None
) -> dict[str, Any]:
    """The fewest GPUs per copy whose estimate fits, at the lightest shard level that fits outside the thin
    margin (else the lightest that fits)."""
    budget = memory_gib * GIB * ASSUMPTIONS["usable_share"]
    tried = []
    candidates = [override] if override else [n for n in range(1, count + 1) if count % n == 0]
    if override and count % override:
        raise PlanError(f"gpus_per_copy {override} does not divide the GPU count {count}")

    def anchors_for(m: int, shard: str) -> int:
        return max_anchors_that_fit(t, m, count // m, r, shard, budget)

    for n in candidates:
        dp = count // n
        fit = lightest_level(shard_levels(r, dp), lambda level: per_gpu_bytes(t, n, dp, r, level), budget)
        shard, parts, need, thin = fit.shard, fit.parts, fit.need, fit.thin
        tried += [{"gpus_per_copy": n, "shard": lv, "per_gpu_gib": round(x / GIB, 1)} for lv, x in fit.tried]
        if need <= budget or override:
            fits = need <= budget
            smaller = (
                [(m, k) for m in candidates if m < n and (k := anchors_for(m, shard)) > 0] if thin else []
            )
            reason = (
                f"target {t.params / 1e9:.1f}B params x {t.dtype_bytes} B = "
                f"{t.weight_bytes / GIB:.1f} GiB; "
                + ("" if n == 1 else f"fewer than {n} GPUs per copy need more than the budget; ")
                + f"with {n} per copy and train.shard {shard} each GPU needs ~{need / GIB:.1f} GiB of "
                f"{memory_gib:.1f} GiB (budget {ASSUMPTIONS['usable_share']:.0%} = {budget / GIB:.1f} GiB)"
                + ("" if not override else f"; gpus_per_copy={override} set by hand")
                + (
                    f"; THIN MARGIN: within {1 - ASSUMPTIONS['thin_margin_share']:.0%} of the budget, and "
                    "the memory model is not calibrated on a GPU: lower --anchors (train.max_anchors) "
                    "for margin" + "".join(f"; {m} per copy fits with --anchors {k}" for m, k in smaller)
                    if thin
                    else ""
                )
                + ("" if fits else "; DOES NOT FIT: expect out-of-memory")
            )
            return {
                "gpus_per_copy": n,
                "data_parallel": dp,
                "shard": shard,
                "fits": fits,
                "per_gpu_bytes": parts,
                "per_gpu_memory_gb": round(need / 1e9, 1),
                "per_gpu_memory_gib": round(need / GIB, 1),
                "headroom_share": round(1 - need / (memory_gib * GIB), 3),
                "reason": reason,
                "tried": tried,
                "thin_margin": thin,
                "fits_with_anchors": [{"gpus_per_copy": m, "anchors": k} for m, k in smaller],
            }
    fitting = [(n, k) for n in candidates if (k := anchors_for(n, shard_levels(r, count // n)[-1])) > 0]
    hint = (
        "; " + ", ".join(f"{n} per copy fits with --anchors {k} (train.max_anchors)" for n, k in fitting[:3])
        if fitting
        else "; no --anchors fits: use GPUs with more memory, a smaller dtype or fewer tokens per batch"
    )
    return {
        "gpus_per_copy": None,
        "data_parallel": 0,
        "shard": None,
        "fits": False,
        "per_gpu_bytes": parts,
        "per_gpu_memory_gb": round(need / 1e9, 1),
        "per_gpu_memory_gib": round(need / GIB, 1),
        "reason": f"even {count} GPUs per copy need ~{need / GIB:.1f} GiB on the copy's first GPU "
        f"(train.shard {shard}; largest: {largest_parts(parts)}), over the "
        f"{budget / GIB:.1f} GiB budget with --anchors {r.anchors} x --block-size {r.block}" + hint,
        "fits_with_anchors": [{"gpus_per_copy": n, "anchors": k} for n, k in fitting],
        "tried": tried,
    }
