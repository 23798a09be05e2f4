"""trainer/preflight/vllm_family.py's decisions for vLLM engines (dtype, prefix caching) per family and
platform, and the engine processes' torchvision fallback (trainer/amx_site/dflash_vision_fallback.py)."""

from __future__ import annotations

import subprocess
import sys

from trainer.preflight.vllm_family import (
    aux_states_problem,
    cpu_engine_problem,
    engine_dtype,
    gated_deltanet,
    prefix_caching_off,
)
from trainer.vllm_engine import AMX_SITE

HYBRID = {"model_type": "qwen3_5_text", "num_hidden_layers": 4, "linear_num_value_heads": 2}
WRAPPER = {**HYBRID, "model_type": "qwen3_5", "text_config": {}}
DENSE = {"model_type": "qwen3", "num_hidden_layers": 4}


def test_only_a_gated_deltanet_hybrid_on_a_cpu_is_pinned_to_bf16_and_loses_prefix_caching():
    assert gated_deltanet(HYBRID) and gated_deltanet(WRAPPER) and not gated_deltanet(DENSE)
    assert engine_dtype(HYBRID, "auto", cpu=True) == "bfloat16"
    assert engine_dtype(HYBRID, "auto", cpu=False) == "auto"  # CUDA: fla's kernels take any dtype
    assert engine_dtype(DENSE, "auto", cpu=True) == "auto"
    assert prefix_caching_off(WRAPPER, cpu=True) and not prefix_caching_off(WRAPPER, cpu=False)
    assert not prefix_caching_off(DENSE, cpu=True)
    problem = cpu_engine_problem(HYBRID, "float32", cpu=True, knob="--dtype")
    assert problem and "--dtype float32" in problem and "platform cpu" in problem and "BF16" in problem
    for dtype in ("auto", "bfloat16"):
        assert cpu_engine_problem(HYBRID, dtype, cpu=True, knob="--dtype") is None
    assert cpu_engine_problem(HYBRID, "float32", cpu=False, knob="--dtype") is None
    assert cpu_engine_problem(DENSE, "float32", cpu=True, knob="--dtype") is None


def test_an_engine_process_imports_the_qwen2_vl_processor_module_without_torchvision():
    """What vLLM's qwen3_vl.py imports (`smart_resize` from the torchvision module) resolves in a process
    started with the engine's site folder on PYTHONPATH; with torchvision installed nothing changes."""
    code = (
        "import importlib.util, sys\n"
        "from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize\n"
        "m = sys.modules['transformers.models.qwen2_vl.image_processing_qwen2_vl']\n"
        "tv = importlib.util.find_spec('torchvision') is not None\n"
        "print('torchvision' if tv else m.__name__.rsplit('.', 1)[-1], smart_resize(64, 64)[0] > 0)\n"
    )
    env = {"PYTHONPATH": str(AMX_SITE), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() in (["image_processing_pil_qwen2_vl", "True"], ["torchvision", "True"])


def test_gemma3_has_no_aux_hidden_states_in_vllm_so_its_source_and_served_drafter_are_refused(tmp_path):
    """vLLM 0.32's Gemma 3 classes lack SupportsEagle3 (seen here: "Model does not support EAGLE3
    interface but aux_hidden_state_outputs was requested" at engine start): preflight, `dflash eval
    --engine vllm|both` and `dflash export --vllm-check` refuse it before any engine or model loads."""
    import json

    import pytest

    from trainer.eval.served import ServedError, served_family_check

    for arch in ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"):
        problem = aux_states_problem({"architectures": [arch]}, "--engine vllm")
        assert problem and arch in problem and "SupportsEagle3" in problem
    for arch in ("Qwen3ForCausalLM", "Qwen3_5ForConditionalGeneration", "GptOssForCausalLM"):
        assert aux_states_problem({"architectures": [arch]}, "--engine vllm") is None
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForCausalLM"]}))
    with pytest.raises(ServedError, match="--vllm-check: vLLM 0.32's Gemma3ForCausalLM"):
        served_family_check(tmp_path, "--vllm-check")
