"""Acceptance as vLLM serves the drafter (`dflash eval --engine vllm|both`): the number a user's server
shows, next to the harness's.

The drafter (an export; trainer/eval/served_report.py exports a checkpoint first, reload-verified,
into a scratch folder) is loaded by vLLM's own engine with `speculative_config={"method": "dflash",
...}`, greedy, on the same token prompts as the harness. vLLM counts drafts and accepted tokens itself
(`llm.get_metrics()`): tau_vLLM = 1 + accepted / drafts, slot k's acceptance = accepted at position k /
drafts. What vLLM made of the drafter's config (the target layers it hooks, the mask token, causal or
not) is read back from the engine's own config, so that a disagreement with the harness names its likely
cause."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from trainer.errors import DflashError

EXPORT_INFO = "dflash_export.json"  # written by `dflash export` beside the weights


class ServedError(DflashError, RuntimeError):
    """vLLM cannot serve the drafter; the message says why."""


def engine_view(engine) -> dict[str, Any]:
    """How vLLM reads the drafter: the target layers it taps (speculators' convention, as vLLM's model
    runner resolves them), the mask token it drafts with, whether its draft block is causal."""
    spec = engine.vllm_config.speculative_config
    hf = spec.draft_model_config.hf_config
    dflash = getattr(hf, "dflash_config", None) or {}
    layers = getattr(hf, "eagle_aux_hidden_state_layer_ids", None)
    if not layers and dflash.get("target_layer_ids") is not None:
        layers = [i + 1 for i in dflash["target_layer_ids"]]  # vLLM's own conversion
    mask = dflash.get("mask_token_id", getattr(hf, "mask_token_id", None))
    return {
        "aux_layer_ids": list(layers) if layers else None,
        "mask_token_id": mask,
        "causal": dflash.get("causal"),
        "num_speculative_tokens": spec.num_speculative_tokens,
    }


def counters(engine) -> dict[str, Any]:
    """vLLM's spec-decode counters (cumulative since the engine started)."""
    want = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted",
        "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_pos",
    }
    out: dict[str, Any] = {}
    for m in engine.metrics():
        key = want.get(m.name)
        if key == "accepted_per_pos":
            out[key] = list(m.values)
        elif key:
            out[key] = int(m.value)
    missing = sorted(set(want.values()) - set(out))
    if missing:
        raise ServedError(f"vLLM reported no spec-decode counters {missing}: was speculative decoding on?")
    return out


def trained_causal(config: dict[str, Any]) -> bool | None:
    """Whether speculators trained the draft block causal: never for full-attention layers; sliding-
    window layers unless `sliding_window_non_causal` (None: mixed, layer by layer)."""
    layers = config.get("transformer_layer_config") or {}
    types = layers.get("layer_types") or []
    sliding = bool(layers.get("use_sliding_window")) or "sliding_attention" in types
    if not sliding:
        return False
    if config.get("sliding_window_non_causal"):
        return False
    return True if types and all(t == "sliding_attention" for t in types) else None


def as_trained(model: Path, declared: dict[str, Any], source: Path | None = None) -> dict[str, Any]:
    """The wiring the drafter was trained with: the config of the checkpoint the export was made from
    (`source`, or `dflash_export.json`'s, when that folder is still here), else the export's own."""
    info = Path(model) / EXPORT_INFO
    if source is None and info.is_file():
        source = json.loads(info.read_text()).get("source")
    cfg = Path(source) / "config.json" if source else None
    if cfg is not None and cfg.is_file():
        trained, where = json.loads(cfg.read_text()), str(source)
    else:
        trained, where = declared, "the export itself (its source checkpoint is not here)"
    return {
        "aux_layer_ids": trained.get("aux_hidden_state_layer_ids"),
        "mask_token_id": trained.get("mask_token_id"),
        "from": where,
    }


def served_family_check(target: Path, flag: str) -> None:
    """ServedError, before any model loads, for a target whose family vLLM cannot serve a DFlash
    drafter for on any platform (trainer/preflight/vllm_family.py `aux_states_problem`)."""
    from trainer.preflight.vllm_family import aux_states_problem
    from trainer.target.info import read_config

    problem = aux_states_problem(read_config(Path(target)), flag)
    if problem:
        raise ServedError(problem)


