"""Where a run's `eval:` child runs (trainer/training/evaluation.py: `dflash eval` on each checkpoint, in a
process of its own beside the trainer), placed by `dflash plan` and counted like the training layout.
Light side: stdlib only.

The child loads a second copy of the target (the harness, trainer/layout/inference.py `plan_harness`)
and the drafter in fp32 (trainer/layout/eval_memory.py) onto the GPUs `eval.device` names. The plan:

- `eval.device: cpu`: no GPU; the host RAM it takes is said (the harness runs the target in fp32 there);
- `eval.device: cuda:N[,M...]` (set by hand): those GPUs are kept out of training (they must be the
  node's last ones: the trainer takes GPUs from 0), the training layout is planned on the others, and
  the harness must fit on them, else refused;
- `eval.device: trainer` (the default): beside global rank 0 on its first GPU when that GPU holds
  both the trainer's estimate and the whole harness; when it does not and the run config left
  `eval.device` unset, the plan sets the fewest last GPUs aside that hold the harness (fewer
  data-parallel ranks) and says so under `apply` (`eval.device: cuda:...`, which the trainer turns
  into the child's CUDA_VISIBLE_DEVICES); when no choice fits, the plan is refused (exit 2) with the
  choices named.

A served evaluation against the run's own vLLM server (`target.source: vllm`) is not available: that
server cannot take a new drafter per checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainer.layout.eval_memory import eval_drafter
from trainer.layout.inference import plan_harness
from trainer.layout.recipe import ASSUMPTIONS, GIB, PlanError, Recipe, TargetShape, shapes

Layout = tuple[dict[str, Any], str]  # (the training layout, its target.source), as plan.place returns


def eval_gpus(device: str) -> list[int]:
    """The node GPUs of `eval.device` `cuda:N[,M...]` (none for trainer or cpu)."""
    if not device.startswith("cuda:"):
        return []
    return [int(g) for g in device.split(":", 1)[1].split(",")]


def _cuda(gpus) -> str:
    return "cuda:" + ",".join(map(str, gpus))


def cpu_need_bytes(t: TargetShape, drafter: dict[str, Any]) -> float:
    """Host RAM of the harness on the CPU: the target in fp32 (HookedTarget's dtype auto there)."""
    return t.params * 4 + drafter["drafter_weights"] + drafter["drafter_working"]


def place_eval_child(
    t: TargetShape,
    memory_gib: float,
    count: int,
    r: Recipe,
    run: Any,
    layout_on: Callable[[int], Layout],
) -> tuple[dict[str, Any], Layout]:
    """(the child's placement, the training layout it leaves): `layout_on(n)` lays training out on the
    node's first n GPUs. The placement: `device` (eval.device's value), `gpus` (node GPUs), `fits`,
    `apply` (what the run config must say, empty when it already says it) and `reason`."""
    e = run.eval
    pinned = "device" in e.model_fields_set
    tokens = ASSUMPTIONS["inference_tokens_per_sequence"]
    drafter = eval_drafter(shapes(t, r), tokens, r.block)
    budget = memory_gib * GIB * ASSUMPTIONS["usable_share"]
    base = {"drafter_gib": round((drafter["drafter_weights"] + drafter["drafter_working"]) / GIB, 1)}
    if e.device == "cpu":
        need = cpu_need_bytes(t, drafter)
        why = f"eval.device cpu: the harness on the CPU, ~{need / GIB:.0f} GiB of host RAM (fp32 target)"
        place = {**base, "device": "cpu", "gpus": [], "fits": True, "apply": {}, "reason": why}
        return place, layout_on(count)
    asked = eval_gpus(e.device)
    if asked:
        return _set_aside(t, memory_gib, count, asked, drafter, layout_on, base, pinned=True)
    full = layout_on(count)
    layout = full[0]
    alone = plan_harness(t, memory_gib, 1, drafter=drafter)["per_gpu_gib"] * GIB
    if layout["fits"]:
        trainer_need = layout["per_gpu_memory_gib"] * GIB
        if trainer_need + alone <= budget:
            why = (
                f"beside global rank 0 on its GPU: the trainer's ~{trainer_need / GIB:.1f} GiB + the "
                f"harness's ~{alone / GIB:.1f} GiB (target, KV cache, working set, fp32 drafter) of "
                f"{budget / GIB:.1f} GiB"
            )
            return {**base, "device": "trainer", "gpus": [0], "fits": True, "apply": {}, "reason": why}, full
    beside = (
        f"rank 0's GPU cannot also hold the harness (~{alone / GIB:.1f} GiB beside the trainer's "
        f"~{layout.get('per_gpu_memory_gib') or 0} GiB of {budget / GIB:.1f} GiB)"
    )
    if pinned:
        return _refused(
            t, memory_gib, count, drafter, layout_on, base, f"eval.device trainer: {beside}"
        ), full
    return _set_aside(t, memory_gib, count, None, drafter, layout_on, base, pinned=False, why=beside)


def _fewest(t: TargetShape, memory_gib: float, most: int, drafter: dict[str, Any]) -> dict[str, Any] | None:
    for k in range(1, most + 1):
        h = plan_harness(t, memory_gib, k, gpus=k, drafter=drafter)
        if h["gpus"] and h["fits"]:
            return h
    return None


def _set_aside(
    t: TargetShape,
    memory_gib: float,
    count: int,
    asked: list[int] | None,
    drafter: dict[str, Any],
    layout_on: Callable[[int], Layout],
    base: dict[str, Any],
    pinned: bool,
    why: str = "",
) -> tuple[dict[str, Any], Layout]:
    """The last GPUs kept for the child (`asked`, or the fewest that hold the harness), training on the
    rest."""
    if asked is not None:
        k = len(asked)
        last = list(range(count - k, count))
        if sorted(asked) != last:
            raise PlanError(
                f"eval.device {_cuda(asked)}: the trainer takes GPUs from 0, so the evaluation's must be "
                f"the node's last {k} of {count}: {_cuda(last)}"
            )
        h = plan_harness(t, memory_gib, k, gpus=k, drafter=drafter)
        if not h["fits"]:
            msg = f"eval.device {_cuda(asked)}: {k} GPU(s) do not hold the harness ({h['reason']})"
            return _refused(t, memory_gib, count, drafter, layout_on, base, msg), layout_on(count - k)
    else:
        h = _fewest(t, memory_gib, count - 1, drafter)
        if h is None:
            return _refused(t, memory_gib, count, drafter, layout_on, base, why), layout_on(count)
        k = h["gpus"]
    gpus = list(range(count - k, count))
    rest = layout_on(count - k)
    device = _cuda(gpus)
    if not rest[0]["fits"]:
        msg = (
            f"{why + '; ' if why else ''}with GPUs {gpus} kept for the evaluation, training on the other "
            f"{count - k} does not fit ({rest[0]['reason']})"
        )
        return _refused(t, memory_gib, count, drafter, layout_on, base, msg), rest
    reason = (
        (f"{why}: " if why else "")
        + f"GPUs {gpus} kept for the evaluation ("
        + ("eval.device, set by hand" if pinned else "set aside by the plan")
        + f"; training uses the other {count - k}): {h['reason']}"
    )
    place = {**base, "device": device, "gpus": gpus, "fits": True, "reason": reason}
    place["apply"] = {} if pinned else {"eval": {"device": device}}
    return place, rest


def _refused(
    t: TargetShape,
    memory_gib: float,
    count: int,
    drafter: dict[str, Any],
    layout_on: Callable[[int], Layout],
    base: dict[str, Any],
    why: str,
) -> dict[str, Any]:
    """No placement: the choices that would work, each named with what it costs."""
    choices = []
    h = _fewest(t, memory_gib, count - 1, drafter)
    if h is not None:
        k = h["gpus"]
        rest = layout_on(count - k)[0]
        if rest["fits"]:
            choices.append(
                f"eval.device: {_cuda(range(count - k, count))} (the last {k} GPU(s); training on "
                f"{count - k}: data-parallel {rest['data_parallel']})"
            )
    choices.append(
        f"eval.device: cpu (~{cpu_need_bytes(t, drafter) / GIB:.0f} GiB of host RAM, slow for "
        f"{t.weight_bytes / GIB:.0f} GiB of weights)"
    )
    choices.append("no eval: section, and `dflash eval` on the checkpoints after training (docs/evaluate.md)")
    return {
        **base,
        "device": None,
        "gpus": [],
        "fits": False,
        "apply": {},
        "reason": f"{why}; choices: " + "; ".join(choices),
    }