def vllm_family_dtype(target: Path, dtype: str, cpu: bool, flag: str) -> str:
    """`dtype` for the target's family on the engine's platform; ServedError where vLLM cannot run it."""
    from trainer.preflight.vllm_family import cpu_engine_problem, engine_dtype
    from trainer.target.info import read_config

    served_family_check(target, flag)
    conf = read_config(Path(target))
    problem = cpu_engine_problem(conf, dtype, cpu, f"{flag}: dtype")
    if problem:
        raise ServedError(problem)
    return engine_dtype(conf, dtype, cpu)


def serve_export(
    model: Path,
    target: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    block_size: int,
    stop_ids: set[int],
    *,
    device: str = "auto",
    dtype: str = "auto",
    flag: str = "--engine vllm",
    source: Path | None = None,
    tensor_parallel_size: int = 1,
    log: Path | None = None,
    named: str | None = None,
) -> dict[str, Any]:
    """Serve an export (config.json + weights, `dflash export`'s format) in vLLM on `prompts` (greedy,
    up to `max_new_tokens`, `block_size` - 1 draft tokens per round) and return vLLM's counts: tau,
    per-position acceptance, the committed tokens per prompt, how vLLM read the drafter's config, the
    engine's version and wall times. `source`: the checkpoint it was made from (default: the one its
    dflash_export.json names); `tensor_parallel_size`: GPUs the target is sharded over; `log`: the
    engine's log (trainer/vllm_engine.py; default a temp file); `named`: the drafter as the user gave it,
    for messages (default `model`). A checkpoint is exported first by
    trainer/eval/served_report.py. An engine that dies is `EngineDied` (exit 1, one line)."""
    from trainer import vllm_engine
    from trainer.preflight.vllm_family import prefix_caching_off
    from trainer.sources.hooked import resolve_dtype
    from trainer.target.info import read_config

    vllm = vllm_engine.import_vllm(flag, ServedError)
    cpu = vllm_engine.on_cpu(device, ServedError)
    import torch

    # the harness's dtype unless told otherwise: fp32 on a CPU, bf16 on a GPU; a Gated DeltaNet hybrid
    # on a CPU in bf16, the only dtype vLLM's CPU kernels run it in (trainer/preflight/vllm_family.py)
    dtype = vllm_family_dtype(target, dtype, cpu, flag)
    extra = {"enable_prefix_caching": False} if prefix_caching_off(read_config(target), cpu) else {}
    dtype = str(resolve_dtype(dtype, torch.device("cpu" if cpu else "cuda"))).removeprefix("torch.")
    started = time.perf_counter()
    longest = max(len(p) for p in prompts)
    engine = vllm_engine.build_engine(
        vllm,
        target,
        cpu=cpu,
        dtype=dtype,
        tensor_parallel_size=tensor_parallel_size,
        stats=True,
        log=log,
        what=f"serving the drafter {named or model} on {target}",
        max_model_len=longest + max_new_tokens + block_size + 8,
        speculative_config={
            "method": "dflash",
            "model": str(model),
            "num_speculative_tokens": block_size - 1,
        },
        **extra,
    )
    try:
        start_s = time.perf_counter() - started
        started = time.perf_counter()
        tokens = engine.generate(prompts, max_new_tokens, sorted(stop_ids))
        decode_s = time.perf_counter() - started
        counts = counters(engine)
        view = engine_view(engine)
    finally:
        engine.shutdown()
    declared = json.loads((Path(model) / "config.json").read_text())
    drafts = counts["drafts"]
    new_tokens = sum(len(t) for t in tokens)
    out = {
        "engine": f"vllm {vllm.__version__}",
        "dtype": dtype,
        "device": "cpu" if cpu else "cuda",
        "tensor_parallel_size": tensor_parallel_size,
        "tau": 1 + counts["accepted"] / drafts if drafts else None,
        "per_position_acceptance": [(a / drafts if drafts else None) for a in counts["accepted_per_pos"]],
        **counts,
        "new_tokens": new_tokens,
        "decode_s": round(decode_s, 4),
        "start_s": round(start_s, 2),
        "tokens_per_s": new_tokens / decode_s if decode_s > 0 else None,
        "engine_view": view,
        "declared": {
            "aux_layer_ids": declared.get("aux_hidden_state_layer_ids"),
            "mask_token_id": declared.get("mask_token_id"),
            "trained_causal": trained_causal(declared),
        },
        "trained": as_trained(Path(model), declared, source),
        "tokens": tokens,
    }
    out["checks"] = config_checks(out)
    return out


def _check(name: str, ok: bool, detail: str, decisive: bool) -> dict[str, Any]:
    return {"check": name, "ok": bool(ok), "detail": detail, "decisive": decisive}


def config_checks(served: dict[str, Any]) -> list[dict[str, Any]]:
    """What vLLM made of the drafter's config against what it declares and how it was trained. Each is
    decisive: a failure means the server runs a different drafter than the one trained."""
    view, declared, wired = served["engine_view"], served["declared"], served["trained"]
    trained = declared["trained_causal"]
    return [
        _check(
            "layer ids",
            view["aux_layer_ids"] == wired["aux_layer_ids"],
            f"trained on target layers {wired['aux_layer_ids']} ({wired['from']}), the export declares "
            f"{declared['aux_layer_ids']}, vLLM taps {view['aux_layer_ids']}",
            True,
        ),
        _check(
            "mask token",
            view["mask_token_id"] == wired["mask_token_id"],
            f"trained with mask token {wired['mask_token_id']}, the export declares "
            f"{declared['mask_token_id']}, vLLM drafts with {view['mask_token_id']}",
            True,
        ),
        _check(
            "draft-block attention",
            trained is None or view["causal"] is None or view["causal"] == trained,
            f"trained {'causal' if trained else 'non-causal'}, vLLM serves it "
            f"{'causal' if view['causal'] else 'non-causal'}"
            + (
                " (an export written before dflash export set sliding_window_non_causal: export the "
                "checkpoint again)"
                if trained is False and view["causal"]
                else ""
            ),
            True,
        ),
    ]


def agreement(harness: dict[str, Any], served: dict[str, Any], tolerance: float) -> dict[str, Any]:
    """Harness tau against vLLM's, with the checks that tell the usual causes of a gap apart: passes
    when the two are within `tolerance` and every decisive check passes."""
    view = served["engine_view"]
    checks = [
        _check(
            "harness layer ids",
            view["aux_layer_ids"] == list(harness["aux_layer_ids"]),
            f"the harness taps {harness['aux_layer_ids']}, vLLM taps {view['aux_layer_ids']}",
            True,
        ),
        *served["checks"],
    ]
    same = sum(p["tokens"] == t for p, t in zip(harness["per_prompt"], served["tokens"]))
    n = len(served["tokens"])
    checks.append(
        _check(
            "committed text",
            same == n,
            f"{same}/{n} prompts commit the same tokens in vLLM and in the harness (a difference is the "
            "target's numerics, dtype or stop rule, not the drafter)",
            False,
        )
    )
    h1 = (harness["per_position_acceptance"] or [None])[0]
    s1 = (served["per_position_acceptance"] or [None])[0]
    checks.append(
        _check(
            "slot 1",
            h1 is not None and s1 is not None and abs(h1 - s1) <= tolerance,
            f"slot-1 acceptance: harness {fmt(h1)}, vLLM {fmt(s1)} (slot 1 agreeing while later slots "
            "drift points at the draft block's attention)",
            False,
        )
    )
    diff = None
    if harness["tau"] is not None and served["tau"] is not None:
        diff = served["tau"] - harness["tau"]
    return {
        "tau_harness": harness["tau"],
        "tau_vllm": served["tau"],
        "difference": diff,
        "tolerance": tolerance,
        "ok": diff is not None and abs(diff) <= tolerance and all(c["ok"] for c in checks if c["decisive"]),
        "checks": checks,
    }


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"
